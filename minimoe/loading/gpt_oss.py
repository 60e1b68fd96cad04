"""gpt-oss's expert tensors as checkpoints store them <-> our banks (core/clamped_experts.py).

Letters: E experts, D hidden, I expert width.

On disk (transformers 4.57's GptOssExperts, and the official checkpoint):
- gate_up_proj [E, D, 2I]: x @ W, column 2i the gate of unit i, column 2i+1 its up (interleaved);
  gate_up_proj_bias [E, 2I], interleaved the same way;
- down_proj [E, I, D] (x @ W), down_proj_bias [E, D];
- or, in openai/gpt-oss-20b, gate_up_proj_blocks/_scales and down_proj_blocks/_scales: MXFP4 of the
  matrices as [E, out, in] (loading/mxfp4.py), gate_up's 2I rows interleaved as above.
Ours: GroupedLinear weights [E, out, in], gate_up's rows gate first (I rows), then up (I rows).
"""
from __future__ import annotations

import torch

from minimoe.loading.mxfp4 import dequantize_mxfp4


def split_interleaved(x, dim: int):
    """[..., 2I, ...] with gate/up alternating along `dim` -> the gates, then the ups."""
    x = x.movedim(dim, -1)
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1).movedim(-1, dim)


def interleave(x, dim: int):
    """split_interleaved's inverse: gates then ups along `dim` -> alternating."""
    x = x.movedim(dim, -1)
    gate, up = x.chunk(2, dim=-1)
    return torch.stack((gate, up), dim=-1).flatten(-2).movedim(-1, dim)


def gate_up_from_disk(w):  # [E, D, 2I] interleaved -> [E, 2I, D] gate rows first
    return split_interleaved(w.transpose(1, 2), dim=1).contiguous()


def gate_up_to_disk(w):  # [E, 2I, D] -> [E, D, 2I] interleaved
    return interleave(w, dim=1).transpose(1, 2).contiguous()


def gate_up_bias_from_disk(b):  # [E, 2I] interleaved -> gate first
    return split_interleaved(b, dim=1).contiguous()


def gate_up_bias_to_disk(b):
    return interleave(b, dim=1).contiguous()


def down_from_disk(w):  # [E, I, D] -> [E, D, I]
    return w.transpose(1, 2).contiguous()


def down_to_disk(w):  # [E, D, I] -> [E, I, D]
    return w.transpose(1, 2).contiguous()


def gate_up_from_mxfp4(blocks, scales, dtype, name: str = "gate_up_proj"):
    """MXFP4 [E, 2I, D/32, 16] + [E, 2I, D/32], rows interleaved -> [E, 2I, D] gate rows first."""
    return gate_up_rows_from_mxfp4(dequantize_mxfp4(blocks, scales, dtype, name)).contiguous()


def down_from_mxfp4(blocks, scales, dtype, name: str = "down_proj"):
    """MXFP4 [E, D, I/32, 16] + [E, D, I/32] -> [E, D, I], already our layout."""
    return dequantize_mxfp4(blocks, scales, dtype, name)


def gate_up_rows_from_mxfp4(w):  # [E, 2I, D] rows interleaved -> gate rows first (gate_up_from_mxfp4's layout step)
    return split_interleaved(w, dim=1)
