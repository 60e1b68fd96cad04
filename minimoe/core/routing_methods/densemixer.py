"""DenseMixer ("DenseMixer: Improving MoE Post-Training with Precise Router Gradient", 2025): the family's
own top-K in the forward, and in training the router's gradient of the dense mixture over all E experts,
by a straight-through estimator.

    forward:    y_t = sum_{i in S_t} g_{t,i} E_i(h_t)                  (the native output, bit for bit)
    backward:   dL/dw_{t,e} = <dL/dy_t, E_e(h_t)>  for every e         (the dense mixture's, all E experts)
                and dL/da_t = J_w(a_t)^T dL/dw_t: the router's only gradient

Where the weight scales the expert's input (Llama 4, `expert_input_scaled`: y_t = sum_{i in S_t} E_i(g_{t,i} h_t)),
the dense mixture is sum_e E_e(w_{t,e} h_t), so dL/dw_{t,e} = <dL/dy_t, J_{E_e}(w_{t,e} h_t) h_t>.

w_t = `dense_weights`: the family's weight function extended to every expert (equal to the native
g_t on S_t). The experts and their LoRA keep the sparse gradient of the native forward: the executed
experts only, weighted by g_t, which carries no gradient to the router (its detach is the straight
through: without it the router would get the sparse gradient on top of the dense one).

How: `DenseMixerRouter` returns the native weights detached and, when gradients are on, the term
`dense_term(experts, x, w)` as its `Routing.addend`, which the MoE block adds to its output without
knowing the method: zero in value, its backward runs every expert on every token (without gradient, one expert at a time:
[T, D] at a time, never [T, E, D]) to give <dL/dy_t, E_e(h_t)> (input-scaled: each expert run at
w_e h_t with gradient, and autograd's vector-Jacobian product taken for w_e alone). Evaluation (no grad) pays nothing;
a training step pays E/K expert forwards more per layer in scope.

Choices where the paper's Qwen/OLMoE form leaves a family open (docs/methods.md):
- Renormalising families (norm_topk_prob, and top-K on logits, whose softmax over the K is p renormalised
  over S_t): w_e = p_e / sum_{j in S_t} p_j for every e, the normaliser attached. With K = 1 the native
  weight is the constant 1 and the router gets no gradient at all; the dense one still gives it one.
- Sigmoid scores (DeepSeek-V3): w_e = s_e (/ sum_S s where it renormalises), times routed_scaling_factor;
  the correction bias only selects, as natively, and never enters w. Group-limited top-K: every expert
  counts in the dense mixture, the ones outside the kept groups too (their output is what the dense
  gradient asks about).
- Sigmoid of each of the K logits (Llama 4): w_e = sigmoid(a_e) for every e, not renormalised, as natively;
  it scales E_e's input, so the dense mixture does too (above): the gradient the native router would get
  if every expert ran at its own weight.
"""
from __future__ import annotations

import torch

from minimoe.core.routing_methods.routing import NativeRouter, Routing, Scoring


def dense_weights(scoring: Scoring, logits, experts):
    """logits [T, E], the native selection experts [T, K] -> w [T, E] fp32: the family's weights extended to
    every expert; on `experts` they equal `scoring.select`'s (to rounding)."""
    s = scoring.scores(logits)  # [T, E] softmax p or sigmoid s
    # the softmax over the K chosen logits is p renormalised over the K; Llama 4's sigmoid of each is not
    if scoring.normalize or (scoring.on_logits and scoring.func == "softmax"):
        total = s.gather(-1, experts).sum(dim=-1, keepdim=True)
        s = s / (total if scoring.func == "softmax" else total + 1e-20)  # DeepSeek-V3's guard, as select
    return s * scoring.scaling


class _DenseTerm(torch.autograd.Function):
    """Zero in value; backward: dL/dw [T, E], dL/dw_{t,e} = d/dw_{t,e} <dL/dy_t, E_e(w_{t,e} h_t)> where the
    experts scale their input (Llama 4), else <dL/dy_t, E_e(h_t)>."""

    @staticmethod
    def forward(ctx, w, x, experts):  # w [T, E] fp32; x [T, D]; experts: the block's bank module
        ctx.experts = experts
        ctx.save_for_backward(w, x)
        return x.new_zeros(x.shape)

    @staticmethod
    def backward(ctx, grad):  # grad [T, D] = dL/dy
        w, x = ctx.saved_tensors
        T, E = w.shape
        col = [x.new_full((T, 1), e, dtype=torch.long) for e in range(E)]
        if getattr(ctx.experts, "scale_input", False):
            # w_e sits inside the expert: its gradient goes through E_e's Jacobian at w_e h_t, one expert at a
            # time; grad() with w_e as its only input leaves the experts' own gradients untouched.
            cols = []
            for e in range(E):
                with torch.enable_grad():
                    w_e = w[:, e:e + 1].detach().requires_grad_(True)  # [T, 1]
                    out = ctx.experts(x, col[e], w_e)  # [T, D] E_e(w_e h_t), in the bank's dtype
                    cols.append(torch.autograd.grad(out, w_e, grad.to(out.dtype))[0][:, 0])
        else:
            ones = x.new_ones(T, 1, dtype=torch.float32)
            with torch.no_grad():
                cols = [(grad.float() * ctx.experts(x, col[e], ones).float()).sum(-1)
                        for e in range(E)]  # E_e(h_t) for every token, one expert at a time
        return torch.stack(cols, dim=-1).float(), None, None


def dense_term(experts, x, w):
    """Zero [T, D] in x's dtype, through which the loss reaches the dense weights w [T, E]."""
    return _DenseTerm.apply(w, x.detach(), experts)


class DenseMixerRouter(NativeRouter):
    """Native top-K; the combine weights detached, the dense term the block's addend (in training only:
    evaluation pays nothing)."""

    def forward(self, x, logits, experts=None, correction=None):
        experts, weights = self.scoring.select(logits, experts, correction)
        routing = Routing(logits=logits, experts=experts, weights=weights.detach())
        if torch.is_grad_enabled():
            w = dense_weights(self.scoring, logits, experts)  # [T, E]
            routing.addend = lambda bank, flat: dense_term(bank, flat, w)
        return routing
