"""The GPU benchmark: one command, one table, within a time budget (default 9 minutes), offline.

    python bench/gpu.py                       # on a CUDA machine; bench/README.md says what to install
    python bench/gpu.py --full-depth          # also the official depths, where the budget allows
    python bench/gpu.py --smoke --device cpu  # tiny widths on the CPU: the script itself, in seconds (CI)

Sections, in order; one that fails or finds its budget spent writes its reason into the table and
the rest go on:
1. the device, driver and torch; the bf16 matmul peak, measured (an 8192^3 product);
2. parity against transformers on random 3-layer models, fp32 and bf16: max |logit difference| and
   argmax agreement;
3. grouped_mm against the per-expert loop (outputs and gradients, one real-width MoE block);
4. the LoRA step and the forward against transformers + peft at the official widths, 8 layers (full
   depth with --full-depth): rank 8 on q, k, v and the experts, dropout 0, bf16 weights under
   autocast, fp32 adapters, AdamW, batch 8 x 512; median of the timed steps after warm-up; minimoe
   eager, with `compile_layers`, and with it in mode="reduce-overhead" (CUDA graphs); MFU by 6N and by 4N (N: active parameters per token, the LM head
   included, the embedding not; 4N because a frozen base computes no weight gradients) against the
   measured peak; peak memory; host syncs in one training step;
5. the default run's epoch and the scoring of the 500 SciQ test questions, where the default model
   (weights/smollm2-135m-moe, or --default-model) and the SciQ files ($MINIMOE_CACHE) are there.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common  # noqa: E402
from minimoe.core.lora import add_lora  # noqa: E402
from minimoe.core.model import MoEConfig, MoEForCausalLM, compile_layers, init_weights  # noqa: E402
from minimoe.loading.checkpoint import from_pretrained, save_pretrained  # noqa: E402

ROWS: list[dict] = []
SMOKE_WIDTHS = dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                    num_experts=8, num_experts_per_tok=2)


def row(section, model, metric, minimoe=None, reference=None, ratio=None, note=""):
    ROWS.append(dict(section=section, model=model, metric=metric, minimoe=minimoe, reference=reference,
                     ratio=ratio, note=note))


class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, steps: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def config(family: str, layers: int, smoke: bool) -> MoEConfig:
    d = dict(common.OFFICIAL[family], num_hidden_layers=layers)
    if smoke:
        d.update(SMOKE_WIDTHS)
    return MoEConfig(**d)


def active_params(c: MoEConfig) -> int:
    """N: parameters a token passes through (attention, router, its K experts, the LM head)."""
    d = c.head_dim
    attn = c.hidden_size * d * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
    experts = c.num_experts_per_tok * 3 * c.hidden_size * c.intermediate_size
    return c.num_hidden_layers * (attn + experts + c.hidden_size * c.num_experts) + c.vocab_size * c.hidden_size


# ----------------------------------------------------------------------------- sections

def environment(device, smoke: bool) -> float:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    driver = "-"
    if device.type == "cuda":
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            pass
    n = 256 if smoke else 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    times = timed(lambda: a @ b, device, steps=5 if smoke else 20, warmup=2)
    peak = 2 * n**3 / statistics.median(times)
    row("device", name, f"driver {driver}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    row("device", name, f"bf16 matmul peak ({n}^3), TFLOP/s", peak / 1e12)
    return peak


def parity(device, smoke: bool):
    """Random 3-layer models of both families saved once, loaded by both sides: logits compared."""
    from transformers import AutoModelForCausalLM
    for family in ("olmoe", "granitemoe"):
        c = MoEConfig(**{**common.OFFICIAL[family], **SMOKE_WIDTHS, "num_hidden_layers": 3,
                         "hidden_size": 256, "intermediate_size": 128})
        with tempfile.TemporaryDirectory() as folder:
            save_pretrained(init_weights(MoEForCausalLM(c), std=0.05, generator=torch.Generator().manual_seed(0)),
                            folder)
            ids = torch.randint(0, c.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1)).to(device)
            logits = {}
            for dtype in (torch.float32, torch.bfloat16):
                ours = from_pretrained(folder, dtype=dtype).to(device).eval()
                ref = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager").to(device)
                with torch.no_grad():
                    logits[dtype] = ours(ids).logits.float(), ref.eval()(ids).logits.float()
                del ours, ref
            (o32, r32), (o16, r16) = logits[torch.float32], logits[torch.bfloat16]
            row("parity", f"{family} 3L", "fp32 max |logit diff| vs transformers", (o32 - r32).abs().max().item(),
                note=f"logits up to {r32.abs().max().item():.2f}")
            agree = (o16.argmax(-1) == r16.argmax(-1)).float().mean().item()
            row("parity", f"{family} 3L", "bf16 argmax agreement with transformers bf16", agree,
                note=f"bf16 error vs fp32: ours {(o16 - r32).abs().max().item():.3g}, "
                     f"transformers {(r16 - r32).abs().max().item():.3g}")


def grouped_vs_loop(device, smoke: bool):
    from minimoe.core import experts as model_module
    model = init_weights(MoEForCausalLM(config("granitemoe", 1, smoke)), generator=torch.Generator().manual_seed(0))
    block = model.to(device, torch.bfloat16).model.layers[0].mlp
    x = torch.randn(64 if smoke else 4096, model.config.hidden_size, device=device, dtype=torch.bfloat16)
    results = []
    for grouped in (True, False):
        model_module.USE_GROUPED_MM = grouped
        xi = x.clone().requires_grad_(True)
        out, _ = block(xi[None])
        out.float().square().mean().backward()
        results.append((out.detach(), xi.grad, block.experts.gate_up_proj.weight.grad))
        block.zero_grad(set_to_none=True)
    model_module.USE_GROUPED_MM = hasattr(F, "grouped_mm")
    (o, gx, gw), (o2, gx2, gw2) = results
    row("grouped_mm", "granitemoe block", "max |diff| output / input grad / bank grad vs the loop",
        f"{(o - o2).abs().max().item():.3g} / {(gx - gx2).abs().max().item():.3g} / {(gw - gw2).abs().max().item():.3g}")


def training_step_syncs(device):
    """Host syncs in one of train.py's optimizer steps (the tiny model, TES at every layer, the GPU
    recipe: bf16 weights under autocast), its logging included."""
    from dataclasses import replace

    from minimoe import load_tokenizer

    from minimoe.data.benchmarks import load_split
    from minimoe.loading.tiny import tiny_checkpoint
    from minimoe.runs import training
    from minimoe.runs.config import RECIPES, TrainConfig, method_for
    cfg = TrainConfig(**{**RECIPES["tiny"], "method": "tes", "layers": "all", "batch_size": 4, "grad_accum": 2,
                         "device": str(device), "dtype": "bfloat16", "pad_token_id": 0})
    model = from_pretrained(tiny_checkpoint(), dtype=torch.bfloat16).to(device)
    method = method_for(cfg)
    training.install_method(model, cfg, method)
    model.train()
    tokenizer = load_tokenizer(tiny_checkpoint())
    examples = load_split("arc_challenge", "train", data_dir=Path(tempfile.mkdtemp()) / "splits")[:8]
    optimizer = training.make_optimizer(model, cfg, method)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)

    def step():
        batches = training.micro_batches(examples, tokenizer, cfg, 0, 1)
        training.optimizer_step(model, batches, len(examples), optimizer, scheduler, replace(cfg), method, 1, 1)
    step()  # warm-up
    syncs(step, device, "tiny TES all layers", "host syncs in one train.py optimizer step, logging included")


def measure_side(side: str, folder, family: str, ids, device, steps: int, warmup: int, name: str) -> dict:
    """One side's LoRA step and forward times, warm-up (compilation included) and peak memory."""
    from bench.lora_peft import peft_wrap
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    torch._dynamo.reset()  # each compiled side compiles afresh, its own settings
    if side == "transformers + peft":
        model = peft_wrap(common.load_hf(Path(folder), torch.bfloat16, "sdpa"), family).to(device)
        kw = {"use_cache": False}
    else:
        model = from_pretrained(folder, dtype=torch.bfloat16, device=device)
        add_lora(model, rank=8, alpha=8, dropout=0.0, targets=("q", "k", "v", "experts"))
        kw = {}
        if side == "minimoe compiled":
            compile_layers(model)
        elif side == "minimoe compiled + CUDA graphs":  # static shapes here: inductor's CUDA graph trees
            compile_layers(model, mode="reduce-overhead")
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

    def forward():
        with torch.no_grad(), autocast:
            model(input_ids=ids, **kw)

    def step():
        with autocast:
            logits = model(input_ids=ids, **kw).logits
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    step_times = timed(step, device, steps, warmup)
    first = time.perf_counter() - t0 - sum(step_times)  # the warm-up steps, compilation included
    fwd_times = timed(forward, device, steps, 1)
    memory = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    if side == "minimoe":
        syncs(step, device, name)
    return dict(step=statistics.median(step_times), forward=statistics.median(fwd_times), memory=memory, warmup=first)


def lora_step(device, family: str, layers: int, smoke: bool, peak: float, budget: Budget, compile_too: bool):
    """minimoe (eager, compiled, compiled with CUDA graphs) against transformers + peft, same random weights."""
    c = config(family, layers, smoke)
    B, T = (2, 64) if smoke else (8, 512)
    steps, warmup = (2, 1) if smoke else (8, 3)
    ids = torch.randint(2, c.vocab_size, (B, T), generator=torch.Generator().manual_seed(5)).to(device)
    name = f"{family} {layers}L"
    with tempfile.TemporaryDirectory() as folder:
        model = init_weights(MoEForCausalLM(c).to(torch.bfloat16), generator=torch.Generator().manual_seed(0))
        save_pretrained(model, folder)
        del model
        results = {}
        compiled = ["minimoe compiled", "minimoe compiled + CUDA graphs"] if compile_too else []
        for side in ["minimoe", *compiled, "transformers + peft"]:
            if budget.left() < 30:
                row("lora", name, f"{side}: skipped", note="time budget spent")
                continue
            try:
                results[side] = measure_side(side, folder, family, ids, device, steps, warmup, name)
            except Exception as e:  # a side that fails (a compile error, say) must not lose the others
                traceback.print_exc()
                row("lora", name, f"{side}: failed", note=f"{type(e).__name__}: {str(e)[:200]}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    tokens, N = B * T, active_params(c)
    ref = results.get("transformers + peft")
    for side, r in results.items():
        speedup = ref["step"] / r["step"] if ref and side != "transformers + peft" else None
        mfu6, mfu4 = 6 * N * tokens / r["step"] / peak, 4 * N * tokens / r["step"] / peak
        row("lora", name, f"{side}: step s (B{B} x T{T})", r["step"], ref["step"] if ref else None, speedup,
            note=f"MFU 6N {mfu6:.1%}, 4N {mfu4:.1%}; warm-up {r['warmup']:.1f} s"
                 + (f"; peak {r['memory']:.1f} GiB" if r["memory"] is not None else ""))
        fwd_ratio = ref["forward"] / r["forward"] if ref and side != "transformers + peft" else None
        row("forward", name, f"{side}: forward s", r["forward"], ref["forward"] if ref else None, fwd_ratio)


def syncs(step, device, name, metric="host syncs in one LoRA step"):
    """Host syncs in one step: the dispatcher's view (HostSyncs, any device) and, on CUDA, torch's own
    sync debug mode (which also sees copies to the host)."""
    with common.HostSyncs(device.type if device.type != "cpu" else None) as seen:
        step()
    cuda_syncs = "-"
    if device.type == "cuda":
        sync(device)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                step()
            cuda_syncs = sum("synchroniz" in str(w.message) for w in caught)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    row("syncs", name, f"{metric} (dispatcher ops / CUDA sync debug mode)", f"{seen.total} / {cuda_syncs}",
        note=json.dumps(seen.counts) if seen.counts else "")


def default_run(device, folder: Path, budget: Budget):
    """The default run's epoch (train.py, the step seconds in metrics.jsonl) and the scoring of the 500
    SciQ test questions, on the default model."""
    from minimoe import load_tokenizer
    from minimoe.data.benchmarks import load_split
    from minimoe.evaluation.accuracy import evaluate_split
    examples = load_split("sciq", "test", data_dir=Path(tempfile.mkdtemp()) / "splits")
    model = from_pretrained(folder, dtype=torch.bfloat16).to(device)
    tokenizer = load_tokenizer(folder)
    score = lambda: evaluate_split(model, tokenizer, examples, batch_size=64, device=device, diagnostics=False)  # noqa: E731
    times = timed(score, device, steps=3, warmup=1)
    row("default run", folder.name, f"score {len(examples)} SciQ test questions, s", statistics.median(times),
        note="bf16, batch 64; target <= 2 s")
    model = None  # free the GPU for train.py
    for flags in ([], ["--compile"]):
        if budget.left() < 90:
            row("default run", folder.name, f"epoch {' '.join(flags)}: skipped", note="time budget spent")
            continue
        with tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, str(Path(__file__).resolve().parents[1] / "train.py"), "--model", str(folder),
                   "--data", "sciq", "--epochs", "1", "--no-zero-shot", "--no-test-eval", "--quiet",
                   "--device", str(device), "--out-dir", out, "--run-name", "r", *flags]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(60, budget.left()))
            if proc.returncode:
                raise RuntimeError(f"train.py {' '.join(flags)} failed: {proc.stderr[-1500:]}")
            steps = [json.loads(line) for line in open(Path(out) / "r" / "metrics.jsonl")]
            epoch = sum(r["seconds"] for r in steps if r["kind"] == "step")
            row("default run", folder.name, f"epoch s (sum of step seconds) {' '.join(flags)}".strip(), epoch,
                note=f"process wall {time.perf_counter() - t0:.0f} s; target <= 5 s")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--budget", type=float, default=540, help="seconds for the whole script (default: 540)")
    p.add_argument("--full-depth", action="store_true", help="also 32-layer Granite and 16-layer OLMoE")
    p.add_argument("--smoke", action="store_true", help="tiny widths: checks the script, measures nothing")
    p.add_argument("--default-model", type=Path, default=Path(__file__).resolve().parents[1] / "weights/smollm2-135m-moe")
    p.add_argument("--out", default="gpu", help="bench/results/<out>.md (default: gpu)")
    args = p.parse_args(argv)
    ROWS.clear()
    device, budget = torch.device(args.device), Budget(args.budget)
    compile_too = device.type == "cuda"  # compile_layers needs bf16 grouped_mm everywhere: not the CPU recipe
    peak = environment(device, args.smoke)
    sections = [("parity", lambda: parity(device, args.smoke)),
                ("grouped_mm", lambda: grouped_vs_loop(device, args.smoke)),
                ("syncs", lambda: training_step_syncs(device))]
    depths = [("granitemoe", 2 if args.smoke else 8), ("olmoe", 2 if args.smoke else 8)]
    if args.full_depth:
        depths += [("granitemoe", 32), ("olmoe", 16)]
    for family, layers in depths:
        sections.append((f"lora {family} {layers}L",
                         lambda f=family, n=layers: lora_step(device, f, n, args.smoke, peak, budget, compile_too)))
    if args.default_model.is_dir() and not args.smoke:
        sections.append(("default run", lambda: default_run(device, args.default_model, budget)))
    else:
        row("default run", args.default_model.name, "skipped", note="no default model folder (--default-model)"
            if not args.smoke else "--smoke")
    for name, section in sections:
        if budget.left() < 20:
            row(name, "-", "skipped", note="time budget spent")
            continue
        try:
            section()
        except Exception as e:  # one broken section must not lose the others' figures
            traceback.print_exc()
            row(name, "-", "failed", note=f"{type(e).__name__}: {str(e)[:200]}")
    lines = ["| section | model | metric | minimoe | transformers (+ peft) | ratio | note |", "|" + "---|" * 7]
    for r in ROWS:
        lines.append(f"| {r['section']} | {r['model']} | {r['metric']} | {common.fmt(r['minimoe'])} | "
                     f"{common.fmt(r['reference'])} | {common.fmt(r['ratio'])} | {r['note']} |")
    common.write_report("\n".join(lines), args.out)
    return ROWS


if __name__ == "__main__":
    main()
