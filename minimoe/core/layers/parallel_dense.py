"""Gemma 4's feed-forward: a dense MLP beside the routed experts in every layer, each branch normed before and
after, their sum the layer's MLP output (the decoder layer norms it once more: `sandwich_norm`).

    dense  = post_feedforward_layernorm_1(mlp(pre_feedforward_layernorm(h)))
    routed = post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(h)))   routed by gate(g)
    g      = rms(h) * router.scale / sqrt(D)                                         (a norm without weight)

h is the residual stream after attention (transformers 5.23's Gemma4TextDecoderLayer). `ParallelDense` holds
the dense half, the four branch norms and the gate's input scale; the routed half is the layer's MoE block
(model.MoEBlock, passed in: its gate, experts and swappable router keep the names every method, LoRA and the
adapters read, `mlp.gate`, `mlp.experts`, `mlp.router`). The router's per-expert scale is the experts' own
(core/layers/experts.py). The family's record maps these names onto the checkpoint's.

Decisions:
- The routing policy (so every method's head) reads what the gate reads, g, not the experts' input: a head that
  copies the gate then starts native, and g is the block's one pre-routing hidden state (docs/methods.md).
- g is rounded as the reference rounds it: the weightless norm in fp32 cast to the model dtype, then times the
  scale, then times D^-1/2, each in the model dtype.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from minimoe.core.layers.mlp import DenseMLP
from minimoe.core.layers.norms import RMSNorm, rms_normalized


class ParallelDense(nn.Module):
    def __init__(self, config):  # a model.MoEConfig with parallel_dense
        super().__init__()
        D = config.hidden_size
        self.dense = DenseMLP(D, config.dense_intermediate_size, act=config.hidden_act)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm_1 = RMSNorm.of(config, D), RMSNorm.of(config, D)
        self.pre_feedforward_layernorm_2, self.post_feedforward_layernorm_2 = RMSNorm.of(config, D), RMSNorm.of(config, D)
        self.gate_input_scale = nn.Parameter(torch.ones(D))  # the checkpoint's router.scale
        self.eps, self.root = config.rms_norm_eps, D ** -0.5

    def forward(self, h, moe, stash: dict | None = None):  # h [B, T, D]; moe: the layer's MoE block
        """-> (dense + routed [B, T, D], the routed half's Routing)."""
        dense = self.post_feedforward_layernorm_1(self.dense(self.pre_feedforward_layernorm(h)))
        g = rms_normalized(h.float(), self.eps).to(h.dtype) * self.gate_input_scale * self.root
        routed, routing = moe(self.pre_feedforward_layernorm_2(h), stash, gate_input=g)
        return dense + self.post_feedforward_layernorm_2(routed), routing
