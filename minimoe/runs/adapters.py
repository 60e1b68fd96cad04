"""What was trained, as a file: the adapter folder, its fingerprints, saved and loaded.

The LoRA layers themselves are in minimoe/core/adaptation/lora.py, the routing methods' heads in
minimoe/core/routing_methods/routing.py, the optimizer's groups in minimoe/core/adaptation/trainable.py; the
exports (peft's format, or merged into the base) are minimoe/integrations/hf_export.py's.

Adapter folder: adapter.safetensors (LoRA tensors, all state under `.mlp.router.`, and the
`.mlp.gate.weight` of layers whose gate trains) and adapter_config.json (rank, alpha, dropout,
targets, dtype, base model, a config fingerprint, the installed method's record (`Method.record`, as
config.json holds it but on its resolved layers), the tuned gate layers).
The tensors' format is unchanged since the first adapters; one written before "base_weights" existed
loads without that check, and one whose "router" has the older router-spec layout is read as today's
record (compat.adapter_record).

Decisions:
- `load_adapter` installs LoRA, then the method (the order of training's `install_method`), checks the
  installed method's record against the file's field by field (`record_difference`: a method given by
  the caller that is not the adapter's is refused, naming the field), then checks and copies the
  tensors, strictly (an unknown, missing or misshapen tensor names itself).
- Which native gates an adapter carries ("gate_layers") is what the router spec tunes
  (`routing.tuned_layers`), never read back from requires_grad. An adapter written before that
  with tuned gates and no router spec loads as native routing with those gates tuned, which is
  what it was.
- Router state whose shape the run decides (ESFT's full form: the chosen experts' rows) is sized from the
  file before the strict copy (`router.fit`).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from minimoe.core.adaptation.lora import add_lora, lora_modules
from minimoe.core.routing_methods.methods import Method
from minimoe.core.routing_methods.methods import set_router
from minimoe.core.decoder.model import MoEForCausalLM
from minimoe.core.adaptation.quantized import digest_sample, is_quantized
from minimoe.core.adaptation.sharded_nf4 import RECORDS
from minimoe.core.routing_methods.routing import moe_blocks, tuned_layers
from minimoe.loading.checkpoint import DTYPES, atomic_directory
from minimoe.runs.compat import adapter_record
from minimoe.runs.ranks import full
from minimoe.runs.user_methods import method_of
from minimoe.runs.sharding import put_rows

FINGERPRINT = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_experts",
               "num_experts_per_tok", "intermediate_size")
CONFIG_FIELDS = ("rank", "alpha", "dropout", "targets", "dtype", "base_model", "fingerprint", "router", "gate_layers")


def fingerprint(config) -> dict:
    return {k: getattr(config, k) for k in FINGERPRINT}


def base_weights_digest(model: MoEForCausalLM) -> str:
    """A digest of the frozen base weights: per tensor, a strided sample of <= 4096 values rounded to
    bfloat16 (so the same checkpoint loaded in fp32 or bf16 agrees). Another model of the same shapes
    (another seed, a base vs its SFT) differs. LoRA, method heads and native gates (they may train) are left out."""
    if any(m.merged for m in lora_modules(model).values()):
        raise ValueError("the model's LoRA is merged; unmerge_lora first (the digest is of the base weights)")
    h = hashlib.sha256()
    for name, shape, sample in base_samples(model):
        if name.endswith((".lora_A", ".lora_B", ".mlp.gate.weight")) or ".mlp.router." in name:
            continue
        h.update(f"{name}{shape}".encode())
        h.update(sample().view(torch.int16).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def base_samples(model: nn.Module):
    """(name, shape, its digest sample, lazily) per parameter in named_parameters' order, with a packed
    weight (core/adaptation/quantized.py) in its place, sampled as loaded: a QLoRA adapter's digest is its base's."""
    seen = set()
    for prefix, module in model.named_modules():
        entries = list(module._parameters.items())
        if is_quantized(module):  # the packed weight, not its sharded bytes (core/adaptation/sharded_nf4.py)
            entries = [("weight", module.packed), *((k, p) for k, p in entries if k != RECORDS)]
        for leaf, p in entries:
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            name = f"{prefix}.{leaf}" if prefix else leaf
            if is_quantized(module) and p is module.packed:
                yield name, tuple(p.shape), lambda p=p: p.sample
            else:  # sharded (FSDP): gathered one parameter at a time
                yield name, tuple(p.shape), lambda p=p: digest_sample(full(p))


def adapter_tensors(model: MoEForCausalLM, gate_layers) -> dict[str, torch.Tensor]:
    """The adapter's state: LoRA tensors, method-head state, and the native gates of `gate_layers`."""
    gates = {f"model.layers.{i}.mlp.gate.weight" for i in gate_layers}
    return {k: v for k, v in model.state_dict().items()
            if k.endswith((".lora_A", ".lora_B")) or ".mlp.router." in k or k in gates}


def gate_layers(model: MoEForCausalLM) -> list[int]:
    """The layers whose native gate an adapter carries: those `router_spec` tunes. A gate unfrozen
    by hand is refused rather than dropped from the file."""
    tuned = tuned_layers(model.router_spec)
    untracked = [i for i, mlp in moe_blocks(model).items() if mlp.gate.weight.requires_grad and i not in tuned]
    if untracked:
        raise ValueError(f"the native gate of layer(s) {untracked} trains, but the router spec does not tune it; "
                         f"tune gates with set_router(model, method, layers, tune_router=True)")
    return tuned


def save_adapter(model: MoEForCausalLM, path, *, base_model: str):
    """Write adapter.safetensors and adapter_config.json to `path`, atomically."""
    spec = model.lora_spec
    if spec is None:
        raise ValueError("save_adapter: the model has no LoRA; call add_lora first")
    gates = gate_layers(model)
    tensors = {k: full(v).detach().cpu().contiguous() for k, v in adapter_tensors(model, gates).items()}
    config = dict(spec, base_model=str(base_model),
                  fingerprint=fingerprint(model.config) | {"base_weights": base_weights_digest(model)},
                  router=model.router_spec, gate_layers=gates)
    if dist.is_initialized() and dist.get_rank() != 0:  # sharded: every rank gathered (runs/sharding.py); rank 0 writes
        return
    with atomic_directory(path, "adapter") as tmp:
        save_file(tensors, str(tmp / "adapter.safetensors"), metadata={"format": "pt"})
        with open(tmp / "adapter_config.json", "w") as f:
            json.dump(config, f, indent=2)


def load_adapter(model: MoEForCausalLM, path, *, allow_other_base: bool = False,
                 method: Method | None = None) -> MoEForCausalLM:
    """Restore a saved adapter into `model` (a base model, or one with the same LoRA); strict.

    `method`: the configured Method the caller resolved already (run_folder.AdapterSource.method), installed as
    it is; None: resolved here from the adapter's method record (user_methods.method_of). Either way the installed
    method's record must equal the adapter's in every field it holds (`record_difference`; an older layout
    is read by compat.adapter_record), else the error names the first that differs.

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
    router = adapter_record(config)  # the method record, as Method.record writes it (older layouts: compat)
    if tuned_layers(router) != config["gate_layers"]:
        raise ValueError(f"{path / 'adapter_config.json'}: gate_layers {config['gate_layers']} are not the layers "
                         f"its router spec tunes ({tuned_layers(router)})")
    spec = {k: config[k] for k in ("rank", "alpha", "dropout", "targets", "dtype")}
    if model.lora_spec is None:
        add_lora(model, spec["rank"], spec["alpha"], spec["dropout"], spec["targets"], DTYPES[spec["dtype"]])
    for k, v in spec.items():
        if model.lora_spec[k] != v:
            raise ValueError(f"{path}: the model's LoRA has {k} = {model.lora_spec[k]!r}; the adapter has {v!r}")
    if any(m.merged for m in lora_modules(model).values()):
        raise ValueError(f"{path}: the model's LoRA is merged; unmerge_lora before loading an adapter")
    if router is not None:  # after LoRA, as training installs them (training.install_method)
        set_router(model, method or method_of(router))
        if differ := record_difference(router, json.loads(json.dumps(model.router_spec))):
            field, saved, installed = differ
            raise ValueError(f"{path / 'adapter_config.json'}: its method record has {field} = {saved!r}; the method "
                             f"given to load_adapter installs {field} = {installed!r} (the record: {router})")
    file = path / "adapter.safetensors"
    try:
        got = load_file(str(file))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file}: not a readable safetensors file ({e}); the adapter is truncated or "
                         f"corrupt") from None
    for i, mlp in moe_blocks(model).items():  # router state sized by the file (ESFT's full form: the chosen rows)
        if hasattr(mlp.router, "fit"):
            prefix = f"model.layers.{i}.mlp.router."
            mlp.router.fit(mlp, {k[len(prefix):]: v for k, v in got.items() if k.startswith(prefix)})
    want = adapter_tensors(model, config["gate_layers"])
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


def record_difference(saved: dict, installed: dict) -> tuple[str, object, object] | None:
    """The first field of the method record `saved` (an option as options.NAME) whose value the installed
    record does not share -> (field, saved value, installed value); None: they agree. Every field `saved`
    holds is compared (an older adapter's record holds fewer: compat.adapter_record)."""
    flat = [({f"options.{k}": v for k, v in r.get("options", {}).items()} | {k: v for k, v in r.items() if k != "options"})
            for r in (saved, installed)]
    for field, value in flat[0].items():
        if flat[1].get(field) != value:
            return field, value, flat[1].get(field)
    return None


def load_adapter_rows(model: MoEForCausalLM, folder: Path):
    """A run's own checkpoint (checkpoints/epoch-N or step-G, written by this run: config.json is checked
    equal on --resume) into the sharded model: each rank its rows. Strict on the tensor names."""
    file = folder / "adapter.safetensors"
    got = load_file(str(file))
    want = adapter_tensors(model, gate_layers(model))
    if set(got) != set(want):
        odd = sorted(set(got) ^ set(want))
        raise KeyError(f"{file}: tensor {odd[0]!r} is {'unexpected' if odd[0] in got else 'missing'} "
                       f"({len(odd)} differ); expected this run's adapter")
    put_rows(model, {k: v.to(want[k].dtype) for k, v in got.items()})
