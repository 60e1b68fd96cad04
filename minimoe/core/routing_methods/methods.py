"""The routing methods: one `Method` record each in `METHODS`, every fact about a method that minimoe
reads outside its policy (routing.py); and `set_router`, which installs one on a model.

A record names its policy class, its row label, its options (the policy's keywords) and its heads'
learning rates, each an `Option` declared once with its default, check and help: train.py's
`--method-option NAME=VALUE` and the built-in options' own flags (`--gamma 2`) are made from them, and
set_router and the optimizer take their defaults from them. `Method.configure` gives a record one
run's choices (the objective, lambda, the layer scope, affinity tuning, the option values), checking
them all; train.py resolves --method to one configured Method once, and that object installs the
router (`set_router`, below: the model then holds the same object), drives the training step
(step.py), and labels and names the run. A method from your own file joins `METHODS`
through `minimoe.register_method` (runs/user_methods.py).

Built in: native (CE), dual (Dual Affinity), tes (TES) and acs (ACS), their policies in routing.py,
their defaults the paper's (gamma = tau = 1, mixing weight 0.5; heads at 1e-5 for TES, 1e-3 for Dual);
and the field's baselines: densemixer (DenseMixer, densemixer.py), router (router-only tuning: the
gates in scope train, no LoRA) and esft (esft.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from numbers import Integral, Real
from typing import Callable

import torch
import torch.nn as nn

from minimoe.core.routing_methods import esft
from minimoe.core.routing_methods.densemixer import DenseMixerRouter
from minimoe.core.routing_methods.esft import ESFTRouter
from minimoe.core.routing_methods.objectives import get_objective
from minimoe.core.routing_methods.routing import (TRANSFORMS, ConcentrationRouter, DualAffinityRouter, NativeRouter, Scoring,
                                  TokenErrorRouter, _number, moe_blocks, resolve_layers, set_routing_trainable,
                                  tuned_layers)


def number(kind, low=None, high=None, *, low_open=False, high_open=False) -> Callable:
    """A check for a setting: `kind` (int or float) in [low, high] (open ends where asked), finite. It reads
    text (a flag) or a number (a settings file) and raises ValueError saying what was expected."""
    bounds = [f"{'>' if low_open else '>='} {low}" if low is not None else "",
              f"{'<' if high_open else '<='} {high}" if high is not None else ""]
    what = " ".join(["an integer" if kind is int else "a number", " and ".join(b for b in bounds if b)]).strip()

    def check(value):
        try:
            x = kind(value) if isinstance(value, str) else value
        except ValueError:
            raise ValueError(f"{value!r}: expected {what}") from None
        if (not isinstance(x, Integral if kind is int else Real) or isinstance(x, bool) or not math.isfinite(x)
                or (low is not None and (x <= low if low_open else x < low))
                or (high is not None and (x >= high if high_open else x > high))):
            raise ValueError(f"{value}: expected {what}")
        return x
    return check


@dataclass(frozen=True)
class Option:
    """One setting a method reads: a keyword of its policy, or a head's learning rate."""
    default: object
    help: str = ""
    check: Callable | None = None  # reads text or a value, raises ValueError; None: taken as given (the policy checks)
    choices: tuple = ()

    def parse(self, name: str, value):
        """`value` checked and read (text from a flag, or a settings file's value)."""
        try:
            value = self.check(value) if self.check else value
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        if self.choices and value not in self.choices:
            raise ValueError(f"{name}: {value!r}; expected one of {list(self.choices)}")
        return value


def _option(value) -> Option:
    return value if isinstance(value, Option) else Option(value)


# What export_peft and export_merged say of a method that does not declare that it routes natively.
NOT_NATIVE = "its policy replaces the family's native top-K"


@dataclass(eq=False)
class Method:
    """One routing method (METHODS), and, once `configure`d, one run's use of it."""
    name: str  # --method, and "name" in its record (config.json's "method", an adapter's "router")
    policy: type  # nn.Module; set_router builds it per layer in scope as policy.from_gate(gate, config, **options)
    label: str  # the report's row and the run's name: "-<objective>" follows a supervised one's (TES-IS)
    options: dict = field(default_factory=dict)  # option -> its default, or an Option: the policy's keywords
    # trainable submodule of the policy -> (the option naming its learning rate, its default or Option); the
    # optimizer gives each its own parameter group, named after the option less "_lr"
    heads: dict = field(default_factory=dict)
    # what Routing.prediction holds, supervised against the token CE: "error" (a predicted token CE,
    # e_hat, which the error-prediction diagnostics read) or another name; None: not supervised
    prediction: str | None = None
    # why a merged checkpoint or a peft adapter cannot express its routing; None: it routes natively
    # (its heads, if any, only read), so export_peft and export_merged write it
    not_exportable: str | None = NOT_NATIVE
    module: str | None = None  # where a method from outside minimoe was registered from; None: built in
    lora: bool = True  # False: no LoRA trains (router-only tuning: installed at B = 0 and frozen, the base exactly)
    tunes_gate: bool = False  # the native gates in scope always train (router-only tuning), without a "+" row
    # called once before training's first step (not on a resume) as prepare(model, forwards), forwards yielding
    # (routings, attention_mask) of the untrained model over the training data (ESFT's expert choice); None: none
    prepare: Callable | None = None
    install: Callable | None = None  # install(model), after LoRA and the router: what else trains (ESFT: masks)
    # One run's choices (`configure`); a registered record has none.
    objective: str | None = None  # a name in objectives.OBJECTIVES: what a supervised method's prediction is fitted with
    tune_router: bool = False  # the native gate in scope trains too ("+ affinity tuning")
    values: dict = field(default_factory=dict)  # every setting (`settings`) -> its value in the run
    lambda_: float = 0.0  # lambda_m, the method term's coefficient in the total loss (Eq. total_loss)
    layers: str | list = "final"  # the layer scope (routing.resolve_layers); set_router resolves it on a model
    # the run's file or module of its own (train.py --method-module), imported before this was configured: it
    # registers this method or the run's objective (so unlike `module`, a built-in method may have one)
    imports: str | None = None

    def __post_init__(self):  # a file of your own may declare an option by its default alone
        self.options = {name: _option(o) for name, o in self.options.items()}
        self.heads = {head: (lr, _option(o)) for head, (lr, o) in self.heads.items()}

    @property
    def declared(self) -> dict[str, Option]:
        """Every setting the method reads: its options and its heads' learning rates."""
        return {**self.options, **dict(self.heads.values())}

    @property
    def settings(self) -> dict:
        """Every setting the method reads, with its default."""
        return {name: o.default for name, o in self.declared.items()}

    @property
    def head_groups(self) -> dict[str, tuple[str, str]]:
        """Optimizer group -> (its head, the option naming its learning rate): each head trains in a group
        of its own, named after that option less "_lr" (error_head, copied_head)."""
        return {lr.removesuffix("_lr"): (head, lr) for head, (lr, _) in self.heads.items()}

    @property
    def predicts_error(self) -> bool:
        return self.prediction == "error"

    @property
    def row(self) -> str:
        """The paper's row name: CE, Dual Affinity, TES-IS, ACS-ENLL + affinity tuning, ...; a supervised
        method without an objective (an adapter outside a run) is its label alone: TES, ACS."""
        base = f"{self.label}-{self.objective.upper()}" if self.prediction is not None and self.objective else self.label
        return base + (" + affinity tuning" if self.tune_router and not self.tunes_gate else "")

    @property
    def policy_options(self) -> dict:
        """The policy's keywords (its options, less the heads' learning rates) with their values in the run;
        a float option's as a float (2 -> 2.0), so that a checkpoint's float option builds the policy the same."""
        values = {name: self.values.get(name, o.default) for name, o in self.options.items()}
        return {name: float(v) if isinstance(self.options[name].default, float) and _number(v) else v
                for name, v in values.items()}

    def record(self, layers: list[int] | None = None) -> dict:
        """This configured method as JSON, the one shape: config.json's "method" and an adapter's "router"
        (model.router_spec) are both this; `from_record` reads it back. `layers`: the scope resolved on a
        model (an adapter records the layers it trained, not "final"); None: the scope as configured.
        "module" is the file or module to import first: the run's --method-module, else where the method
        was registered from (None: built in)."""
        return {"name": self.name, "module": self.imports or self.module, "objective": self.objective,
                "lambda_": self.lambda_, "layers": list(layers) if layers is not None else self.layers,
                "tune_router": self.tune_router, "options": dict(self.values)}

    @classmethod
    def from_record(cls, record: dict, *, strict: bool = False) -> Method:
        """The configured Method a `record` (Method.record's shape; a key left out: its default) describes,
        checked by `configure`: the one way from a name and settings to a configured method. Its method must
        be registered: user_methods.method_of imports the record's "module" first. `strict`: as configure's."""
        if unknown := sorted(set(record) - RECORD_FIELDS):
            raise ValueError(f"method record: {unknown} not understood; expected the keys {sorted(RECORD_FIELDS)}")
        if "name" not in record:
            raise ValueError(f"method record {record}: no name; expected one of {list(METHODS)}")
        method = get_method(record["name"])
        return method.configure(record.get("objective"), record.get("tune_router", False), record.get("options"),
                                lambda_=record.get("lambda_", 0.0), layers=record.get("layers", "final"),
                                imports=record.get("module"), strict=strict)

    def configure(self, objective: str | None = None, tune_router: bool = False, options: dict | None = None, *,
                  lambda_: float = 0.0, layers: str | list = "final", imports: str | None = None,
                  strict: bool = False) -> Method:
        """This method as one run uses it, every check of its choices here: `options` against their
        declarations, every setting's value in `values` (the given one, else its default); `objective` a
        registered one (objectives.OBJECTIVES). A setting that only other registered methods read is
        left out (--gamma 2 with --method ce: CE has no gamma, as it has no lambda) unless `strict`
        (set_router's keywords); any other unknown name is an error."""
        given = dict(options or {})
        for name in given:
            if name not in self.declared and (strict or not declaring(name)):
                raise UnknownOption(f"{name}: method {self.name!r} has no such option; it takes "
                                    f"{sorted(self.declared)}")
        if not isinstance(tune_router, bool):
            raise ValueError(f"tune_router={tune_router!r}; expected True or False")
        if objective is not None:
            get_objective(objective)
        values = {name: o.parse(name, given[name]) if name in given else o.default for name, o in self.declared.items()}
        return replace(self, objective=objective, tune_router=tune_router or self.tunes_gate, values=values,
                       lambda_=lambda_, layers=layers, imports=imports)


RECORD_FIELDS = {"name", "module", "objective", "lambda_", "layers", "tune_router", "options"}  # Method.record's keys


class UnknownOption(ValueError):
    """An option that no registered method reads, given to `Method.configure` (the message starts with its name)."""


METHODS: dict[str, Method] = {}
ALIASES = {"ce": "native"}  # the paper's row name for LoRA on native routing; train.py and older config.json say it

LR = number(float, 0, low_open=True)
for _m in (
        Method("native", NativeRouter, label="CE", not_exportable=None),
        Method("dual", DualAffinityRouter, label="Dual Affinity",
               options={"mix": Option(0.5, "mixing weight of the copied head", number(float, 0, 1))},
               heads={"affinity": ("copied_head_lr", Option(1e-3, "copied-head learning rate", LR))},
               not_exportable="Dual Affinity mixes the native logits with a trained copy of the gate"),
        Method("tes", TokenErrorRouter, label="TES", prediction="error",
               options={"gamma": Option(1.0, "attenuation strength", number(float, 0)),
                        "tau": Option(1.0, "started-log reference scale", number(float, 0, low_open=True)),
                        "transform": Option("started-log", "error-to-routing transform; log is the paper's control",
                                            choices=TRANSFORMS)},
               heads={"error_head": ("error_head_lr", Option(1e-5, "error-head learning rate", LR))},
               not_exportable="TES attenuates the native logits with its learned error head "
                              "(a - gamma * phi(e_hat))"),
        Method("acs", ConcentrationRouter, label="ACS", prediction="concentration", not_exportable=None),
        # The field's router-adaptation baselines (docs/methods.md, "Baselines").
        Method("densemixer", DenseMixerRouter, label="DenseMixer", tunes_gate=True, not_exportable=None),
        Method("router", NativeRouter, label="Router only", lora=False, tunes_gate=True, not_exportable=None),
        Method("esft", ESFTRouter, label="ESFT", not_exportable=None, prepare=esft.prepare, install=esft.restrict,
               options={"esft_criterion": Option("token", "which experts train: token-selection ratio or average gate "
                                                     "score", choices=esft.CRITERIA),
                        "esft_p": Option(0.2, "cumulative share the chosen experts reach, per layer",
                                         number(float, 0, 1, low_open=True)),
                        "esft_form": Option("lora", "lora: LoRA on the chosen experts; full: their weights train "
                                                    "in full (the paper's form)", choices=esft.FORMS)},
               heads={"rows": ("esft_lr", Option(1e-5, "learning rate of the chosen experts' weights (full form)",
                                                 LR))})):
    METHODS[_m.name] = _m


def declaring(name: str) -> list[Method]:
    """The registered methods that read the setting `name` (an option or a head's learning rate)."""
    return [m for m in METHODS.values() if name in m.declared]


def get_method(name: str) -> Method:
    """The registered method called `name` ("ce" is native)."""
    record = METHODS.get(ALIASES.get(name, name))
    if record is None:
        aliases = ", ".join(f"{a!r} (the paper's name for {m!r})" for a, m in ALIASES.items())
        raise ValueError(f"unknown method {name!r}; expected one of the registered {list(METHODS)} or {aliases} "
                         f"(for one of your own, pass the file or module that registers it: train.py --method-module)")
    return record


def set_router(model, method="native", layers=None, *, tune_router: bool | None = None, **options):
    """Install `method`'s policy on the layers in scope; the model then holds that one configured Method
    (`model.router_method`, what training, evaluation and export read) and the MoE layers its scope
    resolved to (`model.router_layers`); `model.router_spec` is its record on them, what an adapter saves.

    `method`: a configured methods.Method, as train.py resolves it (`Method.configure`), installed as it
    is; or a registered method's name, configured here (`Method.from_record`) with `layers` ("final" by
    default), `tune_router` and `options`. Given beside a configured Method, these make a new one with
    them changed. `set_router(model, Method.from_record(model.router_spec))` rebuilds the same structure; a
    method from outside minimoe must be registered first (the record's `module`: user_methods.method_of
    imports it, load_adapter's route).
    New heads are trainable and fp32; each native gate `mlp.gate.weight` is frozen unless it is in
    scope and tune_router=True ("+ affinity tuning"), and then it is moved to fp32
    (`set_routing_trainable`, `tuned_layers`). Install after moving the model to its dtype. Layers out
    of scope get the native policy.
    """
    if isinstance(method, str) or layers is not None or tune_router is not None or options:
        record = {"name": method} if isinstance(method, str) else method.record()
        given = {"layers": layers, "tune_router": tune_router}
        record |= {k: v for k, v in given.items() if v is not None}
        record["options"] = {**record.get("options", {}), **options}
        try:
            method = Method.from_record(record, strict=True)
        except ValueError as e:
            raise ValueError(f"set_router: {e}") from None
    if method.tunes_gate and not method.tune_router:  # a record installed as registered: its gates train all the same
        method = replace(method, tune_router=True)
    blocks = moe_blocks(model)  # layer index -> MoE block; dense layers are never routed
    scope = resolve_layers(method.layers, list(blocks))
    c = model.config
    # Build every router first, so that a bad option leaves the model untouched.
    routers = {i: method.policy.from_gate(mlp.gate, c, **method.policy_options) if i in scope
               else NativeRouter(Scoring.of(c)) for i, mlp in blocks.items()}
    model.router_method, model.router_layers = method, scope
    tuned = tuned_layers(model.router_spec)
    for i, mlp in blocks.items():
        mlp.router = routers[i]
        if i in tuned and mlp.gate.weight.dtype != torch.float32:  # trained in fp32, cast at use (model.py)
            mlp.gate.weight = nn.Parameter(mlp.gate.weight.detach().float())
    set_routing_trainable(model)
    return model
