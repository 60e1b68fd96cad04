"""Export what was trained: in peft's format, for peft + transformers (and the servers that read it), or
merged into its base, as a plain checkpoint.

`export_peft(adapter_or_run, out_dir)` writes `adapter_config.json` and `adapter_model.safetensors`
such that `peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out_dir)`
gives minimoe's logits with the adapter (tests/core/decoder/test_families_parity.py holds this for every family,
tests/integrations/test_hf_export.py for each exportable method). Our names map onto the checkpoint's
through the family's `layer_keys` (core/decoder/families.py), the one name table:
- Attention LoRA keeps its modules and shapes: `q_proj.lora_A [r, D]`, `lora_B [out, r]`.
- Granite's fused expert banks are 3-D parameters in transformers (`input_linear.weight [E, 2I, D]`,
  `output_linear.weight`), so they go through peft's `target_parameters` (its ParamWrapper), which
  stores A as [E*r, in] with the expert index slowest and B as [out, r*E] with the expert index
  fastest: A = ours.reshape(E*r, in), B = ours.permute(1, 2, 0).reshape(out, r*E).
- A bank stored in another layout (a `Converted` entry of the record: gpt-oss's and Llama 4's x @ W,
  `gate_up_proj [E, D, 2I]`, `down_proj [E, I, D]`) is adapted by peft's ParamWrapper as W[e] += B_e A_e
  with W[e] taken as [out', in'] = its two last dims. Each such layout reorders our [out, in] rows, then
  transposes (`Layout.to_disk`), so our delta B A stored is A^T to_disk(B): peft's B_e is our A_e^T and
  its A_e is to_disk(our B_e) (gate_up's columns interleaved as the checkpoint's, where they are). The
  banks are parameters of one module (`mlp.experts`), which peft wraps once per parameter in the module's
  parameter order: the first one's keys sit under one `base_layer.` per later wrapper. Gemma 4's banks are such
  parameters too (`experts.gate_up_proj`, `experts.down_proj`, no `.weight`), stored [E, out, in] as ours.
- OLMoE keeps per-expert modules on transformers 4.x: our fused gate_up pair splits into rank-r
  LoRAs on `experts.{j}.gate_proj` (A rows [0, r), B rows [0, I)) and `up_proj` (the rest), and
  down_proj's pair into `experts.{j}.down_proj`.
- Native gates tuned by "+ affinity tuning" go to `modules_to_save` under their full module path,
  so that only the tuned layers are replaced.
- A method that routes natively (its record's `not_exportable` is None: native, acs, and the baselines
  densemixer, esft, router) exports as LoRA on native routing does; its router state, if any (ESFT's
  choice of experts), is training's and is left out. ESFT's full form trains expert weights in full
  (`.mlp.router.rows.`), which peft's LoRA cannot hold: refused by name (export it merged). The others change the routing function itself (an error head's
  attenuation, a mixed copied gate), which no peft adapter can express: they are refused with an
  error saying so (refuse_routing_heads).
- `lora_dropout` is the trained value, except 0 when `target_parameters` is set: peft's
  ParamWrapper refuses any other value. Dropout acts in training only, so the logits are the same.
- Tensors keep their stored dtype (fp32 adapters; a tuned gate in its model dtype). Nothing here
  imports peft: it is a test-only dependency.

`export_merged(model, out_dir)` writes the merged base weights in the official layout; `export_merged_adapter`
loads an adapter's base, applies the adapter and merges it (`export.py --merged`):
- It refuses a method whose record says it does not route natively (`Method.not_exportable`): the merged
  checkpoint has no place for its heads, so it would route natively and not reproduce minimoe's own
  evaluation. It puts the exact original weights back afterwards instead of unmerging (a bf16 round trip
  may round).
- Router state whose shape the run decided (ESFT's full form: the chosen experts' rows) is written into its
  banks (`router.merged_banks`).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from minimoe.atomic import atomic_directory
from minimoe.core.adaptation.lora import lora_modules
from minimoe.core.adaptation.quantized import dequantize_model
from minimoe.core.decoder.families import Converted, family_of
from minimoe.core.decoder.model import MoEForCausalLM
from minimoe.core.routing_methods.methods import Method
from minimoe.core.routing_methods.routing import moe_blocks
from minimoe.loading.checkpoint import from_pretrained, write_checkpoint
from minimoe.loading.hub import resolve_checkpoint
from minimoe.loading.layouts import layout_of
from minimoe.runs.adapters import adapter_tensors, fingerprint, gate_layers, load_adapter
from minimoe.runs.run_folder import resolve_adapter  # a run folder resolves through selection.json

PREFIX = "base_model.model."  # where peft's PeftModelForCausalLM keeps the transformers model's keys


def _adapter_state(adapter_or_run, checkpoint: str | None) -> tuple[dict, dict[str, torch.Tensor], object]:
    """(adapter config as save_adapter writes it, tensors, its configured Method or None) from a model, an
    adapter folder or a run; the method as the merged export reads it (the model's, or AdapterSource.method)."""
    if isinstance(adapter_or_run, MoEForCausalLM):
        model = adapter_or_run
        if model.lora_spec is None:
            raise ValueError("export_peft: the model has no LoRA; call add_lora (or load_adapter) first")
        gates = gate_layers(model)
        config = dict(model.lora_spec, fingerprint=fingerprint(model.config), base_model=None,
                      router=model.router_spec, gate_layers=gates)
        return config, {k: v.detach().cpu() for k, v in adapter_tensors(model, gates).items()}, model.router_method
    source = resolve_adapter(adapter_or_run, checkpoint, flag=None)
    config = json.loads((source.folder / "adapter_config.json").read_text(encoding="utf-8"))
    return config, load_file(str(source.folder / "adapter.safetensors")), source.method


def param_wrapper_factor(t, ab: str, E: int, r: int):
    """Our grouped LoRA factor of an [E, out, in] bank -> peft's ParamWrapper's: A [E, r, in] -> [E*r, in], the
    expert slowest; B [E, out, r] -> [out, r*E], the expert fastest."""
    return t.reshape(E * r, t.shape[-1]) if ab == "lora_A" else t.permute(1, 2, 0).reshape(t.shape[1], r * E)


def peft_tensors(config: dict, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    """Our adapter tensors -> (peft's state dict, the targets for its config); unknown keys raise."""
    fp = config["fingerprint"]
    table, E, r = family_of(fp["model_type"]).layer_keys, fp["num_experts"], config["rank"]
    out, modules, params, saved = {}, set(), set(), []
    wrapped = {}  # peft module path -> {parameter name: {"lora_A"/"lora_B": tensor}} (Converted banks)
    # the order of the banks that are parameters of one module (Converted ones, and Gemma 4's bare ones)
    order = [(d.key if isinstance(d, Converted) else d).rpartition(".")[2] for d in table.values()
             if isinstance(d, Converted) or isinstance(d, str) and not d.endswith(".weight")]
    for key in sorted(tensors):
        t = tensors[key]
        layer, _, name = key.partition(".layers.")[2].partition(".")
        prefix = f"{PREFIX}model.layers.{layer}."
        if key.endswith(".weight") and name == "mlp.gate.weight":  # a tuned native gate
            disk = table.get(name, name)
            out[prefix + disk] = t
            saved.append(f"model.layers.{layer}.{disk.removesuffix('.weight')}")
            continue
        if ".mlp.router." in key:  # state of a method that routes natively (export_peft refuses the others):
            continue  # read in training only (ESFT's choice of experts), no part of the forward
        if not key.endswith((".lora_A", ".lora_B")):
            raise KeyError(f"export_peft: tensor {key!r} has no peft counterpart; expected LoRA tensors and "
                           "tuned native gates only")
        base, _, ab = name.rpartition(".")  # e.g. "mlp.experts.gate_up_proj", "lora_A"
        disk = table.get(f"{base}.weight", f"{base}.weight")
        if isinstance(disk, Converted):  # a bank stored as x @ W: peft's B_e = A_e^T, A_e = to_disk(B_e)
            module, _, param = disk.key.rpartition(".")
            pieces = wrapped.setdefault(prefix + module, {}).setdefault(param, {})
            if ab == "lora_A":  # ours [E, r, in] -> peft's B [out', r*E] (out' = our in), expert fastest
                pieces["lora_B"] = t.permute(2, 1, 0).reshape(t.shape[-1], r * E)
            else:  # ours [E, out, r] -> [E, r, in'] (in' = our out, in the disk's order) -> peft's A [E*r, in']
                pieces["lora_A"] = layout_of(disk).to_disk(t).reshape(E * r, t.shape[1])
            params.add(f"{module.rpartition('.')[2]}.{param}")  # "experts.gate_up_proj"
        elif isinstance(disk, str) and t.dim() == 3 and not disk.endswith(".weight"):  # a bank that is a bare
            module, _, param = disk.rpartition(".")  # parameter of one module holding both (Gemma 4's experts)
            wrapped.setdefault(prefix + module, {}).setdefault(param, {})[ab] = param_wrapper_factor(t, ab, E, r)
            params.add(f"{module.rpartition('.')[2]}.{param}")  # "experts.gate_up_proj"
        elif isinstance(disk, str) and t.dim() == 2:  # a linear layer: same module, same shapes
            module = disk.removesuffix(".weight")
            out[f"{prefix}{module}.{ab}.weight"] = t
            modules.add(module.rpartition(".")[2])
        elif isinstance(disk, str):  # a fused [E, out, in] bank: peft's ParamWrapper layout
            module = disk.removesuffix(".weight")
            out[f"{prefix}{module}.{ab}.weight"] = param_wrapper_factor(t, ab, E, r)
            # "block_sparse_moe.input_linear.weight": peft matches a suffix, and a shared expert's linear
            # (Granite's shared_mlp.input_linear) would match "input_linear.weight" too
            params.add(".".join(disk.split(".")[-3:]))
        else:  # per-expert modules: block b of A feeds row block b of B (see lora.LoRAMixin)
            for j in range(E):  # A [E, blocks*r, in] and B [E, blocks*out, r] both split along dim 1
                for pat, part in zip(disk, t[j].chunk(len(disk), dim=0)):
                    module = pat.format(j=j).removesuffix(".weight")
                    out[f"{prefix}{module}.{ab}.weight"] = part.contiguous()
                    # "experts.{j}.gate_proj", not "gate_proj": a dense layer's MLP and a shared expert
                    # (DeepSeek, Qwen2-MoE) have modules of that name too, which are not adapted
                    modules.add(".".join(module.split(".")[-3:]))
    for module, by_param in wrapped.items():  # nested ParamWrappers: the first parameter deepest
        names = sorted(by_param, key=order.index)
        for depth, param in enumerate(names):
            path = module + ".base_layer" * (len(names) - 1 - depth)
            for ab, t in by_param[param].items():
                out[f"{path}.{ab}.weight"] = t
    return out, {"target_modules": sorted(modules) or None, "target_parameters": sorted(params) or None,
                 "modules_to_save": saved or None}


def export_peft(adapter_or_run, out_dir, *, checkpoint: str | None = None, base_model: str | None = None) -> Path:
    """Write out_dir/adapter_config.json and adapter_model.safetensors (atomically) in peft's format.

    adapter_or_run: a model with LoRA, an adapter folder (adapter_config.json + adapter.safetensors)
    or a run folder (its `checkpoint`: "last" by default or "selected", as evaluate.py resolves it).
    base_model: written as base_model_name_or_path; default the adapter's own record.
    """
    config, tensors, method = _adapter_state(adapter_or_run, checkpoint)
    refuse_routing_heads(method, "export_peft")
    if rows := sorted(k for k in tensors if ".mlp.router.rows." in k):
        raise ValueError(f"export_peft: refused: the adapter trains expert weights in full ({rows[0]}, ESFT's "
                         "full form), which peft's LoRA cannot hold; export it merged (export.py --merged)")
    state, targets = peft_tensors(config, tensors)
    base_model = base_model or config.get("base_model")
    if not base_model:
        raise ValueError("export_peft: the base model is not recorded with this adapter; pass base_model= "
                         "(a hub id or checkpoint folder)")
    peft_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_model),
        "r": config["rank"], "lora_alpha": config["alpha"],
        "lora_dropout": 0.0 if targets["target_parameters"] else config["dropout"],
        **targets, "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "inference_mode": True,
    }
    out_dir = Path(out_dir)
    with atomic_directory(out_dir, "peft-adapter") as tmp:
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "adapter_model.safetensors"),
                  metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(peft_config, indent=2) + "\n", encoding="utf-8")
    return out_dir


def refuse_routing_heads(method: Method | None, what: str):
    """Raise if `method` routes in a way a plain MoE (or a peft adapter) cannot express."""
    if method is not None and method.not_exportable:
        raise ValueError(f"{what}: refused for method {method.name!r}: {method.not_exportable}, which changes the "
                         "routing function itself; the official architecture (and so peft, transformers and vLLM) "
                         "has no place for it. Evaluate or serve it with minimoe (evaluate.py, load_adapter)")


def export_merged(model: MoEForCausalLM, path, *, copy_files=()):
    """Save the merged base weights in the official layout, with `copy_files` (e.g. the base's
    tokenizer files) beside them; refused for a method that does not route natively (refuse_routing_heads).

    A merge keeps LoRA and tuned native gates but has no place for method heads, so such a model
    would silently route natively once reloaded. The model is left as it was: the unmerged
    weights are put back exactly, not by subtraction.
    """
    refuse_routing_heads(getattr(model, "router_method", None), "export_merged")
    originals = {}
    with torch.no_grad():
        for name, m in lora_modules(model).items():
            if not m.merged:
                originals[name] = m.weight.data
                m.weight.data = (m.weight.float() + m.delta_weight()).to(m.weight.dtype)
        for i, mlp in moe_blocks(model).items():  # a tuned gate trains in fp32 (routing.py): rounded once
            if mlp.gate.weight.dtype != model.dtype:
                originals[f"model.layers.{i}.mlp.gate"] = mlp.gate.weight.data
                mlp.gate.weight.data = mlp.gate.weight.data.to(model.dtype)
            merged = getattr(mlp.router, "merged_banks", None)  # a method's own expert rows (ESFT's full form)
            for bank, weight in (merged(mlp) if merged else {}).items():
                module = getattr(mlp.experts, bank)
                originals.setdefault(f"model.layers.{i}.mlp.experts.{bank}", module.weight.data)
                module.weight.data = weight
    try:
        with atomic_directory(path, "merged-model") as tmp:
            write_checkpoint(model, tmp)
            for file in map(Path, copy_files):
                shutil.copyfile(file, tmp / file.name)
    finally:
        for name, weight in originals.items():
            model.get_submodule(name).weight.data = weight


# The base's files that a merged checkpoint carries over, so that it loads alone (AutoTokenizer included).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def export_merged_adapter(adapter_or_run, out_dir, *, checkpoint: str | None = None, base_model: str | None = None,
                          cache_dir=None, allow_other_base: bool = False) -> Path:
    """Load the adapter's base model, apply the adapter and write the merged checkpoint (official layout,
    the base's dtype and tokenizer files) to out_dir, as `export.py RUN OUT --merged` does.

    A method that does not route natively is refused before anything loads (the module docstring says why).
    base_model: the base checkpoint to merge into; default the one the adapter records (a run's
    model at its --model-revision); load_adapter still checks that the weights are the trained-on ones,
    unless allow_other_base (export.py --allow-other-base).
    """
    source = resolve_adapter(adapter_or_run, checkpoint, flag=None)
    refuse_routing_heads(source.method, "export.py --merged")  # resolved once: load_adapter takes it
    config = json.loads((source.folder / "adapter_config.json").read_text(encoding="utf-8"))
    base = base_model or config.get("base_model")
    if not base:
        raise ValueError(f"{source.folder}: the base model is not recorded with this adapter; pass --model "
                         f"(export.py) or base_model=")
    revision = source.run_config.get("model_revision") if base == source.run_config.get("model") else None
    folder = resolve_checkpoint(base, cache_dir or source.run_config.get("cache_dir"), revision)
    quantize = source.run_config.get("quantize")  # a QLoRA run merges into its dequantised base (core/adaptation/quantized.py)
    model = load_adapter(from_pretrained(folder, quantize=quantize), source.folder, allow_other_base=allow_other_base,
                         method=source.method)
    if quantize:  # after load_adapter, whose base digest is of the weights as loaded, not as dequantised
        dequantize_model(model)
    tokenizer = [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]
    export_merged(model, out_dir, copy_files=tokenizer)
    return Path(out_dir)
