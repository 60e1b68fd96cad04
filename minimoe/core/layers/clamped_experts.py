"""gpt-oss experts: a clamped SwiGLU with biases, on minimoe's grouped expert path.

Letters: T tokens, K experts per token, N = T*K rows, E experts, D hidden, I expert width.

Per expert e, as transformers 4.57's GptOssExperts computes it:
    gate, up = x W_gu[e] + b_gu[e]   (2I values)
    gate = min(gate, limit); up = clamp(up, -limit, limit)
    y = ((up + 1) * gate * sigmoid(alpha * gate)) W_d[e] + b_d[e]
with alpha 1.702 and the limit config.json's `swiglu_limit` (7.0 in every release; transformers 4.57
hard-codes 7.0 whatever the config says: tests/core/decoder/test_families_parity.py gives it the file's), then y
times the routing weight.

Decisions:
- The banks are `GroupedLinear` [E, out, in] as in core/layers/experts.py, gate rows first, then up rows.
  The checkpoint stores gate_up_proj as [E, D, 2I] with gate and up *interleaved* (column 2i gate,
  2i+1 up); the loader transposes and de-interleaves it once, so LoRA and the grouped path see the
  layout every other family has.
- Biases are the block's own parameters, named as on disk (`gate_up_proj_bias` [E, 2I], gate part
  first like the bank; `down_proj_bias` [E, D]), so LoRA on the banks leaves them alone. Each sorted
  row finds its expert from the dispatch's block ends (searchsorted, no host sync).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from minimoe.core.layers import cpu_memory
from minimoe.core.layers.experts import Dispatch, GroupedLinear, matmul_dtype
from minimoe.core.layers.mlp import clamped


def clamped_swiglu(gate, up, alpha: float, limit: float):
    gate, up = clamped(gate, up, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def row_experts(dispatch: Dispatch, rows: int):
    """[rows] the expert of each sorted row: the block whose end lies beyond it."""
    index = torch.arange(rows, dtype=dispatch.offsets.dtype, device=dispatch.offsets.device)
    return torch.searchsorted(dispatch.offsets, index, right=True)


class ClampedSwiGLUExperts(nn.Module):
    """E experts; forward(x [T, D], experts [T, K], weights [T, K]) -> [T, D], as model.Experts."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 alpha: float = 1.702, limit: float = 7.0):
        super().__init__()
        E, D, I = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = GroupedLinear(E, 2 * I, D)
        self.down_proj = GroupedLinear(E, D, I)
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(E, 2 * I))
        self.down_proj_bias = nn.Parameter(torch.zeros(E, D))
        self.alpha, self.limit = alpha, limit

    def forward(self, x, experts, weights):
        E = self.gate_up_proj.weight.shape[0]
        x = x.to(matmul_dtype(x, self.gate_up_proj.weight))
        dispatch = Dispatch(experts, E, cpu_memory.expert_block(x, experts.numel(), E))
        h = self.gate_up_proj(x[dispatch.token], dispatch)  # [N, 2I]
        expert = row_experts(dispatch, h.shape[0])  # [N]
        gate, up = (h + self.gate_up_proj_bias[expert].to(h.dtype)).chunk(2, dim=-1)
        y = self.down_proj(clamped_swiglu(gate, up, self.alpha, self.limit), dispatch)  # [N, D]
        y = (y + self.down_proj_bias[expert].to(y.dtype)) * dispatch.row_weights(weights).to(y.dtype)
        return dispatch.combine(y, *experts.shape)
