"""bench/gpu.py's nf4 stage: one LoRA step with the frozen base in bf16, in NF4 dequantised a bank at a time
(--quantize nf4) and in NF4 dequantised one expert at a time as before (`PerExpertNF4`), interleaved on one model
whose bases are swapped between steps (`base_forms`, `use_base`)."""
from __future__ import annotations

import math
import statistics
import sys
from dataclasses import replace

import torch
import torch.nn as nn

from bench.gpu_common import config, random_model, row, timed
from minimoe.core.adaptation.lora import add_lora


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
