"""The dense SwiGLU MLP: the MLP of a dense layer among MoE layers (Qwen's `mlp_only_layers` and
`decoder_sparse_step`, DeepSeek's `first_k_dense_replace`) and a shared expert beside the routed ones
(Qwen2-MoE's, scaled by its own sigmoid gate; DeepSeek's shared experts, un-gated).

Neither is routed: no method reaches a dense layer or a shared expert (docs/methods.md), and the
Routing list of the model output holds None for a dense layer. The names (gate_proj, up_proj,
down_proj) are the checkpoint's, as transformers 4.57 writes them; the MoE block holds a shared
expert as `shared_expert` with its gate `shared_expert_gate`, the checkpoint's names too.
"""
from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F


class DenseMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), x [..., D] -> [..., D], I the hidden width."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
