"""The dense SwiGLU MLP: the MLP of a dense layer among MoE layers (Qwen's `mlp_only_layers` and
`decoder_sparse_step`, DeepSeek's `first_k_dense_replace`) and a shared expert beside the routed ones
(Qwen2-MoE's, scaled by its own sigmoid gate; DeepSeek's shared experts, un-gated).

Neither is routed: no method reaches a dense layer or a shared expert (docs/methods.md), and the
Routing list of the model output holds None for a dense layer. The names (gate_proj, up_proj,
down_proj) are the checkpoint's, as transformers 4.57 writes them; the MoE block holds a shared
expert as `shared_expert` with its gate `shared_expert_gate`, the checkpoint's names too. Granite's
shared expert stores its gate and up rows as one matrix (`fused`: gate_up_proj [2I, D], gate rows
first), as its routed experts are stored. The gate's activation is config.json's `hidden_act` (`ACTIVATIONS`:
SiLU everywhere but Gemma 4's tanh-approximated GELU), the routed experts' too (core/layers/experts.py);
"relu2" is Nemotron-H's squared ReLU, without a gate. DeepSeek-V4 clamps SwiGLU's inputs (`limit`: the gate
below it, up within +-it; `clamped`, which gpt-oss's experts share), its routed experts' and its shared expert's.
"""
from __future__ import annotations

import functools

import torch.nn as nn
import torch.nn.functional as F

# config.json's hidden_act -> the gate's activation (transformers' ACT2FN names)
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}


def clamped(gate, up, limit: float):
    """SwiGLU's inputs clamped: the gate at most `limit`, up within [-limit, limit] (gpt-oss, DeepSeek-V4)."""
    return gate.clamp(max=limit), up.clamp(-limit, limit)


class DenseMLP(nn.Module):
    """down(act(gate(x)) * up(x)), x [..., D] -> [..., D], I the hidden width; with act "relu2" no gate:
    down(relu(up(x))^2) (Nemotron-H's dense layers and shared expert)."""

    def __init__(self, hidden_size: int, intermediate_size: int, fused: bool = False, act: str = "silu",
                 limit: float | None = None):
        super().__init__()
        self.limit = limit
        self.ungated = act == "relu2"
        self.act = None if self.ungated else ACTIVATIONS[act]
        if self.ungated:
            self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        elif fused:
            self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        else:
            self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
            self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        if self.ungated:
            return self.down_proj(F.relu(self.up_proj(x)).square())
        if hasattr(self, "gate_up_proj"):
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        if self.limit is not None:
            gate, up = clamped(gate, up, self.limit)
        return self.down_proj(self.act(gate) * up)
