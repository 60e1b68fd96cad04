"""The process group as a run sees it: this process's rank and the world size (`world`), and a number
summed over every rank (`global_sum`), rank 0's answer on every rank (`from_rank0`), a sharded tensor
gathered whole (`full`); one process without a group is rank 0 of 1.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def world() -> tuple[int, int]:
    """(rank, world size) of the process group; (0, 1) without one."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def global_sum(x: float) -> float:
    """x summed over the process group (in float64: token counts stay exact)."""
    if not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item()


def from_rank0(value):
    """Rank 0's `value` (any picklable object) on every rank: a collective, every rank calls it; `value`
    itself without a group."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def full(tensor) -> torch.Tensor:
    """A DTensor gathered whole on every rank (a collective: every rank calls it); a tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
