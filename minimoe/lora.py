"""LoRA on attention projections and routed experts, merging, and adapter files.

`add_lora(model)` replaces the targeted modules in place. A LoRA module keeps the base module's
parameter names (`...q_proj.weight`, `...experts.gate_up_proj.weight`), so checkpoint I/O is
unchanged, and adds `lora_A`, `lora_B` beside them: y = W x + (alpha / r) B A dropout(x).
Only LoRA parameters, the method heads under `.mlp.router.` and the native gates that
`set_router(..., tune_router=True)` unfroze ("+ affinity tuning") train; the rest is frozen.

Decisions:
- Targets: "q", "k", "v", "o" and the two expert banks "gate_up", "down" ("experts": both). The
  default is the paper's (Table experimental_configuration): Granite Q/K/V + routed experts, OLMoE
  Q/K/V/O + routed experts, in every layer.
- Experts: grouped LoRA, A [E, r, in] and B [E, out, r], run on the expert-sorted rows with the
  base bank's `expert_matmul`; `W + BA` is built only by merging, never per step.
- One rank-r LoRA per *on-disk* matrix, read off the checkpoint name table. Granite stores the fused
  input_linear [E, 2I, D] and output_linear: one LoRA each. OLMoE stores gate_proj and up_proj
  apart, so our fused gate_up bank carries two independent LoRAs, as peft puts on OLMoE's
  per-expert modules: A [E, 2r, D] whose first r rows feed B[:, :I] (gate) and last r rows B[:, I:]
  (up), B [E, 2I, r]. A test against peft on transformers' OlmoeForCausalLM holds this equal. One
  difference: peft draws separate dropout masks for gate_proj and up_proj; here both share one.
- Init as peft: A Kaiming-uniform (a = sqrt 5: U(+-1/sqrt(in)) per expert), B = 0, so outputs
  are unchanged until training moves B. Dropout acts on the LoRA input only (train mode only).
- dtype: adapters are stored in fp32 (peft's default, `autocast_adapter_dtype`), so small AdamW
  steps are not rounded away on a bf16 base; they are cast to the activation dtype at use, as
  autocast would, so a bf16 expert LoRA runs through the same grouped_mm kernel as the base bank.
  The base keeps its load dtype. Merging adds in fp32 and rounds once, so in bf16 a merge/unmerge
  round trip may move a weight by one rounding step (as in peft); `export_merged` puts the exact
  original weights back instead of unmerging.
- `export_merged` refuses TES and Dual Affinity: the merged checkpoint has no place for their
  method heads, so it would route natively and not reproduce minimoe's own evaluation.

Adapter folder: adapter.safetensors (LoRA tensors, all state under `.mlp.router.`, and the
`.mlp.gate.weight` of layers whose gate trains) and adapter_config.json (rank, alpha, dropout,
targets, dtype, base model, a config fingerprint, the `set_router` spec, the tuned gate layers).
"""
from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from minimoe.checkpoint import DTYPES, LAYER_KEYS, atomic_directory, write_checkpoint
from minimoe.model import GroupedLinear, MoEForCausalLM, expert_matmul
from minimoe.routing import set_router

TARGETS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
           "gate_up": "mlp.experts.gate_up_proj", "down": "mlp.experts.down_proj"}
ALIASES = {"experts": ("gate_up", "down")}
DEFAULT_TARGETS = {"granitemoe": ("q", "k", "v", "experts"), "olmoe": ("q", "k", "v", "o", "experts")}
FINGERPRINT = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_experts",
               "num_experts_per_tok", "intermediate_size")
# Training-loop parameter groups: the first group whose pattern a trainable parameter's name contains.
PARAM_GROUPS = {"lora": (".lora_A", ".lora_B"), "error_head": (".router.error_head",),
                "copied_head": (".router.affinity",), "router": (".mlp.gate.weight",)}
CONFIG_FIELDS = ("rank", "alpha", "dropout", "targets", "dtype", "base_model", "fingerprint", "router", "gate_layers")


class LoRAMixin:
    """lora_A [..., blocks*r, in], lora_B [..., out, r]: block b of A feeds row block b of B."""

    def _init_lora(self, rank: int, alpha: float, dropout: float, blocks: int, dtype):
        *lead, out_features, in_features = self.weight.shape
        kw = dict(dtype=dtype, device=self.weight.device)
        bound = 1 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)) on one [r, in] matrix
        self.lora_A = nn.Parameter(torch.empty(*lead, blocks * rank, in_features, **kw).uniform_(-bound, bound))
        self.lora_B = nn.Parameter(torch.zeros(*lead, out_features, rank, **kw))
        self.blocks, self.scale, self.merged = blocks, alpha / rank, False
        self.dropout = nn.Dropout(dropout)

    def branch(self, x):
        """(x, A, B) in the dtype the adapter branch runs in. On CPU that is the adapters' dtype
        (fp32 by default), as in peft: in bf16, oneDNN compiles and caches one more small matmul
        per expert block size (bench/RESULTS.md). On CUDA it is x's dtype (bf16 under autocast),
        because grouped_mm there takes bf16 only."""
        dtype = x.dtype if x.is_cuda else self.lora_A.dtype
        return x.to(dtype), self.lora_A.to(dtype), self.lora_B.to(dtype)

    def add_delta(self, y, delta):
        """y + scale * delta, rounded once to y's dtype."""
        return (y + self.scale * delta).to(y.dtype)

    def delta_weight(self):
        """scale * B A in fp32, shaped like the base weight, with OLMoE's gate/up blocks kept apart."""
        A, B = self.lora_A.float(), self.lora_B.float()
        pairs = zip(B.chunk(self.blocks, dim=-2), A.chunk(self.blocks, dim=-2))
        return self.scale * torch.cat([b @ a for b, a in pairs], dim=-2)

    @torch.no_grad()
    def merge(self):
        if not self.merged:
            self.weight.copy_(self.weight.float() + self.delta_weight())
            self.merged = True

    @torch.no_grad()
    def unmerge(self):
        if self.merged:
            self.weight.copy_(self.weight.float() - self.delta_weight())
            self.merged = False

    def extra_repr(self):
        return f"rank={self.lora_B.shape[-1]}, blocks={self.blocks}, scale={self.scale}, merged={self.merged}"


class LoRALinear(LoRAMixin, nn.Module):
    """An nn.Linear's own weight and bias plus lora_A [r, in], lora_B [out, r]."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float, dtype=torch.float32):
        super().__init__()
        self.weight, self.bias = base.weight, base.bias
        self._init_lora(rank, alpha, dropout, 1, dtype)

    def forward(self, x):  # x [..., in] -> [..., out]
        y = F.linear(x, self.weight, self.bias)
        if self.merged:
            return y
        x, A, B = self.branch(x)
        return self.add_delta(y, F.linear(F.linear(self.dropout(x), A), B))


class LoRAGroupedLinear(LoRAMixin, GroupedLinear):
    """A GroupedLinear's weight [E, out, in] plus lora_A [E, blocks*r, in], lora_B [E, out, r]."""

    def __init__(self, base: GroupedLinear, rank: int, alpha: float, dropout: float, blocks: int = 1,
                 dtype=torch.float32):
        nn.Module.__init__(self)  # adopt the base bank instead of allocating a new one
        self.weight = base.weight
        self._init_lora(rank, alpha, dropout, blocks, dtype)

    def forward(self, x, dispatch):  # x [N, in] sorted by expert -> [N, out]
        y = expert_matmul(x, self.weight, dispatch)
        if self.merged:
            return y
        x, A, B = self.branch(x)
        a = expert_matmul(self.dropout(x), A, dispatch)  # [N, blocks*r]
        pairs = zip(a.chunk(self.blocks, dim=-1), B.chunk(self.blocks, dim=-2))
        return self.add_delta(y, torch.cat([expert_matmul(a_b, B_b, dispatch) for a_b, B_b in pairs], dim=-1))


def resolve_targets(targets) -> list[str]:
    """User target names -> bank names in TARGETS order; an unknown name raises, naming it."""
    names = set()
    for t in [targets] if isinstance(targets, str) else targets:
        if t not in TARGETS and t not in ALIASES:
            raise ValueError(f"add_lora: unknown target {t!r}; expected some of {list(TARGETS) + list(ALIASES)}")
        names.update(ALIASES.get(t, (t,)))
    if not names:
        raise ValueError("add_lora: no targets given")
    return [t for t in TARGETS if t in names]


def lora_modules(model: nn.Module) -> dict[str, LoRAMixin]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRAMixin)}


# The paper's LoRA for both backbones (Experimental Configuration table): add_lora's defaults and every recipe's.
RANK, ALPHA, DROPOUT = 8, 8.0, 0.05


def add_lora(model: MoEForCausalLM, rank: int = RANK, alpha: float = ALPHA, dropout: float = DROPOUT, targets=None,
             dtype=torch.float32) -> MoEForCausalLM:
    """Put LoRA on `targets` of every layer (None: the family's default) and freeze everything else
    but the method heads and the native gates that `set_router(..., tune_router=True)` unfroze."""
    config = model.config
    if not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"add_lora: rank must be a positive int, got {rank!r}")
    if not 0 <= dropout < 1:
        raise ValueError(f"add_lora: dropout must be in [0, 1), got {dropout!r}")
    if lora_modules(model):
        raise ValueError("add_lora: the model already has LoRA modules")
    targets = resolve_targets(DEFAULT_TARGETS[config.model_type] if targets is None else targets)
    for name, p in model.named_parameters():
        p.requires_grad_(".mlp.router." in name)  # method heads keep training
    router = model.router_spec or {}
    for i in router.get("layers", []) if router.get("tune_router") else []:
        model.model.layers[i].mlp.gate.weight.requires_grad_(True)  # set_router's "+ affinity tuning"
    for i, layer in enumerate(model.model.layers):
        for t in targets:
            parent_name, _, leaf = TARGETS[t].rpartition(".")
            parent, base = layer.get_submodule(parent_name), layer.get_submodule(TARGETS[t])
            if isinstance(base, GroupedLinear):
                disk = LAYER_KEYS[config.model_type].get(f"{TARGETS[t]}.weight")
                blocks = len(disk) if isinstance(disk, tuple) else 1  # one LoRA per on-disk matrix
                lora = LoRAGroupedLinear(base, rank, alpha, dropout, blocks, dtype)
            else:
                lora = LoRALinear(base, rank, alpha, dropout, dtype)
            setattr(parent, leaf, lora.train(base.training))  # an eval model keeps its dropout off
    model.lora_spec = dict(rank=rank, alpha=alpha, dropout=dropout, targets=targets,
                           dtype=str(dtype).removeprefix("torch."))
    return model


def merge_lora(model: nn.Module):
    for m in lora_modules(model).values():
        m.merge()


def unmerge_lora(model: nn.Module):
    for m in lora_modules(model).values():
        m.unmerge()


def trainable_parameters(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Trainable (name, parameter) pairs by group (PARAM_GROUPS), for the optimizer's param groups."""
    groups = {g: [] for g in PARAM_GROUPS}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        group = next((g for g, pats in PARAM_GROUPS.items() if any(s in name for s in pats)), None)
        if group is None:
            raise ValueError(f"parameter {name!r} trains but matches no group of {dict(PARAM_GROUPS)}; "
                             "freeze it or give it a group")
        groups[group].append((name, p))
    return groups


# ----------------------------------------------------------------------------- adapter files

def fingerprint(config) -> dict:
    return {k: getattr(config, k) for k in FINGERPRINT}


def base_weights_digest(model: MoEForCausalLM) -> str:
    """A digest of the frozen base weights: per tensor, a strided sample of <= 4096 values rounded to
    bfloat16 (so the same checkpoint loaded in fp32 or bf16 agrees). Another model of the same shapes
    (another seed, a base vs its SFT) differs. LoRA, method heads and native gates (they may train) are left out."""
    if any(m.merged for m in lora_modules(model).values()):
        raise ValueError("the model's LoRA is merged; unmerge_lora first (the digest is of the base weights)")
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        if name.endswith((".lora_A", ".lora_B", ".mlp.gate.weight")) or ".mlp.router." in name:
            continue
        flat = p.detach().reshape(-1)
        sample = flat[::max(1, flat.numel() // 4096)][:4096].to(torch.bfloat16).view(torch.int16)
        h.update(f"{name}{tuple(p.shape)}".encode())
        h.update(sample.cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def adapter_tensors(model: MoEForCausalLM, gate_layers) -> dict[str, torch.Tensor]:
    """The adapter's state: LoRA tensors, method-head state, and the native gates of `gate_layers`."""
    gates = {f"model.layers.{i}.mlp.gate.weight" for i in gate_layers}
    return {k: v for k, v in model.state_dict().items()
            if k.endswith((".lora_A", ".lora_B")) or ".mlp.router." in k or k in gates}


def save_adapter(model: MoEForCausalLM, path, *, base_model: str):
    """Write adapter.safetensors and adapter_config.json to `path`, atomically."""
    spec = model.lora_spec
    if spec is None:
        raise ValueError("save_adapter: the model has no LoRA; call add_lora first")
    gate_layers = [i for i, layer in enumerate(model.model.layers) if layer.mlp.gate.weight.requires_grad]
    tensors = {k: v.detach().cpu().contiguous() for k, v in adapter_tensors(model, gate_layers).items()}
    config = dict(spec, base_model=str(base_model),
                  fingerprint=fingerprint(model.config) | {"base_weights": base_weights_digest(model)},
                  router=model.router_spec, gate_layers=gate_layers)
    with atomic_directory(path, "adapter") as tmp:
        save_file(tensors, str(tmp / "adapter.safetensors"), metadata={"format": "pt"})
        with open(tmp / "adapter_config.json", "w") as f:
            json.dump(config, f, indent=2)


def load_adapter(model: MoEForCausalLM, path, *, allow_other_base: bool = False) -> MoEForCausalLM:
    """Restore a saved adapter into `model` (a base model, or one with the same LoRA); strict.

    An adapter trained on other base weights of the same shapes (fingerprint "base_weights") is
    refused unless allow_other_base; other shapes are refused always.

    The router spec and the LoRA modules are installed before the tensors are checked, so after an
    error the model may carry them with fresh values: discard it.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such adapter folder")
    for file in ("adapter_config.json", "adapter.safetensors"):
        if not (path / file).is_file():
            raise FileNotFoundError(f"{path}: missing {file}")
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path / 'adapter_config.json'}: not valid JSON ({e}); the adapter folder is "
                         f"truncated or corrupt") from None
    missing = [k for k in CONFIG_FIELDS if k not in config]
    if missing:
        raise ValueError(f"{path / 'adapter_config.json'}: missing field(s) {missing}")
    ours = fingerprint(model.config)
    for k, expected in config["fingerprint"].items():
        if k != "base_weights" and ours.get(k) != expected:
            raise ValueError(f"{path}: adapter was trained on {config['base_model']!r}, this model is a different "
                             f"{ours['model_type']} model: field {k} is {ours.get(k)!r}, expected {expected!r}")
    expected = config["fingerprint"].get("base_weights")  # absent in adapters written before it existed
    if expected is not None and not allow_other_base and (digest := base_weights_digest(model)) != expected:
        raise ValueError(f"{path}: adapter was trained on {config['base_model']!r}, whose weights differ from this "
                         f"model's (base_weights digest {digest}, expected {expected}); pass "
                         f"--allow-other-base (allow_other_base=True) to apply it anyway")
    if config.get("router") is not None:
        set_router(model, **config["router"])
    spec = {k: config[k] for k in ("rank", "alpha", "dropout", "targets", "dtype")}
    if model.lora_spec is None:
        add_lora(model, spec["rank"], spec["alpha"], spec["dropout"], spec["targets"], DTYPES[spec["dtype"]])
    for k, v in spec.items():
        if model.lora_spec[k] != v:
            raise ValueError(f"{path}: the model's LoRA has {k} = {model.lora_spec[k]!r}; the adapter has {v!r}")
    if any(m.merged for m in lora_modules(model).values()):
        raise ValueError(f"{path}: the model's LoRA is merged; unmerge_lora before loading an adapter")
    for i in config["gate_layers"]:
        model.model.layers[i].mlp.gate.weight.requires_grad_(True)
    want = adapter_tensors(model, config["gate_layers"])
    file = path / "adapter.safetensors"
    try:
        got = load_file(str(file))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file}: not a readable safetensors file ({e}); the adapter is truncated or "
                         f"corrupt") from None
    unexpected, missing = sorted(set(got) - set(want)), sorted(set(want) - set(got))
    if unexpected:
        raise KeyError(f"{file}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} in all)")
    if missing:
        raise KeyError(f"{file}: missing tensor {missing[0]!r} ({len(missing)} in all)")
    for k, t in got.items():
        if t.shape != want[k].shape:
            raise ValueError(f"{file}: {k!r} has shape {tuple(t.shape)}; expected {tuple(want[k].shape)}")
    with torch.no_grad():
        for k, t in got.items():
            want[k].copy_(t)
    return model


# Methods whose routing function no checkpoint or peft adapter can express, and why.
ROUTING_HEADS = {
    "tes": "TES attenuates the native logits with its learned error head (a - gamma * phi(e_hat))",
    "dual": "Dual Affinity mixes the native logits with a trained copy of the gate",
}


def refuse_routing_heads(router_spec: dict | None, what: str):
    """Raise if `router_spec` names a method whose routing a plain MoE (or a peft adapter) cannot express."""
    method = (router_spec or {}).get("method")
    if method in ROUTING_HEADS:
        raise ValueError(f"{what}: refused for method {method!r}: {ROUTING_HEADS[method]}, which changes the "
                         "routing function itself; the official architecture (and so peft, transformers and vLLM) "
                         "has no place for it. Evaluate or serve it with minimoe (evaluate.py, load_adapter)")


def export_merged(model: MoEForCausalLM, path, *, copy_files=()):
    """Save the merged base weights in the official layout, with `copy_files` (e.g. the base's
    tokenizer files) beside them; refused for TES and Dual Affinity.

    A merge keeps LoRA and tuned native gates but has no place for method heads, so a TES or Dual
    model would silently route natively once reloaded. The model is left as it was: the unmerged
    weights are put back exactly, not by subtraction.
    """
    refuse_routing_heads(getattr(model, "router_spec", None), "export_merged")
    originals = {}
    with torch.no_grad():
        for name, m in lora_modules(model).items():
            if not m.merged:
                originals[name] = m.weight.data
                m.weight.data = (m.weight.float() + m.delta_weight()).to(m.weight.dtype)
        for i, layer in enumerate(model.model.layers):  # a tuned gate trains in fp32 (routing.py): rounded once
            if layer.mlp.gate.weight.dtype != model.dtype:
                originals[f"model.layers.{i}.mlp.gate"] = layer.mlp.gate.weight.data
                layer.mlp.gate.weight.data = layer.mlp.gate.weight.data.to(model.dtype)
    try:
        with atomic_directory(path, "merged-model") as tmp:
            write_checkpoint(model, tmp)
            for file in map(Path, copy_files):
                shutil.copyfile(file, tmp / file.name)
    finally:
        for name, weight in originals.items():
            model.get_submodule(name).weight.data = weight
