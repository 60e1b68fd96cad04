"""What runs differently on the CPU, and why: memory and oneDNN's kernel cache, not the math.

The model and its LoRA (minimoe/core/decoder/model.py, minimoe/core/adaptation/lora.py) compute the same sums on every device.
On the CPU three measures change how they are computed, each for memory or for the cost of
oneDNN's compiled kernels, and each named here so that the forwards read as the math. The numbers
are from bench/RESULTS.md (2-core Zen 4, torch 2.13):

- `expert_block`: expert blocks rounded up to 16 rows in bf16. oneDNN's bf16 GEMMs compile a kernel
  per matrix shape (0.5-1 MB each; a compile costs 3-4x a cached call) and cache 1024 of them, and an
  expert's block size is its token count, a new shape nearly every call: 300 distinct row counts of
  one [M, 576] x [576, 1536] product held 223 MiB. Rounded, M takes a few dozen values per expert
  weight. Exact: the stand-in rows have combine weight 0 (model.Dispatch; tests/core/decoder/test_model.py).
- `keeps_adapter_dtype`: LoRA's branch runs in the adapters' own dtype (fp32, as in peft), not in the
  base's bf16. In bf16 each expert block size was one more small kernel to compile and keep: 621
  distinct matmul shapes in a step against peft's 98, 0.26 GiB of RSS on OLMoE-2L. An fp32 delta
  cannot join a bf16 x in one grouped_mm, so there a bank adds it per expert block
  (`lora.per_block_addmm`), with the one host sync that the CPU does not mind.
- `dropout_saved_as_mask`: the LoRA input is saved for backward as x and a 1-byte mask instead of
  the fp32 noise and the fp32 dropped input: 8 bytes an element become 3 (2 for a bf16 x that q, k
  and v share). The fp32 LoRA inputs were two thirds of the default run's saved activations; one
  micro-batch of its largest batch peaked 0.50 GiB lower (2.47 -> 1.98 GiB).

Under autocast (the GPU recipe, or the CPU when asked) LoRA runs in the base matmul's dtype instead,
the branch is grouped with the bank (`lora.base_plus_delta`) and no host sync is made.
The process-wide measures (glibc keeping freed blocks, the size of oneDNN's cache) are in
minimoe/process_memory.py.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

# Expert blocks are rounded to a multiple of this many rows where oneDNN compiles a kernel per shape.
# Only where the experts get >= EXPERT_BLOCK rows on average: a decoding step would pay 16x its rows.
EXPERT_BLOCK = 16


def expert_block(x, rows: int, num_experts: int) -> int:
    """The row multiple that model.Dispatch rounds each expert's block up to for x [rows, D]: EXPERT_BLOCK
    for bf16/fp16 on the CPU (fp32 runs on MKL, which compiles no per-shape kernels), else 1 (exact)."""
    low_precision_cpu = x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16)
    return EXPERT_BLOCK if low_precision_cpu and rows >= num_experts * EXPERT_BLOCK else 1


def keeps_adapter_dtype(x) -> bool:
    """Whether LoRA's branch for input x runs in the adapters' own dtype (fp32 by default) rather than
    the base matmul's: on the CPU without autocast (the module docstring says why)."""
    return x.device.type == "cpu" and not torch.is_autocast_enabled("cpu")


@contextmanager
def dropout_saved_as_mask(x, dtype, p: float, training: bool):
    """On the CPU, yields dropout(x.to(dtype)) as F.dropout computes it there (noise = bernoulli(1 - p) / (1 - p);
    x * noise): the same random draws and bits. Inside the block autograd saves the dropped tensor
    and the noise, which the LoRA matmuls and the multiply need in backward, as x (in its own dtype)
    and a 1-byte mask, and rebuilds them from those in backward. An fp32 LoRA input and its noise
    are 8 bytes an element, two thirds of the default run's activations (bench/RESULTS.md); a bf16 x,
    which q, k and v share, and the masks are 2 + 1 each.
    """
    if not training or p == 0 or not torch.is_grad_enabled() or x.device.type != "cpu" or torch.compiler.is_compiling():
        yield F.dropout(x.to(dtype), p, training)  # elsewhere F.dropout's fused kernel draws otherwise
        return
    held, rebuilt = {}, {}  # the forward's tensors while the block runs; backward's rebuilt ones

    def rebuild(name):
        if not rebuilt:  # backward needs both; make them once
            rebuilt["noise"] = keep.to(dtype).div_(1 - p)
            rebuilt["out"] = x.to(dtype) * rebuilt["noise"]
        return rebuilt[name]

    def pack(t):
        for name, full in held.items():
            if t.untyped_storage().data_ptr() == full.untyped_storage().data_ptr() and t.dtype == full.dtype:
                return name, t.shape, t.stride(), t.storage_offset()  # or a view of it (linear flattens)
        return t

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        name, shape, stride, offset = packed
        return rebuild(name).as_strided(shape, stride, offset)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):  # the multiply saves the noise too
        held["noise"] = torch.empty_like(x, dtype=dtype).bernoulli_(1 - p).div_(1 - p)
        keep = held["noise"] != 0  # bool
        held["out"] = x.to(dtype) * held["noise"]
        yield held["out"]
    held.clear()  # only x and the mask stay
