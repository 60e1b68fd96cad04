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
"""
from __future__ import annotations

import argparse
import json
import math
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common  # noqa: E402
from minimoe.core.layers.experts import GroupedLinear  # noqa: E402
from minimoe.core.adaptation.lora import add_lora  # noqa: E402
from minimoe.core.decoder.model import MoEConfig, MoEForCausalLM, compile_layers, init_weights  # noqa: E402
from minimoe.loading.checkpoint import from_pretrained, save_pretrained
from minimoe.loading.config_json import config_from_dict  # noqa: E402

ROWS: list[dict] = []
STREAM: list[Path] = []  # the JSONL that every row is appended to as it is made (main sets it)
SMOKE_WIDTHS = dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                    num_experts=8, num_experts_per_tok=2)
# The published widths that SMOKE_WIDTHS leaves wide, cut for the CPU (head_dim: hidden / heads, as above).
SMOKE_EXTRA = dict(head_dim=16, dense_intermediate_size=48, kv_lora_rank=16, qk_nope_head_dim=16,
                   qk_rope_head_dim=8, v_head_dim=16, shared_expert_intermediate_size=40,
                   # the hybrids' mixers (Mamba-2's head width follows: 2 x 64 / 8; chunks shorter than the rows)
                   mamba_n_heads=8, mamba_d_head="auto", mamba_d_state=16, mamba_chunk_size=16,
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                   # the 2026 families': the DSA indexer, MLA's q low rank, Gemma 4's global layers
                   index_n_heads=4, index_head_dim=16, index_topk=16, q_lora_rank=32, global_head_dim=32,
                   num_global_key_value_heads=1)


def row(section, model, metric, minimoe=None, reference=None, ratio=None, note=""):
    note = " ".join(str(note).split())  # an error's lines would break the table's row
    ROWS.append(dict(section=section, model=model, metric=metric, minimoe=minimoe, reference=reference,
                     ratio=ratio, note=note))
    for path in STREAM:
        with open(path, "a") as f:
            f.write(json.dumps(ROWS[-1], default=str) + "\n")


class Stopped(Exception):
    """SIGTERM (a time limit outside the script): the table is written with what was measured."""


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
    if family in common.OFFICIAL_NEW:  # config.json's names, read through the family's record
        d = common.OFFICIAL_NEW[family]
        kinds = {"layer_types": d["layer_types"][:layers]} if "layer_types" in d else {}  # a hybrid's first layers
        c = config_from_dict({**d, "num_hidden_layers": layers, **kinds})
        if not smoke:
            return c
        mla = {"num_key_value_heads": SMOKE_WIDTHS["num_attention_heads"]} if "mla" in c.mixers else {}  # one kv head each
        if c.mixer_types:  # a hybrid's few smoke layers: each of its mixers once, in the order the full depth has them
            every = list(dict.fromkeys(config_from_dict(dict(d)).mixer_types))
            mla["mixer_types"] = (every * layers)[:layers]
        flat = c.flat()  # the mixers' options by their flat names, as SMOKE_EXTRA's
        if flat.get("n_group", 1) > 1:  # expert groups of two at the smoke run's 8 experts (DeepSeek-V3.2's 8 groups)
            mla.update(n_group=4, topk_group=2)
        return MoEConfig.from_flat({**flat, **SMOKE_WIDTHS, **mla, **{k: v for k, v in SMOKE_EXTRA.items() if flat.get(k)},
                                    "extra": c.extra})
    d = dict(common.OFFICIAL[family], num_hidden_layers=layers)
    if smoke:
        d.update(SMOKE_WIDTHS)
    return MoEConfig(**d)


def active_params(c: MoEConfig) -> int:
    """N: parameters a token passes through: every weight but the embedding, the routed experts' banks
    counted K / E (attention, norms, routers, shared experts, dense layers and the LM head whole, tied or not)."""
    with torch.device("meta"):
        model = MoEForCausalLM(c)
    share = c.num_experts_per_tok / c.num_experts
    return round(sum(p.numel() * (share if ".mlp.experts." in name else 1)
                     for name, p in model.named_parameters(remove_duplicate=False) if "embed_tokens" not in name))


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


def side_fns(side: str, folder, family: str, ids, device, donor=None):
    """One side's model, loaded from `folder` with its LoRA: (forward, step) callables, AdamW in the step, and
    the model. donor: a model already loaded whose equal frozen weights transformers' side adopts (adopt_equal)."""
    from bench.lora_peft import peft_wrap
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    torch._dynamo.reset()  # each compiled side compiles afresh, its own settings
    if side == "transformers + peft":
        model = common.load_hf(Path(folder), torch.bfloat16, "sdpa")
        if donor is not None:
            adopt_equal(model, donor)
        model = peft_wrap(model, family).to(device)
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
    # CUDA graph trees reuse their output buffers from one replay to the next: each forward says a new step
    # began (without it the H200 run failed: "accessing tensor output of CUDAGraphs that has been overwritten").
    graphs = side == "minimoe compiled + CUDA graphs"
    begin = torch.compiler.cudagraph_mark_step_begin if graphs else (lambda: None)

    def forward():
        begin()
        with torch.no_grad(), autocast:
            model(input_ids=ids, **kw)

    def step():
        begin()
        with autocast:
            logits = model(input_ids=ids, **kw).logits
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return forward, step, model


def adopt_equal(model, donor) -> int:
    """Make each frozen parameter of `model` that equals one of `donor`'s (shape, dtype and values) a view of the
    donor's storage; returns the values shared. The CPU rows hold both sides at once: the same random weights
    are then in memory once (a LoRA bank's view strides over its [W | s B] buffer; peft adds its delta to it,
    a fresh tensor, whatever the strides)."""
    frozen = {}
    for q in donor.parameters():
        if not q.requires_grad:
            frozen.setdefault((tuple(q.shape), q.dtype), []).append(q)
    shared = 0
    for p in model.parameters():
        same = next((q for q in frozen.get((tuple(p.shape), p.dtype), []) if torch.equal(p, q)), None)
        if same is not None:
            p.data, shared = same.data, shared + p.numel()
    return shared


def measure_side(side: str, folder, family: str, ids, device, steps: int, warmup: int, name: str) -> dict:
    """One side's LoRA step and forward times, warm-up (compilation included) and peak memory."""
    forward, step, _ = side_fns(side, folder, family, ids, device)
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


def interleaved_sides(sides: list[str], folder, family: str, ids, device, steps: int, warmup: int) -> dict:
    """On a CPU: every side's model held at once, their steps (then forwards) alternated one by one
    (common.interleaved, the order rotating), so that a shared machine's slow spells hit all sides alike;
    each side's median, and its per-round ratio to the reference (median, min, max) where both ran."""
    fns = {}
    for side in sides:  # minimoe's first: transformers' adopts its equal weights
        donor = next((f[2] for s, f in fns.items() if s == "minimoe"), None)
        fns[side] = side_fns(side, folder, family, ids, device, donor)
    def shown(what, side, fn):  # a CPU's step at these widths takes many seconds on a shared machine: progress
        def run():
            t0 = time.perf_counter()
            fn()
            print(f"{family} {what}, {side}: {time.perf_counter() - t0:.2f} s", file=sys.stderr, flush=True)
        return run
    t0 = time.perf_counter()
    steps_t = common.interleaved({s: shown("step", s, f[1]) for s, f in fns.items()}, rounds=steps, warmup=warmup)
    first = time.perf_counter() - t0 - sum(map(sum, steps_t.times.values()))
    fwd_t = common.interleaved({s: shown("forward", s, f[0]) for s, f in fns.items()}, rounds=steps, warmup=1)
    ref = "transformers + peft"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux: the process's peak so far, GiB
    return {side: dict(step=steps_t.median(side), forward=fwd_t.median(side), memory=None, warmup=first, rss=rss,
                       rounds=steps_t.ratio(ref, side) if ref in fns and side != ref else None,
                       fwd_rounds=fwd_t.ratio(ref, side) if ref in fns and side != ref else None)
            for side in sides}


def random_model(c: MoEConfig, device) -> MoEForCausalLM:
    """Random bf16 weights of config c, drawn on the device (a CPU init of a 3B model takes minutes)."""
    with torch.device(device):
        model = MoEForCausalLM(c).to(torch.bfloat16)
    return init_weights(model, generator=torch.Generator(device).manual_seed(0))


def lora_step(device, family: str, layers: int, smoke: bool, peak: float, budget: Budget, sides: list[str]):
    """The LoRA step of each of `sides` (minimoe eager, compiled, compiled with CUDA graphs; transformers +
    peft), same random weights: on a GPU one side after the other (each its own peak memory), on a CPU
    interleaved (interleaved_sides), the 2026 families at CPU_CUTS' widths."""
    cpu = device.type == "cpu"
    cut = cpu and not smoke and family in CPU_CUTS  # CPU_CUTS' widths
    c = cpu_config(family) if cut else config(family, layers, smoke)
    B, T = (2, 64) if smoke else CPU_BATCH if cpu else (8, 512)
    steps, warmup = (2, 1) if smoke else (3, 1) if cpu else (8, 3)
    ids = torch.randint(2, c.vocab_size, (B, T), generator=torch.Generator().manual_seed(5)).to(device)
    name = f"{family} {c.num_hidden_layers}L" + (f" E{c.num_experts} V{c.vocab_size}" if cut else "")
    with tempfile.TemporaryDirectory() as folder:
        save_pretrained(random_model(c, device), folder)
        results = {}
        if cpu:  # both sides at once, interleaved step by step (a shared CPU); no per-side peak
            results = interleaved_sides(sides, folder, family, ids, device, steps, warmup)
        for side in sides if not cpu else ():
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
        rounds = (f"; per round {r['rounds'][0]:.2f}x [{r['rounds'][1]:.2f}-{r['rounds'][2]:.2f}], interleaved"
                  if r.get("rounds") else "")
        mfu = "" if cpu else f"MFU 6N {mfu6:.1%}, 4N {mfu4:.1%}; "  # a shared CPU's measured peak is not its own
        row("lora", name, f"{side}: step s (B{B} x T{T})", r["step"], ref["step"] if ref else None, speedup,
            note=f"{mfu}warm-up {r['warmup']:.1f} s"
                 + (f"; peak {r['memory']:.1f} GiB" if r["memory"] is not None else "") + rounds
                 + (f"; process peak RSS {r['rss']:.1f} GiB, the sides held at once" if r.get("rss") else ""))
        fwd_ratio = ref["forward"] / r["forward"] if ref and side != "transformers + peft" else None
        rounds = (f"per round {r['fwd_rounds'][0]:.2f}x [{r['fwd_rounds'][1]:.2f}-{r['fwd_rounds'][2]:.2f}]"
                  if r.get("fwd_rounds") else "")
        row("forward", name, f"{side}: forward s", r["forward"], ref["forward"] if ref else None, fwd_ratio, note=rounds)


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


class PerExpertNF4:
    """An NF4Weight dequantised as core/adaptation/quantized.py did before its whole-bank lookup: one torchao
    NF4Tensor per expert matrix, `get_original_weight` in a Python loop. The same packed values."""

    def __init__(self, packed):
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, SubclassTensorArgs
        self.packed, self.shape = packed, packed.shape
        rows, cols = packed.shape[-2:]
        meta = SubclassTensorArgs(torch.Size((rows, cols)), (cols, 1), 0, packed.dtype, packed.device, False)
        table = packed.pairs[:16, 1]  # byte b's low nibble is b for b < 16: the 16 levels
        blocks = rows * cols // 64
        self.parts = [NF4Tensor(meta, 64, blocks, blocks // packed.factors.shape[1], packed.scalers[e],
                                packed.factors[e], packed.means[e], packed.codes[e], table)
                      for e in range(packed.codes.shape[0])]

    def dequantize_into(self, out):
        for o, q in zip(out.unsqueeze(0) if out.dim() == 2 else out, self.parts):
            o.copy_(q.get_original_weight())
        return out


def base_forms(model) -> dict:
    """Each packed module of `model` (quantize_model, then add_lora: what --quantize nf4 builds) -> its packed base
    in the two forms the nf4 stage times beside bf16: "nf4" (the NF4Weight, dequantised a bank at a time) and "nf4
    per expert" (`PerExpertNF4` on the same packed values). One model whose bases are swapped between steps
    (use_base), not three models (at 128 experts three one-layer models did not fit a CPU's run)."""
    from minimoe.core.adaptation.quantized import is_quantized
    return {m: {"nf4": m.packed, "nf4 per expert": PerExpertNF4(m.packed)} for m in model.modules() if is_quantized(m)}


def use_base(forms: dict, side: str):
    """Give every module of `forms` (base_forms) its base in form `side`: "bf16", a plain frozen parameter holding
    the packed weights dequantised (for a LoRA bank, the view of its [W | s B] buffer), made here and dropped
    when a packed form comes back, so that the bf16 copy is resident during the bf16 steps only; or a packed form,
    swapped in by attribute."""
    from minimoe.core.adaptation.quantized import is_quantized, quantize_module
    for m, form in forms.items():
        if side == "bf16":
            if not is_quantized(m):
                continue
            packed, dtype, k = form["nf4"], m.weight.dtype, getattr(m, "k", 0)
            stacked = torch.zeros(*packed.shape[:-1], packed.shape[-1] + k, dtype=dtype, device=m.weight.device)
            weight = packed.dequantize_into(stacked[..., :packed.shape[-1]])
            del m.weight, m.packed
            m.__class__ = type(m).__bases__[1]  # the class quantize_module mixed Dequantizing into
            m.weight = nn.Parameter(weight, requires_grad=False)
            if k:
                m.stacked = stacked
        else:
            if not is_quantized(m):
                quantize_module(m, form["nf4"])  # drops the bf16 parameter
            m.packed = form[side]


def quantized_step(device, smoke: bool, layers: int = 8, vocab: int | None = None, batch: tuple[int, int] = (8, 512),
                   steps: int = 5):
    """One LoRA step at `layers` layers of Qwen3-30B-A3B's widths, all 128 experts (the GPU recipe: bf16 under
    autocast, rank 8 on q, k, v and the experts, dropout 0, AdamW), its base in bf16 and the same weights
    packed in NF4 (--quantize nf4, core/adaptation/quantized.py), dequantised a bank at a time (now) and one expert at a
    time with torchao (`PerExpertNF4`, before): median step time of each, the three interleaved step by step
    (a loaded machine slows all alike) on one model whose bases are swapped (`base_forms`), and on CUDA each
    step's peak memory above what was allocated before it. vocab: a smaller vocabulary (a CPU's memory).
    batch: (B, T)."""
    from minimoe.core.adaptation.quantized import packed_bytes, quantize_model
    layers = 1 if smoke else layers
    c = config("qwen3_moe", layers, smoke)
    if vocab:
        c = replace(c, vocab_size=vocab)
    B, T = (2, 64) if smoke else batch
    steps, warmup = (2, 1) if smoke else (steps, 1)
    ids = torch.randint(2, c.vocab_size, (B, T), generator=torch.Generator().manual_seed(5)).to(device)
    name = f"qwen3_moe {layers}L E{c.num_experts}" + (f" V{vocab}" if vocab else "")
    model = add_lora(quantize_model(random_model(c, device), "nf4"), rank=8, dropout=0.0,
                     targets=["q", "k", "v", "experts"]).train()
    forms = base_forms(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    dense = sum(math.prod(m.weight.shape) * m.weight.element_size() for m in forms) / 2**30
    packed = packed_bytes(model) / 2**30

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(ids).logits.float().logsumexp(-1).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    sides = ("bf16", "nf4", "nf4 per expert")
    times, peaks = {side: [] for side in sides}, {side: 0.0 for side in sides}
    for i in range(warmup + steps):
        for side in sides:
            use_base(forms, side)  # untimed: the bf16 form is dequantised here
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
            t = timed(step, device, 1, 0)[0]
            print(f"nf4 stage: round {i} ({'warm-up' if i < warmup else 'timed'}), {side}: {t:.2f} s",
                  file=sys.stderr, flush=True)  # a CPU's round takes minutes: progress
            if i >= warmup:
                times[side].append(t)
            if device.type == "cuda":
                peaks[side] = max(peaks[side], (torch.cuda.max_memory_allocated(device) - before) / 2**30)
    t16 = statistics.median(times["bf16"])
    for side in ("nf4", "nf4 per expert"):
        t4 = statistics.median(times[side])
        ratios = sorted(b / a for a, b in zip(times["bf16"], times[side]))  # per round: this side over bf16
        peak = (f"; step peak above resident {peaks[side]:.2f} GiB against {peaks['bf16']:.2f} GiB"
                if device.type == "cuda" else "")
        row("nf4", name, f"LoRA step s, {side} base (B{B} x T{T})", t4, t16, t16 / t4,
            note=f"reference: the bf16 base, interleaved, one model; {side} / bf16 per round "
                 f"{statistics.median(ratios):.2f} [{ratios[0]:.2f}-{ratios[-1]:.2f}], {steps} rounds; "
                 f"base weights {dense:.2f} GiB bf16, {packed:.2f} GiB packed{peak}")


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


def default_model(folder: Path, device) -> tuple[Path, str]:
    """The default model's folder, or for one holding only config.json and tokenizer files, a temporary
    folder with random weights of its shape beside a copy of them (timing only)."""
    if any(folder.glob("*.safetensors")):
        return folder, "trained weights"
    from minimoe.loading.config_json import read_config
    out = Path(tempfile.mkdtemp())
    save_pretrained(random_model(read_config(folder), device), out)
    for f in folder.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, out / f.name)
    return out, "random weights of its shape (timing only)"


def default_run(device, folder: Path, budget: Budget):
    """The default run's epoch (train.py, the step seconds in metrics.jsonl) and the scoring of the 500
    SciQ test questions, on the default model."""
    folder, weights = default_model(folder, device)
    row("default run", folder.name, "weights", note=weights)
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
# On a CPU (not --smoke) the 2026 stages time both sides in one process at the published hidden, head and expert
# widths, cut to what both models held at once fit in a few GB (transformers + peft adds an fp32 delta the size of
# each fused bank, and keeps it for backward): 2 layers, one of each attention kind, fewer experts (top-8 kept),
# a 2048-token vocabulary, batch 1 x 128. DeepSeek-V3.2 at hidden 7168: one MoE layer of 8 experts, routed ungrouped
# (its 8 groups of top-4 need 16 experts or more for top-8, 1.9 GB of fp32 delta a bank on peft's side).
CPU_CUTS = {"qwen3_5_moe": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], num_experts=64),
            "deepseek_v32": dict(num_hidden_layers=1, first_k_dense_replace=0, n_routed_experts=8, n_group=1,
                                 topk_group=1),
            "gemma4_text": dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], num_experts=32)}
CPU_BATCH, CPU_VOCAB = (1, 128), 2048


def cpu_config(family: str) -> MoEConfig:
    return config_from_dict({**common.OFFICIAL_NEW[family], **CPU_CUTS[family], "vocab_size": CPU_VOCAB})


SMOKE_LAYERS = {"deepseek32": 4}  # a stage whose smoke run needs more than 2 layers (DeepSeek-V3.2: an MoE layer)


# The nf4 stage: on a GPU 8 layers at the recipe's batch; on a CPU one layer, a 2048-token vocabulary, 1 x 128.
NF4_STAGE = {True: dict(layers=8), False: dict(layers=1, vocab=2048, batch=(1, 128), steps=5)}


def reference_holds(family: str) -> bool:
    """Whether the installed transformers builds `family` (the 2026 families: transformers 5, the test5 extra); where
    it does not, the stage times minimoe alone and says why."""
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    except ImportError:
        CONFIG_MAPPING_NAMES = {}
    held = common.OFFICIAL_NEW.get(family, {}).get("model_type", family) in CONFIG_MAPPING_NAMES
    if not held:
        row("lora", family, "transformers + peft: skipped", note="needs transformers 5 (pip install -e '.[test5]')")
    return held


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
