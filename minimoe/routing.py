"""Routing policies: the swappable part of each MoE block (`MoEBlock.router`).

A policy is an nn.Module called as `router(x, logits, experts=None) -> Routing` with x [T, D] the
pre-expert hidden state h_t and logits [T, E] the native affinity logits a_t = W_aff h_t
(Eq. native_affinity), already in fp32. `experts` [T, K], when given, is a selection to replay
(gradient checkpointing's recompute): the policy must then use it instead of its own top-K and
compute everything else as usual. Its parameters live under `...mlp.router.*`; the checkpoint's
own gate stays at `...mlp.gate`.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from minimoe.model import Routing


def select_topk(logits, k: int, renormalize: bool, experts=None):
    """Top-K of softmax(logits) -> (experts [T, K], weights [T, K] fp32); `experts` replays a selection.

    The two native policies in one: Granite (renormalize=True) takes the top-K logits and softmaxes
    over them, which equals the full softmax renormalised over the K; OLMoE softmaxes over all
    experts, keeps the K largest probabilities and renormalises them only when `norm_topk_prob`.
    """
    probs = logits.float().softmax(dim=-1)  # [T, E]
    if experts is None:  # the choice carries no gradient; the weights do, through gather
        experts = probs.detach().topk(k, dim=-1).indices
    weights = probs.gather(-1, experts)  # one op sequence whether chosen or replayed
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return experts, weights


class NativeRouter(nn.Module):
    """The family's own policy (Eq. native_affinity, native_moe_output)."""

    def __init__(self, top_k: int, renormalize: bool):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize

    def forward(self, x, logits, experts=None):
        experts, weights = select_topk(logits, self.top_k, self.renormalize, experts)
        return Routing(logits=logits, experts=experts, weights=weights)
