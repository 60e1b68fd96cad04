"""The GPU benchmark: named stages, one table, within a time limit (default 9 minutes), offline.

    python bench/gpu.py                                   # on a CUDA machine; bench/README.md says what to install
    python bench/gpu.py --only parity,granite8,compile    # some stages
    python bench/gpu.py --smoke --device cpu              # tiny widths on the CPU: the script itself (CI)

Every row goes to bench/results/<out>.jsonl as it is measured, and the table (<out>.md) is written at
the end, also when the time limit (--time-limit) is spent or the process gets SIGTERM: a stage that
fails or is stopped writes its reason into the table and the rest go on (or stop). Stages (`STAGES`):
- device: the device, driver and torch; the bf16 matmul peak, measured (an 8192^3 product). Always first.
- parity: against transformers on random 3-layer models, fp32 and bf16: max |logit difference|, argmax agreement.
- grouped: grouped_mm against the per-expert loop (outputs and gradients, one real-width MoE block).
- syncs: host syncs in one of train.py's optimizer steps (tiny model, TES).
- copies: bytes a LoRA step copies through cat/copy_/clone/casts on bank-shaped tensors (should be 0).
- attention: which SDPA backend torch picks per call shape (causal; packed bool mask with GQA) and the
  time of each, beside FlexAttention on the packed rows' block mask.
- granite8, olmoe8, granite32, olmoe16: the LoRA step and forward against transformers + peft at the
  official widths and that depth: rank 8 on q, k, v and the experts, dropout 0, bf16 weights under
  autocast, fp32 adapters, AdamW, batch 8 x 512; median of the timed steps after warm-up; MFU by 6N
  and by 4N (N: active parameters per token, the LM head included, the embedding not; 4N because a
  frozen base computes no weight gradients) against the measured peak; peak memory. Random weights
  made on the device.
- qwen3, deepseek3 (only when named in --only): the same LoRA step at 8 layers of Qwen3-30B-A3B's widths
  and of Moonlight-16B-A3B's (DeepSeek-V3's architecture: MLA, shared experts, sigmoid scores), peft on
  transformers 4.57's per-expert modules (bench/lora_peft.py's PEFT_TARGETS).
- granite4h, qwen3next (only when named in --only): the same at 8 layers of the hybrids, granite-4.0-h-tiny's
  widths (Mamba-2 layers and one NoPE attention layer) and Qwen3-Next-80B-A3B's (Gated DeltaNet and two gated
  attention layers); LoRA on q, k, v and the routed experts as above, the recurrent mixers frozen on both sides.
  transformers runs its torch paths (no mamba_ssm / causal-conv1d / fla kernels are installed).
- qwen35, deepseek32, gemma4 (only when named in --only): the 2026 families, Qwen3.5-35B-A3B's, DeepSeek-V3.2's and
  Gemma 4 26B-A4B's widths, peft on transformers 5's fused experts (bench/lora_peft.py's FUSED_TARGETS); on a CPU
  at CPU_CUTS' widths (2 layers, fewer experts, a 2048-token vocabulary, 1 x 128).
- On a CPU every LoRA stage holds its sides at once and alternates their steps one by one (interleaved_sides).
- nf4 (only when named in --only; needs torchao, the quant extra): one LoRA step at 8 layers of
  Qwen3-30B-A3B's widths (on a CPU one layer, all 128 experts, a 2048-token vocabulary, 1 x 128), the base in
  bf16 against the same weights packed in NF4 (--quantize nf4), dequantised a bank at a time and, as before, one
  expert at a time: step time and each step's peak memory, interleaved on one model whose base is swapped.
- compile: granite8 with `compile_layers`, and in mode="reduce-overhead" (CUDA graphs), beside eager.
- baselines: DenseMixer, router-only tuning, CE + affinity tuning and CE + load balancing, each one step's
  time over CE's, one layer at Granite's and OLMoE's widths, 4096 tokens (bench/baselines.py).
- chat: a chat LoRA + TES step at 4 layers of Qwen3-30B-A3B's widths (151,936-token vocabulary), 16 examples
  up to 2,048 tokens: one example a row, packed into rows of 4,096, and packed with the plain loss against
  the chunked one: tokens per second and peak memory (bench/chat_step.py's step).
- default: the default run's epoch (eager and --compile) and the scoring of the 500 SciQ test
  questions, on --default-model: its weights, or, for a folder holding only its config.json and
  tokenizer files (they travel; the 1.5 GB weights do not), random weights of its shape: timing only.

This file holds the stages table, the small stages and main; what every stage shares is in gpu_common.py, the
LoRA stages in gpu_lora.py, the nf4 stage in gpu_nf4.py, the default stage in gpu_default.py.
"""
from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import tempfile
import traceback
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common  # noqa: E402
from bench.gpu_common import (ROWS, SMOKE_WIDTHS, STREAM, Budget, Stopped, config, random_model, row,  # noqa: E402
                              syncs, timed)
from bench.gpu_default import default_run  # noqa: E402
from bench.gpu_lora import lora_step, reference_holds  # noqa: E402
from bench.gpu_nf4 import quantized_step  # noqa: E402
from minimoe.core.layers.experts import GroupedLinear  # noqa: E402
from minimoe.core.adaptation.lora import add_lora  # noqa: E402
from minimoe.core.decoder.model import MoEConfig, MoEForCausalLM, init_weights  # noqa: E402
from minimoe.loading.checkpoint import from_pretrained, save_pretrained


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
    n = 256 if smoke else 8192 if device.type == "cuda" else 2048  # a CPU's 8192^3 takes minutes
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
    from minimoe.core.layers import experts as model_module
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

    from minimoe import load_tokenizer

    from minimoe.data.benchmarks import load_split
    from minimoe.making.tiny import tiny_checkpoint
    from minimoe.runs import training
    from minimoe.runs.config import build_config
    cfg = build_config({"method": "tes", "layers": "all", "batch_size": 4, "grad_accum": 2, "device": str(device),
                        "dtype": "bfloat16", "pad_token_id": 0}, "tiny")
    model = from_pretrained(tiny_checkpoint(), dtype=torch.bfloat16).to(device)
    training.install_method(model, cfg)
    model.train()
    tokenizer = load_tokenizer(tiny_checkpoint())
    examples = load_split("arc_challenge", "train", data_dir=Path(tempfile.mkdtemp()) / "splits")[:8]
    optimizer = training.make_optimizer(model, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)

    def step():
        batches = training.micro_batches(examples, tokenizer, cfg, 0, 1)
        training.optimizer_step(model, batches, len(examples), optimizer, scheduler, cfg, 1, 1)
    step()  # warm-up
    syncs(step, device, "tiny TES all layers", "host syncs in one train.py optimizer step, logging included")


def bank_copies(device, smoke: bool):
    """Bytes one LoRA step (Granite widths, 1 layer, the GPU recipe) copies on tensors shaped like a bank
    (common.BankCopies: the logits' casts, larger than a bank at the real vocabulary, are not one)."""
    c = config("granitemoe", 1, smoke)
    if smoke:  # a smaller vocabulary (logits, embedding) and batch
        c.vocab_size = 128
    model = add_lora(random_model(c, device), rank=4, dropout=0.0).train()
    ids = torch.randint(2, c.vocab_size, (2, 16 if smoke else 512), device=device,
                        generator=torch.Generator(device).manual_seed(1))
    banks = [m.weight for m in model.modules() if isinstance(m, GroupedLinear)]
    with common.BankCopies(banks) as copies, torch.autocast(device.type, dtype=torch.bfloat16):
        model(ids).logits.float().logsumexp(-1).mean().backward()
    row("copies", "granitemoe 1L", "bytes copied on bank-shaped tensors in one LoRA step (rank 4)",
        sum(copies.bytes.values()), note="; ".join(copies.shapes))


def attention_backends(device, smoke: bool):
    """Per call shape: the SDPA backend torch picks (torch._fused_sdp_choice) and the forward + backward
    time, beside FlexAttention (compiled on CUDA) on the packed rows' block mask."""
    from torch.nn.attention import SDPBackend

    from minimoe.core.layers import masks
    names = {int(getattr(SDPBackend, n)): n.lower() for n in dir(SDPBackend) if n.isupper()}
    c = config("granitemoe", 1, smoke)
    B, T = (2, 64) if smoke else (8, 512)
    H, G, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    g = torch.Generator(device).manual_seed(0)
    q = torch.randn(B, H, T, d, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(B, G, T, d, device=device, dtype=torch.bfloat16, generator=g).requires_grad_() for _ in "kv")
    segments = (torch.arange(T, device=device) // (T // 8)).clamp(max=7).expand(B, T)  # a prompt and 7 choices
    dense = masks.bool_mask(None, B, T, 0, device, segments)
    calls = {"causal (no mask)": dict(attn_mask=None, is_causal=True), "packed bool mask": dict(attn_mask=dense)}
    for shape, kw in calls.items():
        choice = torch._fused_sdp_choice(q, k, v, kw["attn_mask"], 0.0, kw.get("is_causal", False), scale=None,
                                         enable_gqa=True)
        run = lambda kw=kw: F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw).sum().backward()  # noqa: E731
        t = statistics.median(timed(run, device, steps=3 if smoke else 10, warmup=1))
        row("attention", f"B{B} H{H} G{G} T{T} d{d}", f"SDPA {shape}: backend, fwd+bwd s", t,
            note=names.get(int(choice), str(choice)))
    if device.type != "cuda":
        row("attention", f"B{B} H{H} G{G} T{T} d{d}", "flex packed block mask: fwd+bwd s", note="no flex backward on the CPU")
        return
    mask = masks.block_mask(None, segments, B, T)
    run = lambda: masks.flex(True)(q, k, v, block_mask=mask, enable_gqa=True).sum().backward()  # noqa: E731
    t = statistics.median(timed(run, device, steps=10, warmup=2))
    row("attention", f"B{B} H{H} G{G} T{T} d{d}", "flex packed block mask: fwd+bwd s", t, note="compiled flex_attention")


def baseline_steps(device, smoke: bool):
    """The field's baselines' step time over CE's, one layer at Granite's and OLMoE's widths (bench/baselines.py)."""
    from bench.baselines import measure
    for family in ("granitemoe", "olmoe"):
        for r in measure(family, device, tokens=4096 if device.type == "cuda" and not smoke else 256,
                         rounds=2 if smoke else 5, smoke=smoke):
            row("baselines", r["model"], f"{r['candidate']}: step time / CE's", ratio=round(r["ratio"], 3),
                note=f"[{r['low']:.2f}-{r['high']:.2f}] over interleaved rounds; {r['trained']:,} trained parameters")


def chat_step(device, smoke: bool, steps: int = 3):
    """A chat LoRA + TES step (bench/chat_step.py's: train.py's micro-batches, step_loss, AdamW; the GPU recipe's
    bf16 base under autocast) at 4 layers of Qwen3-30B-A3B's widths and its 151,936-token vocabulary: 16
    examples of 256 to 2,048 random tokens, each one's second half supervised (an assistant turn), micro-batches
    of 8: one example a row, packed into rows of 4,096, and packed with the plain loss (the head on all of a
    micro-batch's supervised positions at once, not 1,024 at a time). Tokens per second (real tokens) and peak
    memory of each, the three interleaved step by step. --smoke: tiny widths, 8-position chunks (so that the
    chunked path runs), fp32."""
    from bench.chat_step import step_fns
    from minimoe.data.chat import TokenRow
    cuda = device.type == "cuda"
    c = config("qwen3_moe", 2 if smoke else 4, smoke)
    c = replace(c, pad_token_id=0, eos_token_id=1) if smoke else c  # Qwen's ids are past the smoke vocabulary
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(8, 40, (6,), generator=g) if smoke else torch.randint(256, 2049, (16,), generator=g)
    rows = [TokenRow(torch.randint(2, c.vocab_size, (n,), generator=g).tolist(), [t >= n // 2 for t in range(n)])
            for n in lengths.tolist()]
    chunk = 8 if smoke else None
    layouts = {"one a row": (False, chunk), "packed": (True, chunk), "packed, plain loss": (True, 10**9)}
    model = random_model(c, device).train()
    model = model if cuda else model.float()
    fns, fed = step_fns(model, rows, {"device": str(device), "dtype": "bfloat16" if cuda else "float32",
                                      "batch_size": 3 if smoke else 8, "max_length": 64 if smoke else 4096},
                        None, layouts)
    times, peaks = {layout: [] for layout in fns}, {}
    for i in range(1 + steps):  # the first round warms up
        for layout, fn in fns.items():
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            t = timed(fn, device, 1, 0)[0]
            times[layout] += [t] if i else []
            if cuda:
                peaks[layout] = max(peaks.get(layout, 0.0), torch.cuda.max_memory_allocated(device) / 2**30)
    real, base = sum(len(r.ids) for r in rows), statistics.median(times["one a row"])
    name = f"qwen3_moe {c.num_hidden_layers}L V{c.vocab_size}"
    for layout in fns:
        t = statistics.median(times[layout])
        peak = f"; peak {peaks[layout]:.2f} GiB" if peaks else ""
        row("chat", name, f"tokens/s, {layout}", real / t, real / base, base / t,
            note=f"reference: one example a row; {fed[layout][0]} rows, {fed[layout][1]} tokens fed; {steps} steps{peak}")


STAGES = ("parity", "grouped", "syncs", "copies", "attention", "granite8", "olmoe8", "granite32", "olmoe16",
          "qwen3", "deepseek3", "granite4h", "qwen3next", "qwen35", "deepseek32", "gemma4", "nf4", "compile",
          "baselines", "chat", "default")
# --full-depth adds granite32 and olmoe16; today's families, the hybrids, the 2026 families and nf4 (needs torchao)
# run when --only names them
DEFAULT_STAGES = tuple(s for s in STAGES if s not in ("granite32", "olmoe16", "qwen3", "deepseek3", "granite4h",
                                                      "qwen3next", "qwen35", "deepseek32", "gemma4", "nf4"))
LORA_STAGES = {"granite8": ("granitemoe", 8), "olmoe8": ("olmoe", 8), "granite32": ("granitemoe", 32),
               "olmoe16": ("olmoe", 16), "qwen3": ("qwen3_moe", 8), "deepseek3": ("deepseek_v3", 8),
               "granite4h": ("granitemoehybrid", 8), "qwen3next": ("qwen3_next", 8),
               # the 2026 families (transformers 5 only): DeepSeek-V3.2 at 4 layers, its first 3 dense, 1 of 256 experts
               "qwen35": ("qwen3_5_moe", 8), "deepseek32": ("deepseek_v32", 4), "gemma4": ("gemma4_text", 8)}


SMOKE_LAYERS = {"deepseek32": 4}  # a stage whose smoke run needs more than 2 layers (DeepSeek-V3.2: an MoE layer)


# The nf4 stage: on a GPU 8 layers at the recipe's batch; on a CPU one layer, a 2048-token vocabulary, 1 x 128.
NF4_STAGE = {True: dict(layers=8), False: dict(layers=1, vocab=2048, batch=(1, 128), steps=5)}


def stages(names: list[str], device, args, peak: float, budget: Budget) -> list:
    """(name, callable) for each stage asked for, in STAGES order."""
    plain, peft = ["minimoe"], ["transformers + peft"]
    todo = {"parity": lambda: parity(device, args.smoke), "grouped": lambda: grouped_vs_loop(device, args.smoke),
            "syncs": lambda: training_step_syncs(device), "copies": lambda: bank_copies(device, args.smoke),
            "attention": lambda: attention_backends(device, args.smoke),
            "nf4": lambda: quantized_step(device, args.smoke, **NF4_STAGE[device.type == "cuda"])}
    for name, (family, layers) in LORA_STAGES.items():
        n = SMOKE_LAYERS.get(name, 2) if args.smoke else layers
        todo[name] = lambda f=family, n=n: lora_step(device, f, n, args.smoke, peak, budget,  # 4.57: no 2026 family
                                                     plain + peft if reference_holds(f) else plain)
    compiled = ["minimoe compiled", "minimoe compiled + CUDA graphs"]
    if device.type == "cuda":  # compile_layers needs bf16 grouped_mm everywhere: not the CPU recipe
        todo["compile"] = lambda: lora_step(device, "granitemoe", 2 if args.smoke else 8, args.smoke, peak, budget,
                                            plain + compiled)
    else:
        todo["compile"] = lambda: row("compile", "-", "not run on the CPU", note="the CPU recipe's LoRA is fp32")
    todo["baselines"] = lambda: baseline_steps(device, args.smoke)
    todo["chat"] = lambda: chat_step(device, args.smoke)
    if args.default_model.is_dir() and (args.default_model / "config.json").is_file() and not args.smoke:
        todo["default"] = lambda: default_run(device, args.default_model, budget)
    else:
        todo["default"] = lambda: row("default run", args.default_model.name, "skipped",
                                      note="--smoke" if args.smoke else "no default model folder (--default-model)")
    return [(name, todo[name]) for name in STAGES if name in names]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--only", default=None, help=f"comma-separated stages of {', '.join(STAGES)} "
                                                 f"(default: all but granite32 and olmoe16)")
    p.add_argument("--time-limit", "--budget", dest="budget", type=float, default=540,
                   help="seconds for the whole script (default: 540); the table is written when it is spent")
    p.add_argument("--full-depth", action="store_true", help="also granite32 and olmoe16")
    p.add_argument("--smoke", action="store_true", help="tiny widths: checks the script, measures nothing")
    p.add_argument("--default-model", type=Path, default=Path(__file__).resolve().parents[1] / "weights/smollm2-135m-moe")
    p.add_argument("--out", default="gpu", help="bench/results/<out>.md and <out>.jsonl (default: gpu)")
    args = p.parse_args(argv)
    names = args.only.split(",") if args.only else list(DEFAULT_STAGES) + (["granite32", "olmoe16"] if args.full_depth else [])
    if unknown := [n for n in names if n not in STAGES]:
        p.error(f"--only: unknown stage(s) {', '.join(unknown)}; expected some of {', '.join(STAGES)}")
    ROWS.clear()
    common.RESULTS.mkdir(parents=True, exist_ok=True)
    STREAM[:] = [common.RESULTS / f"{args.out}.jsonl"]
    STREAM[0].write_text("")
    device, budget = torch.device(args.device), Budget(args.budget)

    def stop(signum, frame):
        raise Stopped(f"signal {signum}")
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        peak = environment(device, args.smoke)
        for name, section in stages(names, device, args, peak, budget):
            if budget.left() < 20:
                row(name, "-", "skipped", note="time budget spent")
                continue
            try:
                section()
            except Stopped as e:
                row(name, "-", "stopped", note=str(e))
                break
            except Exception as e:  # one broken section must not lose the others' figures
                traceback.print_exc()
                row(name, "-", "failed", note=f"{type(e).__name__}: {str(e)[:200]}")
    except Stopped as e:
        row("device", "-", "stopped", note=str(e))
    finally:
        signal.signal(signal.SIGTERM, previous)
        STREAM.clear()
        lines = ["| section | model | metric | minimoe | transformers (+ peft) | ratio | note |", "|" + "---|" * 7]
        for r in ROWS:
            lines.append(f"| {r['section']} | {r['model']} | {r['metric']} | {common.fmt(r['minimoe'])} | "
                         f"{common.fmt(r['reference'])} | {common.fmt(r['ratio'])} | {r['note']} |")
        common.write_report("\n".join(lines), args.out)
    return ROWS


if __name__ == "__main__":
    main()
