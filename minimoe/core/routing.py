"""Routing policies: the swappable part of each MoE block (`MoEBlock.router`), and the layer scope.

A policy is an nn.Module called as `router(x, logits, experts=None) -> Routing` with x [T, D] the
pre-expert hidden state h_t and logits [T, E] the native affinity logits a_t = W_aff h_t
(Eq. native_affinity), already in fp32. `experts` [T, K], when given, is a selection to replay
(gradient checkpointing's recompute): the policy must then use it instead of its own top-K and
compute everything else as usual. Its parameters live under `...mlp.router.*`; the checkpoint's
own gate stays at `...mlp.gate`. Which method uses which policy, with which options, is methods.py's
table; its `set_router` installs one.
- `NativeRouter`: the family's top-K (Eq. native_affinity, native_moe_output).
- `DualAffinityRouter`: the Dual Affinity control; a trainable copy of the gate, `router.affinity`,
  mixed with the frozen native logits, then the native policy.
- `TokenErrorRouter` (TES): error head `router.error_head` (Eq. positive_error_head), attenuated
  routing (Eq. attenuated_routing_score, started_log_transform or shifted_log_ablation_score) and
  the error readout e_hat_t (Eq. aggregate_predicted_error).
- `ConcentrationRouter` (ACS): native routing plus C_t (Eq. affinity_concentration) with gradient;
  C_t has one home, `concentration` (the evaluation's diagnostic is `native_concentration`).

Decisions where the paper is silent, and why:
- The tes readout weights the *executed* experts (S_t^act, i.e. the attenuated top-K) by native p
  renormalised over that set, as Eq. aggregate_predicted_error states; the FFN combines with the
  attenuated probabilities under the family's own normalisation (`select_topk` on the attenuated
  logits), as the text after Eq. started_log_transform states.
- Nothing is detached on the tes path. The expert scores get gradient (1) from the readout,
  pbar_i times the aggregate's, executed experts only (Eq. appendix_aggregate_component_derivative),
  and (2) through the attenuated combine weights into the LM loss and the attached token CE. With
  renormalisation over the K (Granite, OLMoE norm_topk_prob) path (2) reaches only the executed
  experts' scores; without it (OLMoE default) every score gets some, through the full softmax
  denominator ("where its normalization policy permits", app. aggregate_supervision_expert_scores).
- Every trainable routing parameter is *stored* in fp32 whatever the model dtype: the TES error
  head, the Dual Affinity copy and a gate unfrozen by tune_router (as LoRA is, lora.py). In bf16,
  AdamW steps of lr 1e-5..2e-5 on weights of size ~0.03 round away (most weights would never move).
  Each is cast to the activation dtype at use, so the heads and a tuned gate compute their logits
  exactly as the frozen native gate does (model dtype, then upcast, as the reference): in fp32 the
  forward is bitwise that of a model-dtype head, and at init in bf16 too (the copy of a bf16 gate
  is exact in fp32). Softplus, log and softmax run in fp32. The pure log clamps e_hat at fp32's
  smallest normal so that a softplus underflow cannot give log 0.
- Initialisation leaves routing native: started log, zero weight and bias, so every expert gets
  phi = log(1 + log 2 / tau) and a per-token constant shift leaves softmax and top-K unchanged
  (exact in math; in floats a_i - c rounds, so equal to ~1e-7 relative, not bitwise). Pure log,
  zero weight and bias log(e - 1), so e_hat = 1 and phi = 0 (to the rounding of log(e-1); in bf16
  it rounds to e_hat ~ 1.001, still the same for every expert).
- Dual computes the copy as `linear(x, W) + b` (the gate's own op, then an exact +0 at init) and
  mixes as a + w (a_copy - a), which is (1 - w) a + w a_copy, so at init it is bitwise native for
  every w. It averages *logits*, not probabilities (the paper says "averages the two router
  outputs"): the mixed logits then go through the family's own softmax and top-K unchanged, and at
  init the policy is native exactly.
- The concentration diagnostic (`native_concentration`) uses the native top-K and native p (the ACS appendix's S_t) even
  under tes/dual, whose executed set may differ.
- `set_router` describes the whole model: layers out of scope get `NativeRouter` back and every gate
  is frozen except in scope with tune_router=True. `router_spec` stores every option with its
  resolved default, so a saved adapter does not change meaning if a default changes; a method from
  outside minimoe also stores where it was registered ("module"), so that a fresh process
  (evaluate.py, --resume, load_adapter) imports it again.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

import torch
import torch.nn as nn
import torch.nn.functional as F

TRANSFORMS = ("started-log", "log")  # TES's error-to-routing transforms: the paper's, and its pure-log control


@dataclass
class Routing:
    """One MoE layer's routing decision for T tokens (the flattened B*T), and what the method reads out of
    it; a field a policy has no value for is None. `prediction` being set is what marks a layer as
    supervised (objectives.supervision_loss); `logits` stays the native a_t under every policy."""
    logits: torch.Tensor  # [T, E] fp32 native affinity logits a_t; the load-balancing loss reads these
    experts: torch.Tensor  # [T, K] executed experts S_t^act
    weights: torch.Tensor  # [T, K] fp32 weights g_t that combine the executed experts' outputs
    prediction: torch.Tensor | None = None  # [T] supervised (tes: e_hat, acs: C_t); None: not supervised
    expert_scores: torch.Tensor | None = None  # [T, E] tes: per-expert error scores e_hat_{t,i}
    routing_logits: torch.Tensor | None = None  # [T, E] tes, dual: the logits the selection used


def _number(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(x)


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


def concentration(logits, experts):
    """C_t = sum_{i in S} pbar_i^2, pbar = softmax(logits) renormalised over S = `experts` -> [T].

    Eq. affinity_concentration (= diagnostic_token_concentration with S the native top-K);
    differentiable w.r.t. the logits (Eq. appendix_affinity_concentration_logit_gradient).
    """
    p = logits.float().softmax(dim=-1).gather(-1, experts)  # [T, K]
    pbar = p / p.sum(dim=-1, keepdim=True)
    return pbar.pow(2).sum(dim=-1)


def native_concentration(logits, k: int):
    """Diagnostic C_t over the native top-K of softmax(logits), without gradient -> [T].

    The top-K set is the same with or without renormalisation, so only K is needed.
    """
    with torch.no_grad():
        return concentration(logits, select_topk(logits, k, renormalize=False)[0])


def attenuate(logits, e_hat, gamma: float, tau: float, transform: str = "started-log"):
    """a - gamma * phi(e_hat) [T, E] (Eq. attenuated_routing_score).

    phi = log(1 + e/tau) (Eq. started_log_transform) or the pure-log control log e
    (Eq. shifted_log_ablation_score, where tau is unused).
    """
    e_hat = e_hat.float()
    if transform == "started-log":
        phi = torch.log1p(e_hat / tau)
    else:
        phi = torch.log(e_hat.clamp_min(torch.finfo(torch.float32).tiny))
    return logits.float() - gamma * phi


class NativeRouter(nn.Module):
    """The family's own policy (Eq. native_affinity, native_moe_output)."""

    def __init__(self, top_k: int, renormalize: bool):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize

    @classmethod
    def from_gate(cls, gate: nn.Linear, config, **options):
        """The policy of one layer, whose native gate is `gate`, with the method's `options`: how set_router
        builds every method's policy. A subclass whose constructor takes (top_k, renormalize, **options)
        inherits this one."""
        return cls(config.num_experts_per_tok, config.norm_topk_prob, **options)

    def forward(self, x, logits, experts=None):
        experts, weights = select_topk(logits, self.top_k, self.renormalize, experts)
        return Routing(logits=logits, experts=experts, weights=weights)


class ConcentrationRouter(NativeRouter):
    """ACS: native routing; the supervised prediction is C_t over the native top-K, with gradient."""

    def __init__(self, top_k: int, renormalize: bool):
        if top_k < 2:
            raise ValueError(f"acs: num_experts_per_tok is {top_k}; affinity concentration needs K >= 2 "
                             "(with K = 1, C_t = 1 for every token and gives no gradient)")
        super().__init__(top_k, renormalize)

    def forward(self, x, logits, experts=None):
        experts, weights = select_topk(logits, self.top_k, self.renormalize, experts)
        c = concentration(logits, experts)  # [T]
        return Routing(logits=logits, experts=experts, weights=weights, prediction=c)


class DualAffinityRouter(NativeRouter):
    """Dual Affinity: logits (1 - w) a + w a_copy, with `affinity` a trainable copy of the native gate."""

    def __init__(self, gate: nn.Linear, top_k: int, renormalize: bool, mix: float):
        if not (_number(mix) and 0.0 <= mix <= 1.0):
            raise ValueError(f"dual: mix={mix!r}; expected a mixing weight in [0, 1]")
        super().__init__(top_k, renormalize)
        self.mix = float(mix)
        w = gate.weight
        self.affinity = nn.Linear(w.shape[1], w.shape[0], bias=True, device=w.device, dtype=torch.float32)
        with torch.no_grad():
            self.affinity.weight.copy_(w)
            self.affinity.bias.zero_()

    @classmethod
    def from_gate(cls, gate, config, **options):
        return cls(gate, config.num_experts_per_tok, config.norm_topk_prob, **options)

    def forward(self, x, logits, experts=None):
        # The gate's own op plus an fp32 bias, so that at init a_copy equals a bit for bit.
        copy = F.linear(x, self.affinity.weight.to(x.dtype)).float() + self.affinity.bias.float()  # [T, E]
        mixed = logits + self.mix * (copy - logits)
        experts, weights = select_topk(mixed, self.top_k, self.renormalize, experts)
        return Routing(logits=logits, experts=experts, weights=weights, routing_logits=mixed)


class TokenErrorRouter(NativeRouter):
    """TES: per-expert error scores e = softplus(W_e h + b_e) attenuate the native logits."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool,
                 gamma: float, tau: float, transform: str, device=None, dtype=None):
        if not (_number(gamma) and gamma >= 0):
            raise ValueError(f"tes: gamma={gamma!r}; expected a finite attenuation strength >= 0")
        if not (_number(tau) and tau > 0):
            raise ValueError(f"tes: tau={tau!r}; expected a finite reference scale > 0")
        if transform not in TRANSFORMS:
            raise ValueError(f"tes: transform={transform!r}; expected one of {TRANSFORMS}")
        super().__init__(top_k, renormalize)
        self.gamma, self.tau, self.transform = float(gamma), float(tau), transform
        self.error_head = nn.Linear(hidden_size, num_experts, bias=True, device=device, dtype=dtype)
        with torch.no_grad():  # neutral start: routing is native (see the module docstring)
            self.error_head.weight.zero_()
            self.error_head.bias.fill_(0.0 if transform == "started-log" else math.log(math.e - 1))

    @classmethod
    def from_gate(cls, gate, config, **options):
        w = gate.weight  # [E, D]; the head is stored in fp32 (module docstring)
        return cls(w.shape[1], w.shape[0], config.num_experts_per_tok, config.norm_topk_prob, **options,
                   device=w.device, dtype=torch.float32)

    def forward(self, x, logits, experts=None):
        W, b = self.error_head.weight, self.error_head.bias  # fp32, cast at use like the gate
        scores = F.softplus(F.linear(x, W.to(x.dtype), b.to(x.dtype)).float())  # [T, E] e_hat_{t,i} > 0
        attenuated = attenuate(logits, scores, self.gamma, self.tau, self.transform)
        experts, weights = select_topk(attenuated, self.top_k, self.renormalize, experts)
        p = logits.softmax(dim=-1).gather(-1, experts)  # [T, K] native p on the executed set
        pbar = p / p.sum(dim=-1, keepdim=True)
        e_hat = (pbar * scores.gather(-1, experts)).sum(dim=-1)  # [T]
        return Routing(logits=logits, experts=experts, weights=weights, prediction=e_hat,
                       expert_scores=scores, routing_logits=attenuated)


# ----------------------------------------------------------------------------- the layer scope and what trains

def resolve_layers(layers, num_layers: int) -> list[int]:
    """'final' | 'all' | 'first:N' | 'last:N' | list of indices -> sorted layer indices."""
    if isinstance(layers, str):
        head, _, count = layers.partition(":")
        if layers == "final":
            return [num_layers - 1]  # every layer of both families is sparse
        if layers == "all":
            return list(range(num_layers))
        if head in ("first", "last") and count.isdigit() and 1 <= int(count) <= num_layers:
            n = int(count)
            return list(range(n)) if head == "first" else list(range(num_layers - n, num_layers))
        raise ValueError(f"set_router: layers={layers!r} is not understood; expected 'final', 'all', "
                         f"'first:N' or 'last:N' with 1 <= N <= {num_layers}, or a list of layer indices")
    if not isinstance(layers, (list, tuple)) or not layers:
        raise ValueError(f"set_router: layers={layers!r}; expected a scope name or a non-empty list of indices")
    bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, Integral) or not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"set_router: layer index {bad[0]!r} is out of range; the model has layers "
                         f"0..{num_layers - 1}")
    return sorted({int(i) for i in layers})


def tuned_layers(router_spec: dict | None) -> list[int]:
    """The layers whose native gate trains ("+ affinity tuning"), as `router_spec` records them."""
    spec = router_spec or {}
    return list(spec["layers"]) if spec.get("tune_router") else []


def set_routing_trainable(model):
    """Routing's share of what trains, read from `model.router_spec` alone: every method head
    (`.mlp.router.*`) and the native gates of `tuned_layers`; every other gate is frozen. set_router
    and add_lora both end with it, so the order in which they are called does not matter."""
    tuned = tuned_layers(model.router_spec)
    for i, layer in enumerate(model.model.layers):
        layer.mlp.router.requires_grad_(True)
        layer.mlp.gate.weight.requires_grad_(i in tuned)
