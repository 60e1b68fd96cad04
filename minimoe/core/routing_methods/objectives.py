"""Token-error supervision objectives (TES and ACS share them; the paper's Section 3.3-3.5).

- `itakura_saito`: Eq. token_is_loss, L+/e - log(L+/e) - 1 with the floor L+ = max(L_CE, eps).
- `exponential_nll`: Eq. token_enll_loss, L/e + log e.
- `OBJECTIVES`: one `Objective` record per name (is, enll), what --objective, config.json, step.py and the
  row labels read; one of your own joins it through `minimoe.register_objective` (examples/my_objective.py).
- `supervision_loss`: Eq. averaged_training_losses, the mean over supervised layers and tokens.
  The total objective (Eq. total_loss) is the trainer's: CE + lambda_m * this + lambda_aux * aux.
- `load_balancing_loss`: L_aux, the families' Switch-style loss (transformers' load_balancing_loss_func)
  from the model output's routings. The model's forward never computes it: the trainer asks for it
  only when its coefficient is non-zero, so evaluation and aux_coef = 0 pay nothing.

Decisions where the paper is silent, and why:
- The observed CE is never detached: IS and ENLL differ exactly in the gradient they send through it
  (Eq. appendix_is_token_loss_gradient, appendix_enll_token_loss_gradient). Below the floor the IS
  gradient through the observed CE is zero (clamp); at exactly L = eps it passes (torch's clamp
  convention, one choice of the subgradient the paper leaves open).
- A layer is supervised when its `Routing.prediction` is set (a supervised method's policy sets it
  on the layers in scope; routing.Method.prediction says what it holds).
  Every supervised layer sees the same supervised tokens, so the double sum of Eq.
  averaged_training_losses is the mean over layers of per-layer token means.
- `depth_scaled=True` multiplies by |M|: the per-layer strength of final-layer-only supervision at
  any depth (app. acs_depth_coefficient_scaling, "scale lambda by the number of supervised layers").
- Losses run in at least fp32 whatever the model dtype: L/e - log(L/e) - 1 cancels near the match.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


def _at_least_fp32(x):
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def itakura_saito(pred, observed, eps: float = 1e-8):
    """Per-token IS divergence (Eq. token_is_loss); `observed` stays attached."""
    ratio = _at_least_fp32(observed).clamp_min(eps) / _at_least_fp32(pred)
    return ratio - torch.log(ratio) - 1


def exponential_nll(pred, observed):
    """Per-token exponential negative log-likelihood with mean `pred` (Eq. token_enll_loss)."""
    pred = _at_least_fp32(pred)
    return _at_least_fp32(observed) / pred + torch.log(pred)


@dataclass(frozen=True)
class Objective:
    """One supervision objective: how a layer's prediction is fitted to the observed token CE."""
    name: str  # --objective, "objective" in config.json; upper-cased it ends the row's label (TES-IS)
    loss: Callable  # (pred [N], observed [N], eps) -> per-token loss [N]; keep `observed` attached
    help: str = ""  # --objective's help
    module: str | None = None  # the file or module that registered it (user_methods.register_objective); None: built in


OBJECTIVES: dict[str, Objective] = {o.name: o for o in (
    Objective("is", itakura_saito, "Itakura-Saito (Eq. token_is_loss)"),
    Objective("enll", lambda pred, observed, eps: exponential_nll(pred, observed),  # no floor: eps unused
              "exponential NLL (Eq. token_enll_loss)"))}


def get_objective(name: str) -> Objective:
    """The registered objective called `name`."""
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; expected one of the registered {list(OBJECTIVES)} (for one of "
                         f"your own, pass the file that registers it: train.py --method-module)")
    return OBJECTIVES[name]


def supervision_loss(routings, token_ce, mask, objective: str | Objective = "is", *, eps: float = 1e-8,
                     depth_scaled: bool = False, tokens: int | None = None):
    """L_m (Eq. averaged_training_losses) -> scalar.

    routings: the model output's list, one Routing per layer (None for a dense layer), tokens flattened as B*T.
    token_ce [B, T]: observed next-token CE at the position whose hidden state routed,
        ce[b, t] = CE(logits[b, t], ids[b, t + 1]), attached to the graph.
    mask [B, T] bool: supervised positions (no padding, no ignored or missing target).
    tokens: how many positions `mask` selects, if the caller knows it on the host (no device sync).
    """
    try:
        objective = get_objective(objective) if isinstance(objective, str) else objective
    except ValueError as e:
        raise ValueError(f"supervision_loss: {e}") from None
    preds = [r.prediction for r in routings if r is not None and r.prediction is not None]
    if not preds:
        raise ValueError("supervision_loss: no layer is supervised (no Routing has a prediction); install a "
                         "supervised method (methods.METHODS, a prediction set) with minimoe.set_router")
    if token_ce.shape != mask.shape:
        raise ValueError(f"supervision_loss: token_ce {tuple(token_ce.shape)} and mask {tuple(mask.shape)} differ")
    m = mask.reshape(-1).bool()
    if tokens is None:  # counted here: a read-back, which training avoids by passing its host-side count
        tokens = int(m.sum())
    if tokens < 1:
        raise ValueError("supervision_loss: mask selects no token")
    # A masked mean rather than a boolean index, which would read the count back to the host (a device
    # sync per layer). Unsupervised tokens get a finite stand-in (1) and weight 0.
    count = tokens
    observed = torch.where(m, token_ce.reshape(-1), 1.0)
    total = 0.0
    for pred in preds:
        if pred.shape != m.shape:
            raise ValueError(f"supervision_loss: a layer's prediction has shape {tuple(pred.shape)}; "
                             f"expected ({m.numel()},) = B*T tokens")
        p = torch.where(m, pred, 1.0)
        per_token = objective.loss(p, observed, eps)
        total = total + torch.where(m, per_token, 0.0).sum() / count
    return total if depth_scaled else total / len(preds)


def load_balancing_loss(routings, attention_mask=None):
    """transformers' Switch-style loss: E * sum_e f_e * P_e over all layers' tokens pooled -> scalar.

    routings: the model output's list; each `Routing.logits` [B*T, E] is the native a_t, and K is
    its `experts.shape[-1]` (every policy executes the family's top-K). f_e = share of the K slots
    of the native top-K that chose e, P_e = mean native probability of e; with attention_mask [B, T]
    both means run over real tokens only. Dense layers (None) are not routed and do not count.
    """
    routings = [r for r in routings if r is not None]
    logits = torch.cat([r.logits for r in routings])  # [L*B*T, E]
    E, K = logits.shape[-1], routings[0].experts.shape[-1]
    probs = logits.float().softmax(-1)
    if attention_mask is None:
        real = probs.new_ones(probs.shape[0], 1)
    else:
        real = attention_mask.to(probs.dtype).flatten().repeat(len(routings))[:, None]  # [L*B*T, 1]
    # sum_k f_ke: the real tokens' top-K slots that chose e, counted by index_add (exact: whole numbers).
    # Not one_hot, which checks its indices on the host (a sync) and builds an [L*B*T, K, E] tensor.
    chosen = probs.topk(K, dim=-1).indices.flatten()  # [L*B*T*K]
    slots = probs.new_zeros(E).index_add_(0, chosen, real.expand(-1, K).flatten())  # [E]
    n = real.sum()
    return (slots / n * ((probs * real).sum(0) / n)).sum() * E
