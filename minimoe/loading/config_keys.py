"""config.json's keys: transformers 5's names read as transformers 4's, and the keys a family does not read.

transformers 5 writes config.json otherwise than 4.57 for the same model: `rope_parameters` holds rope_theta,
the scaling type and its fields and partial_rotary_factor (one dict, or one per layer type); `dtype` is
`torch_dtype` (a family whose rope differs per layer type reads rope_parameters itself: Gemma 4); Qwen3-MoE's expert count is `num_local_experts`; the hybrids' layer kinds are
`linear_attention` / `full_attention` where 4.57 wrote `mamba` / `attention`. `from_transformers5` rewrites
those into the 4.57 names the family records read (and we keep writing: transformers 5 reads them).

A key that would change the model and that no record field reads is refused by name, never silently
defaulted (`refuse_unread`): each record's `unread` (and `UNREAD` for every family) gives such a key the
one value our model runs with; `HARMLESS` lists the keys that change nothing we compute (bookkeeping,
generation settings, the MTP head we do not load; a record's `harmless` adds its own). A key in neither passes through into `MoEConfig.extra`
and is written back: tests/loading/test_config_keys.py holds every key that transformers' config class of
each family writes to be read, held or harmless, so a model-changing key cannot reach that path unnoticed.
"""
from __future__ import annotations

import math

# Keys of transformers' PretrainedConfig that change nothing our model computes.
HARMLESS = frozenset({
    "architectures", "transformers_version", "_name_or_path", "use_cache", "output_router_logits",
    "output_attentions", "output_hidden_states", "return_dict", "id2label", "label2id", "problem_type",
    "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "add_cross_attention",
    "cross_attention_hidden_size", "tie_encoder_decoder", "torchscript", "use_bfloat16", "tf_legacy_loss",
    "pruned_heads", "finetuning_task", "prefix", "tokenizer_class", "task_specific_params", "sep_token_id",
    "decoder_start_token_id", "auto_map", "_attn_implementation", "initializer_factor",
    # generation settings of transformers 4.x's configs (generation_config.json's since)
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    # tensor-parallel slicing of old Llama checkpoints: transformers' modeling files no longer read it
    "pretraining_tp",
    # DeepSeek and GLM: the multi-token-prediction layers, which the causal LM does not load
    "num_nextn_predict_layers",
    # DeepSeek-V2's remote-code auxiliary loss settings (--aux-coef is ours)
    "aux_loss_alpha", "seq_aux",
})

# Keys every family's transformers config may hold that no record reads: the value our model runs with.
# attention_dropout and router_jitter_noise act in training only, but training is what minimoe does.
UNREAD = {"attention_dropout": 0.0, "router_jitter_noise": 0.0, "mlp_bias": False}

# transformers 5's layer kinds for what 4.57 named otherwise (its configuration_utils' legacy remap, reversed).
LAYER_KINDS_4 = {"linear_attention": "mamba", "full_attention": "attention"}


def from_transformers5(d: dict, family, source: str) -> dict:
    """config.json `d` with transformers 5's names rewritten to the 4.57 names `family` reads."""
    d = dict(d)
    if d.get("rope_parameters", {}) is None:  # a config without rope (Kimi Linear's, Nemotron-H's) writes null
        del d["rope_parameters"]
    reads_ropes = "rope_parameters" in family.config_fields or "rope_parameters" in family.unread  # Gemma 4, V4
    if "rope_parameters" in d and not reads_ropes:  # a family that reads its per-type ropes itself keeps them
        d.update(rope_fields(d.pop("rope_parameters"), d, source))
    if "dtype" in d:
        dtype = d.pop("dtype")
        if d.setdefault("torch_dtype", dtype) != dtype:
            raise ValueError(f"{source}: dtype {dtype!r} and torch_dtype {d['torch_dtype']!r} disagree")
    if "num_local_experts" in d and "num_local_experts" not in family.renames:  # Qwen3-MoE in transformers 5
        n = d.pop("num_local_experts")
        if d.setdefault("num_experts", n) != n:
            raise ValueError(f"{source}: num_local_experts {n} and num_experts {d['num_experts']} disagree")
    if d.get("sliding_window") == 0 and not d.get("use_sliding_window"):  # transformers 5's Qwen2-MoE: no window
        d["sliding_window"] = None
    kinds = d.get("layer_types")
    if family.layer_kinds and isinstance(kinds, list):
        d["layer_types"] = [k if k in family.layer_kinds else LAYER_KINDS_4.get(k, k) for k in kinds]
    return d


def rope_fields(rope: dict, d: dict, source: str) -> dict:
    """transformers 5's rope_parameters -> rope_theta, partial_rotary_factor and rope_scaling (None: plain rope).
    A dict per layer type is one rope when every layer type's is the same; our model has no per-layer rope."""
    if not isinstance(rope, dict):
        raise ValueError(f"{source}: rope_parameters {rope!r}; expected a dict")
    per_type = [v for v in rope.values() if isinstance(v, dict)]
    if per_type:
        if len(per_type) != len(rope) or any(v != per_type[0] for v in per_type):
            raise ValueError(f"{source}: rope_parameters differ between layer types ({sorted(rope)}); minimoe runs one "
                             f"rope for every layer")
        rope = per_type[0]
    scaling = dict(rope)
    out = {"rope_theta": scaling.pop("rope_theta", d.get("rope_theta", 10000.0))}
    if "partial_rotary_factor" in scaling:
        out["partial_rotary_factor"] = scaling.pop("partial_rotary_factor")
    for name in out:
        if name in d and d[name] != out[name]:
            raise ValueError(f"{source}: {name} {d[name]!r} and rope_parameters' {out[name]!r} disagree")
    plain = scaling.get("rope_type", scaling.get("type", "default")) == "default" and set(scaling) <= {"rope_type", "type"}
    out["rope_scaling"] = None if plain else scaling
    if "rope_scaling" in d and d["rope_scaling"] not in (None, out["rope_scaling"]):
        raise ValueError(f"{source}: rope_scaling {d['rope_scaling']!r} and rope_parameters {rope!r} disagree")
    return out


def same(value, expected) -> bool:
    """config.json's value equals what the model runs with; infinity as JSON cannot write it (transformers 5
    writes {"__float__": "Infinity"}), lists and tuples alike."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        value = float(value["__float__"])
    if isinstance(value, (list, tuple)) and isinstance(expected, (list, tuple)):
        return len(value) == len(expected) and all(same(v, e) for v, e in zip(value, expected))
    if isinstance(value, float) and isinstance(expected, float) and math.isinf(expected):
        return value == expected
    return value == expected


def refuse_unread(d: dict, family, source: str) -> None:
    """Refuse, by name, a key of `d` (config.json read into our names, defaults filled in) that would change the model and that `family`
    does not read: a held key (`UNREAD`, `family.unread`) with another value. A `fixed` field is not one: the
    family's modeling file hard-codes it whatever config.json says, in transformers as here."""
    held = {**UNREAD, **family.unread}
    d = {**family.unread_defaults, **d}  # a key left out is transformers' default (Family.unread_defaults)
    for key, expected in held.items():
        if d.get(key) is None:
            continue
        expected = expected(d) if callable(expected) else expected
        if not same(d[key], expected):
            raise ValueError(f"{source}: {key} = {d[key]!r}, but minimoe's {family.model_type} runs with {expected!r} "
                             f"only (it does not read {key}): a model with this value is not supported")
