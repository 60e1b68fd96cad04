"""config.json <-> MoEConfig: a family's config.json (as transformers 4 or 5 writes it) read through its record
(core/decoder/families.py: `renames`, `config_fields`, `fixed`, `defaults`), checked, and written back as the
family's transformers config writes it. A missing required field or an unknown model_type is an error naming it.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

from minimoe.core.decoder.family_record import CONFIG_FIELDS, FAMILIES, family_of
from minimoe.core.decoder.model_config import MoEConfig, config_field_names
from minimoe.loading.config_keys import from_transformers5, refuse_unread

QUANTIZED_ON_DISK = ("mxfp4",)  # quantization_config.quant_method values we dequantise on load
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads", "num_experts", "num_experts_per_tok")


def config_from_dict(d: dict, source: str = "config.json") -> MoEConfig:
    d = text_model_config(d, source)  # the text model of a multimodal release; its other towers are not loaded
    family = family_of(d.get("model_type"), source)
    # rope_parameters, dtype, ...: the names 4.57 wrote; the family's own name for its text model's model_type
    d = {**from_transformers5(d, family, source), "model_type": family.model_type}
    d = {k: v for k, v in d.items() if k not in family.harmless}  # not ours to read (MLA's head_dim)
    d = renamed(d, family, source)
    d = {k: v for k, v in d.items() if not (v is None and k in family.null_defaults)}  # the default, below
    d = {**family_defaults(family, d, source), **d}
    refuse_unread(d, family, source)  # a key we do not read, set to change the model
    if family.layer_kinds:  # a hybrid: each layer's kind in config.json -> its token mixer (core/token_mixers/mixers.py)
        kinds = d.get("mixer_types")
        if not isinstance(kinds, list) or not set(kinds) <= set(family.layer_kinds):
            raise ValueError(f"{source}: layer_types {kinds!r}; expected a list of {sorted(family.layer_kinds)}, "
                             f"one per layer, for model_type {family.model_type!r}")
        d["mixer_types"] = [family.layer_kinds[k] for k in kinds]
    d.setdefault("num_key_value_heads", d.get("num_attention_heads"))
    missing = [f for f in REQUIRED_FIELDS if d.get(f) is None]
    if missing:
        raise ValueError(f"{source}: missing field(s) {missing} for model_type {family.model_type!r}")
    quant = (d.get("quantization_config") or {}).get("quant_method")
    if quant is not None:  # dequantised on load and saved dense: the saved config.json says no quantization
        if quant not in QUANTIZED_ON_DISK:
            raise ValueError(f"{source}: quantization_config quant_method {quant!r} is not supported; expected "
                             f"one of {QUANTIZED_ON_DISK} (dequantised on load) or none")
        d = {k: v for k, v in d.items() if k != "quantization_config"}
    ours = set(config_field_names()) - set(family.fixed)  # a fixed field is the family's, whatever the file says
    known = {k: v for k, v in d.items() if k in ours}
    extra = {k: v for k, v in d.items() if k not in ours}
    return MoEConfig.from_flat({**known, "extra": extra})  # each mixer's options to its own config


def family_defaults(family, d: dict, source: str) -> dict:
    """The record's defaults for fields config.json may omit; a default computed from another field (DeepSeek-V4's
    layer schedule from num_hidden_layers) that the file lacks too is refused naming that field."""
    out = {}
    for name, default in family.defaults.items():
        try:
            out[name] = default(d) if callable(default) else copy.deepcopy(default)
        except KeyError as e:
            raise ValueError(f"{source}: missing field {e.args[0]!r} for model_type {family.model_type!r} (the default "
                             f"of {name!r} is computed from it)") from None
    return out


def text_model_config(d: dict, source: str) -> dict:
    """A multimodal release's config.json (a model_type of some family's `containers`: the released Qwen3.5s,
    Gemma 4s and Mistral Small 4, the text model's fields under text_config) -> the text model's, as transformers'
    ForCausalLM reads that file; its other towers are not ours. A text_config of another model (one naming none is
    the model its wrapper's config assumes: Mistral3Config's dense Mistral), or a tie_word_embeddings that
    disagrees with it, is refused by name; the wrapper's dtype serves a text config that gives none. Any other
    config.json is returned as it is."""
    family = next((f for f in FAMILIES.values() if d.get("model_type") in f.containers), None)
    if family is None or not isinstance(d.get("text_config"), dict):
        return d
    text, expected = dict(d["text_config"]), family.text_model_type or family.model_type
    if text.setdefault("model_type", family.containers[d["model_type"]]) != expected:
        said = "" if "model_type" in d["text_config"] else " (it names none: its transformers config's default)"
        raise ValueError(f"{source}: text_config's model_type {text['model_type']!r}{said}; minimoe holds a "
                         f"{d['model_type']} config.json whose text model is {expected!r} only")
    tie = d.get("tie_word_embeddings")
    if tie is not None and text.setdefault("tie_word_embeddings", tie) != tie:
        raise ValueError(f"{source}: tie_word_embeddings {tie!r} and text_config's {text['tie_word_embeddings']!r} "
                         f"disagree (transformers 5 ties by the outer one unless the checkpoint's lm_head.weight "
                         f"differs from the embedding): set both false if the checkpoint stores lm_head.weight, "
                         f"true if it does not")
    for key in ("dtype", "torch_dtype"):
        if key in d and "dtype" not in text and "torch_dtype" not in text:
            text[key] = d[key]
    return text


def renamed(d: dict, family, source: str) -> dict:
    """config.json's fields under our names (`family.renames`). Two keys that become one field (Nemotron-H's n_groups
    and its older mamba_n_groups) must agree: which one transformers' config takes is its own rule, not ours."""
    out, came_from = {}, {}
    for k, v in d.items():
        name = family.renames.get(k, k)
        if name in out and out[name] != v:
            raise ValueError(f"{source}: {came_from[name]} = {out[name]!r} and {k} = {v!r} disagree; both give "
                             f"{name}: keep one")
        out[name], came_from[name] = v, k
    return out


def config_to_dict(config: MoEConfig) -> dict:
    """config.json as the family's transformers config writes it: the shared fields, the family's own
    (`Family.config_fields`) under its names, and whatever unknown fields were read."""
    family = family_of(config.model_type)
    written = CONFIG_FIELDS | family.config_fields
    back = {v: k for k, v in family.renames.items()}
    # A field left None that the family's transformers config cannot read as null (Family.never_null: Llama 4's
    # no_rope_layer_interval, in a config built here rather than read) is left out: transformers fills in its
    # default. Elsewhere None is written, as it can mean something (DeepSeek-V2-Lite's q_lora_rank: no q LoRA).
    flat = config.flat()  # a mixer's options where the model holds that mixer
    d = {**config.extra, **{back.get(k, k): flat[k] for k in config_field_names() if k in written and k in flat
                            and not (flat[k] is None and k in family.never_null)}}
    if "rope_parameters" in family.config_fields:  # a rope per layer type (Gemma 4) replaces the one-rope names
        d = {k: v for k, v in d.items() if k not in ("rope_theta", "rope_scaling")}
    d["architectures"] = [family.architecture]
    d["model_type"] = family.text_model_type or family.model_type  # what its transformers config class reads
    if family.layer_kinds:  # each layer's token mixer -> config.json's name for its kind
        back_kinds = {v: k for k, v in family.layer_kinds.items()}
        d[back.get("mixer_types", "layer_types")] = [back_kinds[m] for m in config.mixer_types]
    for name, default in family.write_defaults.items():  # None, which the family's config would fill in otherwise
        if d.get(back.get(name, name)) is None:
            d[back.get(name, name)] = default(config)
    return d


def read_config(folder: Path) -> MoEConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no config.json; a checkpoint folder needs config.json and safetensors")
    try:
        with open(path) as f:
            d = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e}); the file is truncated or corrupt: restore or "
                         f"re-download the checkpoint") from None
    return config_from_dict(d, str(path))
