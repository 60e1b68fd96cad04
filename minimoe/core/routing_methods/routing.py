"""Routing policies: the swappable part of each MoE block (`MoEBlock.router`), and the layer scope.

A policy is an nn.Module called as `router(x, logits, experts=None) -> Routing` with x [T, D] the
pre-expert hidden state h_t and logits [T, E] the native affinity logits a_t = W_aff h_t
(Eq. native_affinity), already in fp32. `experts` [T, K], when given, is a selection to replay
(gradient checkpointing's recompute): the policy must then use it instead of its own top-K and
compute everything else as usual. Its parameters live under `...mlp.router.*`; the checkpoint's
own gate stays at `...mlp.gate`. Which method uses which policy, with which options, is methods.py's
table; its `set_router` installs one.
- `Scoring`: a family's scoring and selection as config fields (softmax, sigmoid or sqrt-softplus, top-K before or
  after the softmax, norm_topk_prob, group-limited top-K, the selection-only correction bias,
  routed_scaling_factor); every policy below routes through it, so every method runs on every family.
- `NativeRouter`: the family's top-K (Eq. native_affinity, native_moe_output).
- `DualAffinityRouter`: the Dual Affinity control; a trainable copy of the gate, `router.affinity`,
  mixed with the frozen native logits, then the native policy.
- `TokenErrorRouter` (TES): error head `router.error_head` (Eq. positive_error_head), attenuated
  routing (Eq. attenuated_routing_score, started_log_transform or shifted_log_ablation_score) and
  the error readout e_hat_t (Eq. aggregate_predicted_error).
- `ConcentrationRouter` (ACS): native routing plus C_t (Eq. affinity_concentration) with gradient;
  C_t has one home, `concentration` (the evaluation's diagnostic is `native_concentration`).

Decisions where the paper is silent, and why:
- On every scorer TES attenuates the logits before the family's scoring and selection (correction
  bias and group limits then applied as the family applies them); sigmoid and sqrt-softplus scoring are not
  shift-invariant, so there phi_i - min_j phi_j replaces phi (native at init, bit for bit). TES's
  readout and ACS's C_t use the family's own native weights of the K renormalised (`Scoring.shares`:
  softmax p or sigmoid s; no scaling factor). Dual mixes before the scoring (docs/methods.md).
- The tes readout weights the *executed* experts (S_t^act, i.e. the attenuated top-K) by native p
  renormalised over that set, as Eq. aggregate_predicted_error states; the FFN combines with the
  attenuated probabilities under the family's own normalisation (`Scoring.select` on the attenuated
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
- A policy's options are checked once, by its method's record (methods.Option, `Method.configure`),
  before `from_gate` builds it; the policies do not check them again.
- `set_router` describes the whole model: layers out of scope get `NativeRouter` back and every gate
  is frozen except in scope with tune_router=True. `router_spec` (the method's record, methods.Method.record)
  stores every option with its resolved default, so a saved adapter does not change meaning if a
  default changes; a method from outside minimoe also stores where it came from ("module"), so that a
  fresh process (evaluate.py, --resume, load_adapter) imports it again.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Callable

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
    # (experts, x [T, D]) -> [T, D]: a term the MoE block adds to the experts' output, `experts` its bank and x
    # the bank's input; a policy sets it where its method needs more than the K weighted experts (DenseMixer:
    # zero in value, its backward the dense router gradient). The block calls it without knowing the method.
    addend: Callable | None = None


def _number(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(x)


SCORE_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class Scoring:
    """A family's scoring and selection as fields (MoEConfig's router fields; `Scoring.of(config)`).

    - func softmax, on_logits False (OLMoE, Qwen, Mixtral, DeepSeek-V2): softmax over all E, then the
      top-K probabilities; renormalised over the K when `normalize` (norm_topk_prob).
    - func softmax, on_logits True (Granite, gpt-oss): top-K on the logits, softmax over the K (which is
      the full softmax renormalised over the K).
    - func sigmoid, on_logits True (Llama 4): top-K on the logits, the sigmoid of each of the K (not
      renormalised unless `normalize`); Llama 4's MoE block scales the expert's input by it.
    - func sigmoid (DeepSeek-V3, GLM-4.5): sigmoid scores; the selection may add `correction` (the checkpoint's
      e_score_correction_bias [E]) to them, the weights never do.
    - func sqrtsoftplus (DeepSeek-V4): sqrt(softplus(a)) per expert, otherwise as sigmoid (correction bias in the
      choice only, the K renormalised with norm_eps); a positive score of unbounded size, not in (0, 1).
    - method: greedy (plain top-K); group_limited_greedy (DeepSeek-V2: keep the `topk_group` of
      `n_group` expert groups with the largest max score); noaux_tc (DeepSeek-V3: groups ranked by the
      sum of their two best scores, correction included). Experts outside the kept groups score 0,
      as transformers 4.57 masks them (a kept expert whose corrected score is below 0 can then lose to one of
      them), or -inf where `groups_inf` (transformers 5's DeepSeek-V3 router and its kin, DeepSeek's own): never
      chosen.
    - scaling: routed_scaling_factor, applied to the weights last.
    - norm_eps: added to the K sigmoid (or sqrt-softplus) scores' sum where they are renormalised (DeepSeek-V3's
      1e-20, LFM2's 1e-6).
    """
    top_k: int
    normalize: bool = False
    func: str = "softmax"
    on_logits: bool = False
    method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0
    norm_eps: float = 1e-20
    groups_inf: bool = False

    @classmethod
    def of(cls, config) -> Scoring:
        c = config
        return cls(c.num_experts_per_tok, c.norm_topk_prob, c.scoring_func, c.topk_on_logits, c.topk_method,
                   c.n_group, c.topk_group, c.routed_scaling_factor, c.sigmoid_norm_eps, c.group_mask_inf)

    def scores(self, logits):  # [T, E] -> [T, E] fp32 per-expert scores (softmax, sigmoid or sqrt-softplus)
        if self.func == "softmax":
            return logits.float().softmax(dim=-1)
        return logits.float().sigmoid() if self.func == "sigmoid" else F.softplus(logits.float()).sqrt()

    @property
    def shift_invariant(self) -> bool:
        """Whether a per-token constant added to every logit leaves the weights unchanged (softmax only)."""
        return self.func == "softmax"

    def choose(self, scores, correction=None):
        """[T, E] scores (no gradient) -> [T, K] experts, by `method` (the class docstring)."""
        s = scores if correction is None else scores + correction.float()
        if self.method != "greedy":
            T, E = s.shape
            grouped = s.view(T, self.n_group, E // self.n_group)
            rank = grouped.max(-1).values if self.method == "group_limited_greedy" else grouped.topk(2, -1).values.sum(-1)
            kept = torch.zeros_like(rank, dtype=torch.bool).scatter_(1, rank.topk(self.topk_group, -1).indices, True)
            dropped = 0.0 if not self.groups_inf else float("-inf")
            s = s.masked_fill(~kept.repeat_interleave(E // self.n_group, dim=1), dropped)
        return s.topk(self.top_k, dim=-1).indices

    def select(self, logits, experts=None, correction=None):
        """logits [T, E] -> (experts [T, K], weights [T, K] fp32); `experts` replays a selection.
        The choice carries no gradient; the weights do, through gather."""
        logits = logits.float()
        if self.on_logits:
            if experts is None:
                experts = logits.detach().topk(self.top_k, dim=-1).indices
            top = logits.gather(-1, experts)  # [T, K]
            if self.func == "softmax":
                weights = top.softmax(dim=-1)
            else:
                weights = top.sigmoid()
                weights = weights / weights.sum(dim=-1, keepdim=True) if self.normalize else weights
        else:
            scores = self.scores(logits)
            if experts is None:
                experts = self.choose(scores.detach(), correction)
            weights = scores.gather(-1, experts)  # one op sequence whether chosen or replayed
            if self.normalize:
                total = weights.sum(dim=-1, keepdim=True)
                weights = weights / (total if self.func == "softmax" else total + self.norm_eps)
        return experts, weights if self.scaling == 1.0 else weights * self.scaling

    def shares(self, logits, experts):
        """The family's own weights of `experts` [T, K], normalised to sum 1 (no scaling) -> [T, K] fp32:
        softmax probabilities or sigmoid scores renormalised over the set. C_t and TES's readout use them."""
        s = self.scores(logits).gather(-1, experts)
        return s / s.sum(dim=-1, keepdim=True)


def select_topk(logits, k: int, renormalize: bool, experts=None):
    """Top-K of softmax(logits) -> (experts [T, K], weights [T, K] fp32), renormalised over the K when
    `renormalize`; `experts` replays a selection. The softmax scorer's greedy selection (`Scoring`)."""
    return Scoring(k, renormalize).select(logits, experts)


def hash_experts(table, token_ids):
    """DeepSeek-V4's hash routing (its first layers): each token's K experts are the row of a frozen table for its
    token id (the checkpoint's tid2eid [V, K]), not the gate's choice -> [B*T, K]. The gate's scores still weigh
    them: `Scoring.select` with these experts given. Not a router for the methods (docs/methods.md)."""
    return table[token_ids.reshape(-1)].long()


def concentration(logits, experts, scoring: Scoring | None = None):
    """C_t = sum_{i in S} pbar_i^2, pbar the family's weights of S = `experts` renormalised over S -> [T]
    (softmax by default: pbar = softmax(logits) renormalised over S).

    Eq. affinity_concentration (= diagnostic_token_concentration with S the native top-K);
    differentiable w.r.t. the logits (Eq. appendix_affinity_concentration_logit_gradient).
    """
    pbar = (scoring or Scoring(experts.shape[-1])).shares(logits, experts)  # [T, K]
    return pbar.pow(2).sum(dim=-1)


def native_concentration(logits, scoring: Scoring | int, correction=None):
    """Diagnostic C_t over the native top-K of `scoring` (an int K: softmax greedy), without gradient -> [T].

    The top-K set is the same with or without renormalisation or scaling, so only the choice matters.
    """
    scoring = scoring if isinstance(scoring, Scoring) else Scoring(scoring)
    with torch.no_grad():
        return concentration(logits, scoring.select(logits, correction=correction)[0], scoring)


def attenuate(logits, e_hat, gamma: float, tau: float, transform: str = "started-log", relative: bool = False):
    """a - gamma * phi(e_hat) [T, E] (Eq. attenuated_routing_score).

    phi = log(1 + e/tau) (Eq. started_log_transform) or the pure-log control log e
    (Eq. shifted_log_ablation_score, where tau is unused). relative: phi - min_i phi (sigmoid scoring,
    which a per-token shift would change: the least-error expert keeps its native logit).
    """
    e_hat = e_hat.float()
    if transform == "started-log":
        phi = torch.log1p(e_hat / tau)
    else:
        phi = torch.log(e_hat.clamp_min(torch.finfo(torch.float32).tiny))
    if relative:
        phi = phi - phi.min(dim=-1, keepdim=True).values
    return logits.float() - gamma * phi


class NativeRouter(nn.Module):
    """The family's own policy (Eq. native_affinity, native_moe_output), its scoring a `Scoring`.

    `correction` is the checkpoint's e_score_correction_bias [E] (DeepSeek-V3), passed by the MoE block
    only where the family has one: a policy of your own that accepts no `correction` keeps working on
    every other family."""

    def __init__(self, scoring: Scoring):
        super().__init__()
        self.scoring = scoring

    @property
    def top_k(self) -> int:
        return self.scoring.top_k

    @classmethod
    def from_gate(cls, gate: nn.Linear, config, **options):
        """The policy of one layer, whose native gate is `gate`, with the method's `options`: how set_router
        builds every method's policy. A subclass whose constructor takes (scoring, **options) inherits this one."""
        return cls(Scoring.of(config), **options)

    def forward(self, x, logits, experts=None, correction=None):
        experts, weights = self.scoring.select(logits, experts, correction)
        return Routing(logits=logits, experts=experts, weights=weights)


class ConcentrationRouter(NativeRouter):
    """ACS: native routing; the supervised prediction is C_t over the native top-K, with gradient, from the
    family's own weights of the K renormalised (`Scoring.shares`). With K = 1 (Llama 4) C_t over the
    top-1 is 1 for every token and has no gradient, so there S is every expert: C_t = sum_i pbar_i^2,
    pbar the family's scores of all E renormalised (docs/methods.md), in [1/E, 1]."""

    def forward(self, x, logits, experts=None, correction=None):
        experts, weights = self.scoring.select(logits, experts, correction)
        S = experts if self.top_k > 1 else torch.arange(logits.shape[-1], device=logits.device).expand(logits.shape)
        c = concentration(logits, S, self.scoring)  # [T]
        return Routing(logits=logits, experts=experts, weights=weights, prediction=c)


class DualAffinityRouter(NativeRouter):
    """Dual Affinity: logits (1 - w) a + w a_copy, with `affinity` a trainable copy of the native gate
    (its bias too where the gate has one, gpt-oss), mixed before the family's scoring."""

    def __init__(self, gate: nn.Linear, scoring: Scoring, mix: float):
        super().__init__(scoring)
        self.mix = float(mix)
        w = gate.weight
        self.gate_bias = gate.bias is not None  # then the copy runs the gate's own op, bias inside
        self.affinity = nn.Linear(w.shape[1], w.shape[0], bias=True, device=w.device, dtype=torch.float32)
        with torch.no_grad():
            self.affinity.weight.copy_(w)
            self.affinity.bias.copy_(gate.bias) if self.gate_bias else self.affinity.bias.zero_()

    @classmethod
    def from_gate(cls, gate, config, **options):
        return cls(gate, Scoring.of(config), **options)

    def forward(self, x, logits, experts=None, correction=None):
        # The gate's own op (plus an fp32 bias where the gate has none), so that at init a_copy equals a bit for bit.
        W, b = self.affinity.weight, self.affinity.bias
        if self.gate_bias:
            copy = F.linear(x, W.to(x.dtype), b.to(x.dtype)).float()  # [T, E]
        else:
            copy = F.linear(x, W.to(x.dtype)).float() + b.float()  # [T, E]
        mixed = logits + self.mix * (copy - logits)
        experts, weights = self.scoring.select(mixed, experts, correction)
        return Routing(logits=logits, experts=experts, weights=weights, routing_logits=mixed)


class TokenErrorRouter(NativeRouter):
    """TES: per-expert error scores e = softplus(W_e h + b_e) attenuate the native logits before the
    family's scoring and selection; the readout e_hat weights them by the family's own normalised
    native weights of the executed experts (`Scoring.shares`)."""

    def __init__(self, hidden_size: int, num_experts: int, scoring: Scoring,
                 gamma: float, tau: float, transform: str, device=None, dtype=None):
        super().__init__(scoring)
        self.gamma, self.tau, self.transform = float(gamma), float(tau), transform
        self.error_head = nn.Linear(hidden_size, num_experts, bias=True, device=device, dtype=dtype)
        with torch.no_grad():  # neutral start: routing is native (see the module docstring)
            self.error_head.weight.zero_()
            self.error_head.bias.fill_(0.0 if transform == "started-log" else math.log(math.e - 1))

    @classmethod
    def from_gate(cls, gate, config, **options):
        w = gate.weight  # [E, D]; the head is stored in fp32 (module docstring)
        return cls(w.shape[1], w.shape[0], Scoring.of(config), **options, device=w.device, dtype=torch.float32)

    def forward(self, x, logits, experts=None, correction=None):
        W, b = self.error_head.weight, self.error_head.bias  # fp32, cast at use like the gate
        scores = F.softplus(F.linear(x, W.to(x.dtype), b.to(x.dtype)).float())  # [T, E] e_hat_{t,i} > 0
        attenuated = attenuate(logits, scores, self.gamma, self.tau, self.transform,
                               relative=not self.scoring.shift_invariant)
        experts, weights = self.scoring.select(attenuated, experts, correction)
        pbar = self.scoring.shares(logits, experts)  # [T, K] native weights of the executed set, renormalised
        e_hat = (pbar * scores.gather(-1, experts)).sum(dim=-1)  # [T]
        return Routing(logits=logits, experts=experts, weights=weights, prediction=e_hat,
                       expert_scores=scores, routing_logits=attenuated)


# ----------------------------------------------------------------------------- the layer scope and what trains

def resolve_layers(layers, sparse) -> list[int]:
    """'final' | 'all' | 'first:N' | 'last:N' | list of indices -> sorted layer indices, among `sparse`: the
    MoE layers' indices (an int n: layers 0..n-1 all sparse). Dense layers are never routed: 'final' is
    the final MoE layer, 'all' every MoE layer, first/last:N the first/last N MoE layers."""
    sparse = list(range(sparse)) if isinstance(sparse, Integral) else sorted(sparse)
    n_sparse = len(sparse)
    if isinstance(layers, str):
        head, _, count = layers.partition(":")
        if layers == "final":
            return sparse[-1:]
        if layers == "all":
            return sparse
        if head in ("first", "last") and count.isdigit() and 1 <= int(count) <= n_sparse:
            n = int(count)
            return sparse[:n] if head == "first" else sparse[n_sparse - n:]
        raise ValueError(f"set_router: layers={layers!r} is not understood; expected 'final', 'all', "
                         f"'first:N' or 'last:N' with 1 <= N <= {n_sparse} (the MoE layers), or a list of layer indices")
    if not isinstance(layers, (list, tuple)) or not layers:
        raise ValueError(f"set_router: layers={layers!r}; expected a scope name or a non-empty list of indices")
    bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, Integral) or i not in sparse]
    if bad:
        dense = "" if sparse == list(range(len(sparse))) else f" (its MoE layers are {sparse}; dense and hash-routed layers are never a method's)"
        raise ValueError(f"set_router: layer index {bad[0]!r} is out of range; the model has layers "
                         f"0..{max(sparse)}{dense}")
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
    for i, mlp in moe_blocks(model).items():
        mlp.router.requires_grad_(True)
        mlp.gate.weight.requires_grad_(i in tuned)


def moe_blocks(model) -> dict:
    """Layer index -> its MoE block, for the layers that route (a dense layer's mlp has no router; a hash-routed
    layer's experts are its token's, not a router's: docs/methods.md)."""
    return {i: layer.mlp for i, layer in enumerate(model.model.layers)
            if hasattr(layer.mlp, "router") and not getattr(layer.mlp, "hashed", False)}
