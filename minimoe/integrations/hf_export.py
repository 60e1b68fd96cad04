"""Export what was trained: in peft's format, for peft + transformers (and the servers that read it), or
merged into its base, as a plain checkpoint.

`export_peft(adapter_or_run, out_dir)` writes `adapter_config.json` and `adapter_model.safetensors`
such that `peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out_dir)`
gives minimoe's logits with the adapter (on transformers 4.57: tests/core/decoder/test_families_parity.py for every
family it holds, tests/integrations/test_hf_export.py for each exportable method; on 5.23: test_hf_export.py for
every family). Our names map onto the checkpoint's
through the family's `layer_keys` (core/decoder/families.py), the one name table, for the modules of the
transformers that will load it (`transformers`: 4 for 4.57's, the default for the families it holds; 5 for 5.x's,
the default for the others; export.py --transformers). The two hold routed experts differently, and an adapter
written for one loads wrong on the other: on 4.57, a 5 export's expert targets match nothing (peft warns, the
experts run unadapted); on 5.23, peft 0.21.2 converts a 4.57 export itself for the families whose conversion it
knows (OLMoE, Qwen3-MoE, Mixtral, DeepSeek: measured exact) and gives wrong logits without an error for others
(Granite's three, Qwen2-MoE: measured; gpt-oss: a shape error).
- Attention LoRA keeps its modules and shapes: `q_proj.lora_A [r, D]`, `lora_B [out, r]`.
- Granite's fused expert banks are 3-D parameters in transformers 4.57 (`input_linear.weight [E, 2I, D]`,
  `output_linear.weight`), so they go through peft's `target_parameters` (its ParamWrapper), which
  stores A as [E*r, in] with the expert index slowest and B as [out, r*E] with the expert index
  fastest: A = ours.reshape(E*r, in), B = ours.permute(1, 2, 0).reshape(out, r*E).
- A bank stored in another layout (a `Converted` entry of the record: gpt-oss's and Llama 4's x @ W,
  `gate_up_proj [E, D, 2I]`, `down_proj [E, I, D]`) is adapted by peft's ParamWrapper as W[e] += B_e A_e
  with W[e] taken as [out', in'] = its two last dims. Each such layout reorders our [out, in] rows, then
  transposes (`Layout.to_disk`), so our delta B A stored is A^T to_disk(B): peft's B_e is our A_e^T and
  its A_e is to_disk(our B_e) (gate_up's columns interleaved as the checkpoint's, where they are). The
  banks are parameters of one module (`mlp.experts`), which peft wraps once per parameter in the module's
  parameter order: the first one's keys sit under one `base_layer.` per later wrapper.
- The other families keep per-expert modules on transformers 4.57 (OLMoE's, say): our fused gate_up pair splits into rank-r
  LoRAs on `experts.{j}.gate_proj` (A rows [0, r), B rows [0, I)) and `up_proj` (the rest), and
  down_proj's pair into `experts.{j}.down_proj`.
- transformers 5 holds every family's routed experts as 3-D parameters of one `experts` module beside the router
  (`mlp.experts.gate_up_proj [E, 2I, D]` gate rows first, `down_proj [E, D, I]`; Nemotron-H's `up_proj`), named as
  our banks are, so all go through `target_parameters`. peft's ParamWrapper gives each expert its own A_e [r, in]
  and B_e [out, r] at one shared scale alpha/r, as ours: exact, no merge needed. Where 4.57 kept gate and up apart
  (our two rank-r LoRAs on one bank), transformers 5 fuses them, and so do we: one rank-2r LoRA, A_e = our
  [A_gate; A_up] (already so stacked), B_e = [[B_gate, 0], [0, B_up]], with `rank_pattern` 2r and `alpha_pattern`
  2 alpha for `experts.gate_up_proj` (alpha/r kept; peft 0.21.2 warns that the patterns "did not match any
  targeted module": its check looks at modules, not parameters, and the rank is applied, as the test shows).
  gpt-oss's bank is [E, in, out] with `is_transposed` set on its module (Family.experts_transposed_in_5), which peft reads: its
  A_e is ours and its B_e is to_disk(ours); Llama 4's is [E, in, out] without it, read as on 4.57. Modules that
  transformers 5 renames on load (Family.modules_in_5: Mixtral's, MiniMax-M2's and Kimi Linear's `block_sparse_moe.`
  is its `mlp.`, Granite's `router.layer` its `router`, DeepSeek-V4's release names its own) are written under its
  names, and a linear's target names its parent too (`self_attn.q_b_proj`: DeepSeek-V4's compressor holds another).
- Native gates tuned by "+ affinity tuning" go to `modules_to_save` under their full module path,
  so that only the tuned layers are replaced.
- peft refuses LoRA on a Mamba model's `out_proj` (Nemotron-H's `mamba_out` target; not Granite 4.0-H, whose model
  type its check does not list): refused here by name, before anything is written.
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
from minimoe.core.adaptation.packed_embedding import pack_embedding
from minimoe.core.adaptation.quantized import dequantize_model
from minimoe.core.decoder.family_record import Converted, family_of
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
        tensors = {**adapter_tensors(model, gates), **gate_companions(model, gates)}
        return config, {k: v.detach().cpu() for k, v in tensors.items()}, model.router_method
    source = resolve_adapter(adapter_or_run, checkpoint, flag=None)
    config = json.loads((source.folder / "adapter_config.json").read_text(encoding="utf-8"))
    return config, load_file(str(source.folder / "adapter.safetensors")), source.method


def gate_companions(model: MoEForCausalLM, gates) -> dict[str, torch.Tensor]:
    """The frozen tensors beside each tuned gate's weight in its module (gpt-oss's router bias, DeepSeek-V3's
    selection bias): peft's modules_to_save copies the whole module, so its adapter must hold them too."""
    state = model.state_dict()
    return {k: v for i in gates for k, v in state.items()
            if k.startswith(f"model.layers.{i}.mlp.gate.") and not k.endswith(".weight")}


def gate_module_tensors(family) -> list[str]:
    """Our names of the frozen tensors that transformers holds in the same module as the gate's weight, from the
    record: a router bias (gpt-oss) and DeepSeek-V3's selection bias (noaux_tc with a correction bias), where the
    checkpoint keeps it beside the weight (LFM2's and MiniMax-M2's live on the MoE block: peft saves the gate alone)."""
    record = family_of(family)
    fixed, table = record.fixed, record.layer_keys
    held = ["mlp.gate.bias"] * bool(fixed.get("router_bias")) + ["mlp.gate.e_score_correction_bias"] * bool(
        fixed.get("topk_method") == "noaux_tc" and fixed.get("correction_bias", True))
    module = table.get("mlp.gate.weight", "mlp.gate.weight").rpartition(".")[0]
    return [n for n in held if table.get(n, n).rpartition(".")[0] == module]


def param_wrapper_factor(t, ab: str, E: int, r: int):
    """Our grouped LoRA factor of an [E, out, in] bank -> peft's ParamWrapper's: A [E, r, in] -> [E*r, in], the
    expert slowest; B [E, out, r] -> [out, r*E], the expert fastest."""
    return t.reshape(E * r, t.shape[-1]) if ab == "lora_A" else t.permute(1, 2, 0).reshape(t.shape[1], r * E)


def block_diagonal(B, blocks: int):
    """B [E, out, r] whose row block b pairs with A's row block b -> [E, out, blocks*r], block b in columns b*r..:
    our `blocks` LoRAs of rank r as one of rank blocks*r (zeros elsewhere), the same product with A [E, blocks*r, in]."""
    E, out, r = B.shape
    wide = B.new_zeros(E, out, blocks * r)
    for b, rows in enumerate(B.chunk(blocks, dim=1)):
        wide[:, b * rows.shape[1]:(b + 1) * rows.shape[1], b * r:(b + 1) * r] = rows
    return wide


def converted_factor(disk: Converted, t, ab: str, E: int, r: int, transposed: bool) -> tuple[str, object]:
    """Our factor of a bank stored as x @ W ([E, in', out'], the record's `Converted` layout) -> (peft's name
    for it, its ParamWrapper factor). peft reads such a bank as [E, out, in] unless its module says
    `is_transposed` (transformers 5's gpt-oss): then A is ours and B is to_disk(ours) (its rows in the
    checkpoint's order); else it adapts the transpose: its B_e = our A_e^T, its A_e = to_disk(our B_e)."""
    if transposed:
        return ab, t.reshape(E * r, t.shape[-1]) if ab == "lora_A" else \
            layout_of(disk).to_disk(t).permute(2, 1, 0).reshape(t.shape[1], r * E)
    if ab == "lora_A":  # ours [E, r, in] -> peft's B [out', r*E] (out' = our in), expert fastest
        return "lora_B", t.permute(2, 1, 0).reshape(t.shape[-1], r * E)
    return "lora_A", layout_of(disk).to_disk(t).reshape(E * r, t.shape[1])  # [E, r, in'] -> [E*r, in']


def experts_module(family, disk) -> str:
    """The module (within a layer) that holds the routed experts as 3-D parameters in transformers 5, from the
    checkpoint key of one of its banks: the MoE block's experts ("mlp.experts"; Gemma 4's "experts"), renamed
    where transformers 5 renames the checkpoint's modules (Family.modules_in_5)."""
    key = disk.key if isinstance(disk, Converted) else disk if isinstance(disk, str) else disk[0]
    moe, found, _ = f".{key}".partition(".experts.")  # ".mlp" of "mlp.experts.{j}.gate_proj.weight"
    if not found:  # Granite's "block_sparse_moe.input_linear.weight": the block is the bank's parent
        moe = "." + key.rsplit(".", 2)[0]
    return in_transformers_5(family, f"{moe}.experts".lstrip("."))


def in_transformers_5(family, path: str) -> str:
    """A module path within a layer as the checkpoint names it -> as transformers 5's model does."""
    dotted = f"{path}."
    for old, new in family_of(family).modules_in_5.items():
        if dotted.startswith(old):
            return (new + dotted[len(old):]).removesuffix(".")
    return path


def peft_tensors(config: dict, tensors: dict[str, torch.Tensor], transformers: int = 4) -> tuple[dict, dict]:
    """Our adapter tensors -> (peft's state dict, the targets for its config) for `transformers`' (4 or 5)
    modules (module docstring); unknown keys raise."""
    fp, five = config["fingerprint"], transformers == 5
    family = fp["model_type"]
    rename = (lambda path: in_transformers_5(family, path)) if five else (lambda path: path)
    table, E, r = family_of(family).layer_keys, fp["num_experts"], config["rank"]
    out, modules, params, saved, ranks = {}, set(), set(), [], {}
    wrapped = {}  # peft module path -> {parameter name: {"lora_A"/"lora_B": tensor}} (banks of one module)
    # the banks' order in their module (the order peft nests their wrappers in)
    order = [k.removesuffix(".weight").rpartition(".")[2] for k in table if k.startswith("mlp.experts.")]
    for key in sorted(tensors):
        t = tensors[key]
        layer, _, name = key.partition(".layers.")[2].partition(".")
        prefix = f"{PREFIX}model.layers.{layer}."
        if name.startswith("mlp.gate.") and name != "mlp.gate.weight" and name not in gate_module_tensors(family):
            continue  # a gate companion that transformers keeps on another module (LFM2's expert_bias): not saved
        if name.startswith("mlp.gate."):  # a tuned native gate, and the frozen tensors of its module
            disk = table.get(name, name)
            module = rename(disk.rpartition(".")[0])
            out[f"{prefix}{module}.{disk.rpartition('.')[2]}"] = t
            if name == "mlp.gate.weight":
                saved.append(f"model.layers.{layer}.{module}")
                if missing := [n for n in gate_module_tensors(family) if f"{key[:-len(name)]}{n}" not in tensors]:
                    raise ValueError(f"export_peft: refused: peft saves {module} whole (modules_to_save), and this "
                                     f"adapter holds its tuned weight without {missing[0]}, which an adapter folder "
                                     "does not carry; export the loaded model (export_peft(model, ...)) or merged "
                                     "(export.py --merged)")
            continue
        if ".mlp.router." in key:  # state of a method that routes natively (export_peft refuses the others):
            continue  # read in training only (ESFT's choice of experts), no part of the forward
        if not key.endswith((".lora_A", ".lora_B")):
            raise KeyError(f"export_peft: tensor {key!r} has no peft counterpart; expected LoRA tensors and "
                           "tuned native gates only")
        base, _, ab = name.rpartition(".")  # e.g. "mlp.experts.gate_up_proj", "lora_A"
        disk = table.get(f"{base}.weight", f"{base}.weight")
        if base.startswith("mlp.experts.") and five:  # a bank: a 3-D parameter of the experts module, named as ours
            module, param = experts_module(family, disk), base.rpartition(".")[2]
            if isinstance(disk, Converted):
                ab, t = converted_factor(disk, t, ab, E, r, transposed=family_of(family).experts_transposed_in_5)
            else:  # [E, out, in] as ours; gate and up stored apart on disk: our two LoRAs as one of rank 2r
                blocks = len(disk) if isinstance(disk, tuple) else 1
                t = param_wrapper_factor(t if ab == "lora_A" else block_diagonal(t, blocks), ab, E, blocks * r)
                if blocks > 1:  # peft's rank and alpha for this parameter: alpha/r's scale kept
                    ranks[f"{module.rpartition('.')[2]}.{param}"] = blocks
            wrapped.setdefault(prefix + module, {}).setdefault(param, {})[ab] = t
            params.add(f"{module.rpartition('.')[2]}.{param}")  # "experts.gate_up_proj"
        elif isinstance(disk, Converted):  # transformers 4.57's gpt-oss and Llama 4 banks, stored as x @ W
            module, _, param = disk.key.rpartition(".")
            ab, t = converted_factor(disk, t, ab, E, r, transposed=False)
            wrapped.setdefault(prefix + module, {}).setdefault(param, {})[ab] = t
            params.add(f"{module.rpartition('.')[2]}.{param}")  # "experts.gate_up_proj"
        elif isinstance(disk, str) and t.dim() == 2:  # a linear layer: same module, same shapes
            module = rename(disk.removesuffix(".weight"))
            out[f"{prefix}{module}.{ab}.weight"] = t
            # peft matches a suffix: for 5, with its parent ("self_attn.q_b_proj"), as DeepSeek-V4's compressor
            # and indexer hold modules of the same name (q_b_proj, kv_proj), which are not adapted
            modules.add(".".join(module.split(".")[-2:]) if five else module.rpartition(".")[2])
        elif isinstance(disk, str) and disk.endswith(".weight"):  # Granite's fused [E, out, in] bank in 4.57
            module = disk.removesuffix(".weight")
            out[f"{prefix}{module}.{ab}.weight"] = param_wrapper_factor(t, ab, E, r)
            # "block_sparse_moe.input_linear.weight": peft matches a suffix, and a shared expert's linear
            # (Granite's shared_mlp.input_linear) would match "input_linear.weight" too
            params.add(".".join(disk.split(".")[-3:]))
        elif isinstance(disk, str):  # a bank that transformers 4.57 does not hold (refused before: export_peft)
            raise ValueError(f"export_peft: {family}'s {base} ({disk}) is a transformers 5 bank; export for 5")
        else:  # per-expert modules (4.57): block b of A feeds row block b of B (see lora.LoRAMixin)
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
                 "modules_to_save": saved or None, "rank_pattern": {k: n * r for k, n in ranks.items()},
                 "alpha_pattern": {k: n * config["alpha"] for k, n in ranks.items()}}


def export_peft(adapter_or_run, out_dir, *, checkpoint: str | None = None, base_model: str | None = None,
                transformers: int | None = None) -> Path:
    """Write out_dir/adapter_config.json and adapter_model.safetensors (atomically) in peft's format.

    adapter_or_run: a model with LoRA, an adapter folder (adapter_config.json + adapter.safetensors)
    or a run folder (its `checkpoint`: "last" by default or "selected", as evaluate.py resolves it).
    base_model: written as base_model_name_or_path; default the adapter's own record.
    transformers: the major version of the transformers that will load it, 4 (4.57's modules) or 5 (5.x's fused
    experts); default the oldest that holds the family (Family.since_transformers).
    """
    config, tensors, method = _adapter_state(adapter_or_run, checkpoint)
    family = config["fingerprint"]["model_type"]
    transformers = transformers or family_of(family).since_transformers
    if transformers not in (4, 5):
        raise ValueError(f"export_peft: transformers={transformers!r}; expected 4 or 5 (its major version)")
    if transformers < family_of(family).since_transformers:
        raise ValueError(f"export_peft: transformers 4.57 does not hold {family}; export it for transformers 5 "
                         "(transformers=5, export.py --transformers 5)")
    refuse_routing_heads(method, "export_peft")
    if family_of(family).peft_refuses_mamba_out and (outs := sorted(k for k in tensors if ".out_proj.lora_" in k)):
        raise ValueError(f"export_peft: refused: peft refuses LoRA on {family}'s Mamba out_proj ({outs[0]}); train "
                         "without the mamba_out target, or export it merged (export.py --merged)")
    if rows := sorted(k for k in tensors if ".mlp.router.rows." in k):
        raise ValueError(f"export_peft: refused: the adapter trains expert weights in full ({rows[0]}, ESFT's "
                         "full form), which peft's LoRA cannot hold; export it merged (export.py --merged)")
    state, targets = peft_tensors(config, tensors, transformers)
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
    if source.run_config.get("quantize_embedding"):  # its table as trained on: torchao's dequantisation of it
        pack_embedding(model)
    if quantize:  # after load_adapter, whose base digest is of the weights as loaded, not as dequantised
        dequantize_model(model)
    tokenizer = [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]
    export_merged(model, out_dir, copy_files=tokenizer)
    return Path(out_dir)
