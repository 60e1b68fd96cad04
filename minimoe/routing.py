"""Routing policies: the swappable part of each MoE block (`MoEBlock.router`), and `set_router`.

A policy is an nn.Module called as `router(x, logits, experts=None) -> Routing` with x [T, D] the
pre-expert hidden state h_t and logits [T, E] the native affinity logits a_t = W_aff h_t
(Eq. native_affinity), already in fp32. `experts` [T, K], when given, is a selection to replay
(gradient checkpointing's recompute): the policy must then use it instead of its own top-K and
compute everything else as usual. Its parameters live under `...mlp.router.*`; the checkpoint's
own gate stays at `...mlp.gate`.

Methods (`set_router(model, method, layers, **options)`), one `Method` record each in `METHODS`,
the one table that the optimizer groups, config, train.py's --method, labels, run names and export
refusals read (a method from your own file joins it through `register_method`):
- native `NativeRouter`: the family's top-K (Eq. native_affinity, native_moe_output).
- dual   `DualAffinityRouter`: the Dual Affinity control; a trainable copy of the gate,
         `router.affinity`, mixed with the frozen native logits, then the native policy.
- tes    `TokenErrorRouter`: error head `router.error_head` (Eq. positive_error_head), attenuated
         routing (Eq. attenuated_routing_score, started_log_transform or shifted_log_ablation_score)
         and the error readout e_hat_t (Eq. aggregate_predicted_error).
- acs    `ConcentrationRouter`: native routing plus C_t (Eq. affinity_concentration) with gradient.

`Routing` fields beyond logits, experts and weights (per token of the flattened B*T; None when the
policy has no such value):
- `prediction` [T]: what `objectives.supervision_loss` supervises; set by the supervised methods'
  policies only (tes: e_hat_t, acs: C_t; `Method.prediction` says which), and being set is what
  marks a layer as supervised.
- `expert_scores` [T, E]: tes. `routing_logits` [T, E]: tes and dual, the logits the selection
  used. `logits` stays the native a_t under every policy.
- C_t (Eq. affinity_concentration) has one home, `concentration`; no policy but acs computes it on
  the forward. The evaluation's diagnostic C_t is `native_concentration` of `Routing.logits`.

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
- The table lives here, beside the policies, so that one method's class and record are one read.
"""
from __future__ import annotations

import importlib
import importlib.util
import math
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from numbers import Integral, Real
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

TRANSFORMS = ("started-log", "log")
# The methods' options and their defaults (paper: gamma = tau = 1, mixing weight 0.5): their records
# in METHODS hold these, the policies below and through METHODS config.TrainConfig read them.
TES = {"gamma": 1.0, "tau": 1.0, "transform": "started-log"}
DUAL = {"mix": 0.5}


@dataclass
class Routing:
    """One MoE layer's routing decision for T tokens, and what the method reads out of it."""
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


def attenuate(logits, e_hat, gamma: float = TES["gamma"], tau: float = TES["tau"], transform: str = TES["transform"]):
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

    def __init__(self, gate: nn.Linear, top_k: int, renormalize: bool, mix: float = DUAL["mix"]):
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
                 gamma: float = TES["gamma"], tau: float = TES["tau"], transform: str = TES["transform"],
                 device=None, dtype=None):
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


# ----------------------------------------------------------------------------- the methods' table

# What export_peft and export_merged say of a method that does not declare that it routes natively.
NOT_NATIVE = "its policy replaces the family's native top-K"


@dataclass(eq=False)
class Method:
    """One routing method: every fact about it that minimoe reads outside its policy (METHODS)."""
    name: str  # --method, and "method" in config.json and in the router spec
    policy: type  # nn.Module; set_router builds it per layer in scope as policy.from_gate(gate, config, **options)
    label: str  # the report's row and the run's name: "-<objective>" follows a supervised one's (TES-IS)
    options: dict = field(default_factory=dict)  # option -> default: the policy's keyword arguments
    # trainable submodule of the policy -> (the option naming its learning rate, that rate's default);
    # the optimizer gives each its own parameter group, named after the option less "_lr"
    heads: dict = field(default_factory=dict)
    # what Routing.prediction holds, supervised against the token CE: "error" (a predicted token CE,
    # e_hat, which the error-prediction diagnostics read) or another name; None: not supervised
    prediction: str | None = None
    # why a merged checkpoint or a peft adapter cannot express its routing; None: it routes natively
    # (its heads, if any, only read), so export_peft and export_merged write it
    not_exportable: str | None = NOT_NATIVE
    module: str | None = None  # where a method from outside minimoe was registered from; None: built in

    @property
    def settings(self) -> dict:
        """Every setting the method reads, with its default: its options and its heads' learning rates."""
        return {**self.options, **dict(self.heads.values())}

    @property
    def predicts_error(self) -> bool:
        return self.prediction == "error"


METHODS: dict[str, Method] = {}
ALIASES = {"ce": "native"}  # the paper's row name for LoRA on native routing; train.py and older config.json say it
_source: list[str] = []  # the file or module being imported by import_method_module, while it registers


def register_method(method: Method) -> Method:
    """Add `method` to METHODS: set_router, training, saved adapters, evaluation and train.py's --method
    then take it as they take a built-in one. Called at import of the file that defines it; a fresh
    process finds that file again through `Method.module`, recorded here (train.py --method-module)."""
    if not (isinstance(method, Method) and isinstance(method.name, str) and method.name.isidentifier()):
        raise ValueError(f"register_method: expected a Method whose name is an identifier; got {method!r}")
    if not (isinstance(method.policy, type) and issubclass(method.policy, nn.Module)
            and hasattr(method.policy, "from_gate")):
        raise ValueError(f"register_method: {method.name!r}: policy {method.policy!r} is not an nn.Module class "
                         f"with a from_gate(gate, config, **options) classmethod (subclass NativeRouter)")
    bad = [lr for lr, _ in method.heads.values() if not lr.endswith("_lr")]
    if bad:
        raise ValueError(f"register_method: {method.name!r}: learning-rate option(s) {bad} must end in '_lr'")
    if "tune_router" in method.options:
        raise ValueError(f"register_method: {method.name!r}: tune_router is set_router's own option for every "
                         f"method; leave it out of options")
    if _source:
        method.module = _source[-1]
    elif method.module is None and method.policy.__module__.split(".")[0] != "minimoe":
        method.module = None if method.policy.__module__ == "__main__" else method.policy.__module__
    known = METHODS.get(method.name)
    if method.name in ALIASES or (known is not None and (known.module is None or known.module != method.module)):
        raise ValueError(f"register_method: a method named {method.name!r} is registered already"
                         + (f" (from {known.module})" if known is not None and known.module else " (built in)"))
    METHODS[method.name] = method
    return method


@contextmanager
def _registering(where: str):
    _source.append(where)
    try:
        yield
    finally:
        _source.pop()


def import_method_module(where: str):
    """Import the Python file (a path ending in .py) or module (a dotted name) that registers a method."""
    if where.endswith(".py"):
        path = Path(where).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"method module {where}: no such file; expected a Python file that calls "
                                    f"minimoe.register_method")
        name = f"minimoe_method_{abs(hash(str(path)))}"
        if name in sys.modules:
            return
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            with _registering(str(path)):
                spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return
    try:
        with _registering(where):
            importlib.import_module(where)
    except ModuleNotFoundError as e:
        if e.name is None or not where.startswith(e.name):
            raise
        raise ModuleNotFoundError(f"method module {where!r}: no such module; expected an importable module name "
                                  f"or a path to a .py file that calls minimoe.register_method") from None


def lookup_method(name: str, module: str | None = None) -> Method:
    """METHODS[name] ("ce" is native), importing `module` first when the method is not registered yet."""
    name = ALIASES.get(name, name)
    if name not in METHODS and module is not None:
        import_method_module(module)
    if name not in METHODS:
        where = (f"{module} was imported but registers no method {name!r}" if module is not None else
                 "for one of your own, pass the file or module that registers it: train.py --method-module")
        raise ValueError(f"unknown method {name!r}; expected one of the registered {list(METHODS)} ({where})")
    return METHODS[name]


def method_of(router_spec: dict | None) -> Method | None:
    """The Method a router spec (model.router_spec, an adapter's "router") installs; None without one."""
    return None if router_spec is None else lookup_method(router_spec["method"], router_spec.get("module"))


for _m in (Method("native", NativeRouter, label="CE", not_exportable=None),
           Method("dual", DualAffinityRouter, label="Dual Affinity", options=DUAL,
                  heads={"affinity": ("copied_head_lr", 1e-3)},  # the paper's rate
                  not_exportable="Dual Affinity mixes the native logits with a trained copy of the gate"),
           Method("tes", TokenErrorRouter, label="TES", options=TES, prediction="error",
                  heads={"error_head": ("error_head_lr", 1e-5)},  # the paper's rate
                  not_exportable="TES attenuates the native logits with its learned error head "
                                 "(a - gamma * phi(e_hat))"),
           Method("acs", ConcentrationRouter, label="ACS", prediction="concentration", not_exportable=None)):
    register_method(_m)


# ----------------------------------------------------------------------------- set_router

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


def set_router(model, method: str = "native", layers="final", *, tune_router: bool = False,
               module: str | None = None, **options):
    """Install `method`'s policy on the layers in scope and record `model.router_spec`.

    `set_router(model, **model.router_spec)` rebuilds the same structure (an adapter loader's
    route); `module` is where a method from outside minimoe is registered (`lookup_method`). New heads
    are trainable and fp32; each native gate `mlp.gate.weight` is frozen unless it is in scope and
    tune_router=True ("+ affinity tuning"), and then it is moved to fp32 (`set_routing_trainable`,
    `tuned_layers`). Install after moving the model to its dtype. Layers out of scope get the native
    policy.
    """
    record = lookup_method(method, module)
    unknown = sorted(set(options) - set(record.options))
    if unknown:
        raise ValueError(f"set_router: option(s) {unknown} do not apply to method {record.name!r}; "
                         f"it takes {sorted(['tune_router', *record.options])}")
    if not isinstance(tune_router, bool):
        raise ValueError(f"set_router: tune_router={tune_router!r}; expected True or False")
    opts = {**record.options, **options}
    for name, default in record.options.items():  # floats in the spec, so that it stays JSON-serialisable
        if isinstance(default, float) and _number(opts[name]):
            opts[name] = float(opts[name])
    blocks = [layer.mlp for layer in model.model.layers]
    scope = resolve_layers(layers, len(blocks))
    c = model.config
    # Build every router first, so that a bad option leaves the model untouched.
    routers = [record.policy.from_gate(mlp.gate, c, **opts) if i in scope
               else NativeRouter(c.num_experts_per_tok, c.norm_topk_prob) for i, mlp in enumerate(blocks)]
    model.router_spec = {"method": record.name, "layers": scope, "tune_router": tune_router, **opts,
                         **({"module": record.module} if record.module else {})}
    tuned = tuned_layers(model.router_spec)
    for i, (mlp, router) in enumerate(zip(blocks, routers)):
        mlp.router = router
        if i in tuned and mlp.gate.weight.dtype != torch.float32:  # trained in fp32, cast at use (model.py)
            mlp.gate.weight = nn.Parameter(mlp.gate.weight.detach().float())
    set_routing_trainable(model)
    return model
