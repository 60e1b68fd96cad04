"""A packed NF4 base that FSDP2 shards like a dense one (`--quantize nf4 --shard fsdp`).

FSDP2 shards and all-gathers parameters, and `NF4Weight` (quantized.py) is a plain object holding four
tensors of three dtypes. Here a module's packed weight is one frozen uint8 parameter, `weight_nf4`
[E * R]: one record of R bytes per matrix, [factors | mean | codes | scalers | padding], the float parts
first so that each is a view in its dtype (R a multiple of the dtype's size). FSDP2 shards it on its one
dimension as it shards any weight (rank r of N holds bytes [r * ceil(E R / N), ...): 1/N of the packed
bytes, whatever E, N or the module), all-gathers it with the layer's other parameters before the layer's forward
and again before its backward, and frees it after. `NF4Records` reads the parameter at each dequantisation,
so it reads the gathered one, and `nf4_dequantize` rebuilds the bank from the same values as the
one-process NF4Weight: the same weight, bit for bit.

Decisions:
- Bytes, not NF4Weight's four tensors as four parameters: one FSDP parameter a module, evenly split, and
  never cast (`.to(dtype)` casts floating parameters; uint8 is none). As Answer.AI's FSDP-QLoRA stores
  bitsandbytes' packed values in a plain dtype so that FSDP can flatten them. torchao's NF4Tensor instead
  carries FSDP2 hooks (fsdp_pre_all_gather / fsdp_post_all_gather over its inner tensors), for 2-D
  weights whose dim-0 chunks divide its blocks evenly, its per-matrix mean replicated; a bank [E, out, in]
  at uneven rank counts is outside it.
- A rank packs the matrices its bytes touch (`matrices_of`: about E / N experts of a bank, one more where
  its bytes start or end inside a matrix; an nn.Linear whole, which every rank reads), each by torchao's own
  `to_nf4` as one process packs it, and keeps its bytes (`fill_shard`); runs/sharding.py reads the matrices
  from the checkpoint, one module at a time: a rank never holds a dense layer.
- The base-weights digest samples the weight as loaded (adapters.py): each rank keeps the sampled values of
  the matrices whose first byte it holds, zeros elsewhere, and the digest sums them over the ranks.
"""
from __future__ import annotations

import math
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

from minimoe.core.adaptation.quantized import (DIGEST_VALUES, NF4_BLOCK, NF4_SCALER_BLOCK, NF4Weight, _to_nf4,
                                               digest_stride, nf4_dequantize_into, nf4_pairs, quantize_module)

RECORDS = "weight_nf4"  # the uint8 parameter's name on its module


def record_widths(rows: int, cols: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(factors, codes, scalers, R) of one [rows, cols] matrix stored from `dtype`: the bytes of its
    second-level factors, 4-bit codes and int8 scales, and the record's length (with the mean's `dtype`
    size after the factors, padded to a multiple of that size)."""
    n, size = rows * cols, dtype.itemsize
    blocks = n // NF4_BLOCK
    factors = blocks // math.gcd(blocks, NF4_SCALER_BLOCK) * size
    used = factors + size + n // 2 + blocks
    return factors, n // 2, blocks, used + (-used) % size


def records_of(weight: NF4Weight) -> torch.Tensor:
    """An NF4Weight's parts as records: [E, R] uint8."""
    *_, R = record_widths(*weight.shape[-2:], weight.dtype)
    parts = [weight.factors.view(torch.uint8), weight.means.unsqueeze(-1).view(torch.uint8), weight.codes,
             weight.scalers.view(torch.uint8)]
    used = sum(p.shape[-1] for p in parts)
    return torch.cat([*parts, weight.codes.new_zeros(len(weight.codes), R - used)], dim=-1)


def parts_of(records: torch.Tensor, rows: int, cols: int, dtype: torch.dtype):
    """[E, R] records -> (codes [E, n/2], scalers [E, n/64], factors, means [E]): views, nf4_dequantize's input."""
    factors, codes, scalers, _ = record_widths(rows, cols, dtype)
    start = factors + dtype.itemsize
    return (records[:, start:start + codes], records[:, start + codes:start + codes + scalers].view(torch.int8),
            records[:, :factors].view(dtype), records[:, factors:start].view(dtype).squeeze(-1))


class NF4Records:
    """quantize_module's packed weight whose values are its module's `weight_nf4` parameter, read at each
    dequantisation: under FSDP2 the gathered parameter while the module's layer runs (module docstring)."""

    def __init__(self, module: nn.Module, shape, dtype: torch.dtype, device):
        self.module = weakref.ref(module)  # the module holds this object
        self.shape, self.dtype, self.device = torch.Size(shape), dtype, torch.device(device)
        self.matrices = math.prod(self.shape[:-2])
        self.record = record_widths(*self.shape[-2:], dtype)[-1]
        self.sampled = torch.zeros(0)  # this rank's share of the digest sample (fill_shard)
        self._pairs = None

    def dequantize_into(self, out: torch.Tensor) -> torch.Tensor:
        records = getattr(self.module(), RECORDS).view(self.matrices, self.record)  # the gathered bytes
        parts = parts_of(records, *self.shape[-2:], self.dtype)
        return nf4_dequantize_into(out, *parts, self.pairs())

    def pairs(self) -> torch.Tensor:
        """quantized.nf4_pairs of torchao's NF4 table in this weight's dtype and device."""
        if self._pairs is None or self._pairs.device != self.device:
            table = _to_nf4()(torch.zeros(NF4_BLOCK, dtype=self.dtype, device=self.device), NF4_BLOCK, 1).nf4
            self._pairs = nf4_pairs(table)
        return self._pairs

    def to(self, device) -> NF4Records:  # the parameter moves with its module
        self.device, self.sampled = torch.device(device), self.sampled.to(device)
        return self

    @property
    def nbytes(self) -> int:
        """This rank's bytes of the records."""
        records = getattr(self.module(), RECORDS)
        return (records.to_local() if hasattr(records, "to_local") else records).nbytes

    @property
    def sample(self) -> torch.Tensor:
        """quantized.digest_sample of the weight as loaded: the ranks' shares summed (a collective)."""
        total = self.sampled.clone()
        if dist.is_initialized():
            dist.all_reduce(total)
        return total.to(torch.bfloat16)

    def matrices_of(self, first: int, length: int) -> tuple[int, int]:
        """The matrices [m0, m1) that bytes [first, first + length) of the records touch."""
        return first // self.record, -(-(first + length) // self.record)

    def fill_shard(self, local: torch.Tensor, first: int, dense: torch.Tensor, m0: int):
        """Pack `dense` [m1 - m0, rows, cols] (matrices_of's, as loaded) and copy its records' bytes that this rank
        holds (`local`, bytes [first, first + len(local)) of the parameter) there; keep the digest's sampled values
        of the matrices whose first byte is here."""
        with torch.no_grad():
            records = records_of(NF4Weight(dense)).flatten()
            local.copy_(records[first - m0 * self.record:][:len(local)])
        per = self.shape[-2] * self.shape[-1]
        at = torch.arange(0, self.matrices * per, digest_stride(self.matrices * per), device=dense.device)
        at = at[:DIGEST_VALUES]  # quantized.digest_sample's positions in the whole weight
        owned = (at // per >= -(-first // self.record)) & (at // per < -(-(first + len(local)) // self.record))
        self.sampled = torch.zeros(len(at), dtype=torch.float32, device=self.device)
        self.sampled[owned] = dense.reshape(-1)[at[owned] - m0 * per].to(torch.bfloat16).float()


def shardable(module: nn.Module) -> nn.Module:
    """`module`'s frozen weight (a meta placeholder: runs/sharding.py fills the bytes after sharding) as an
    NF4Records: `weight_nf4`, a frozen uint8 parameter of E * R bytes, and quantize_module's dequantising class."""
    weight = module.weight
    records = NF4Records(module, weight.shape, weight.dtype, weight.device)
    quantize_module(module, records)
    module.register_parameter(RECORDS, nn.Parameter(
        torch.empty(records.matrices * records.record, dtype=torch.uint8, device=weight.device), requires_grad=False))
    return module
