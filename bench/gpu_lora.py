"""bench/gpu.py's LoRA stages: one LoRA step and forward of minimoe (eager, compiled, compiled with CUDA graphs)
against transformers + peft on the same random weights, on a GPU one side after the other, on a CPU the sides held
at once and interleaved step by step; the 2026 families at CPU_CUTS' widths on a CPU, and minimoe alone where the
installed transformers does not build the family (`reference_holds`)."""
from __future__ import annotations

import resource
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from bench import common
from bench.gpu_common import Budget, active_params, config, random_model, row, syncs, timed
from minimoe.core.adaptation.lora import add_lora
from minimoe.core.decoder.model import MoEConfig, compile_layers
from minimoe.loading.checkpoint import from_pretrained, save_pretrained
from minimoe.loading.config_json import config_from_dict


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
