"""Each family's `defaults` (core/decoder/families.py) against transformers 4.57's own config classes: a config.json
holding only the fields minimoe requires resolves, field by field, to what transformers' config of that
model_type gives every field the file omits; and its `write_defaults`, what we write for a field left None. Every test and tiny checkpoint sets each field, so a wrong
default (DeepSeek-V3's routed_scaling_factor 2.5, OLMoE's rms_norm_eps 1e-5, ...) showed nowhere else."""
import pytest

from tests.conftest import TRANSFORMERS_5_ONLY, by_oracle, oracle, tiny_config
from minimoe.core.decoder.family_record import FAMILIES
from minimoe.loading.config_json import REQUIRED_FIELDS, config_from_dict, config_to_dict
from minimoe.loading.config_keys import rope_fields

# The fields minimoe requires (loading/checkpoint.py), at widths every family's defaults accept: 128 heads
# divide 1024 and are a multiple of every default num_key_value_heads; 64 experts in DeepSeek-V3's 8 groups;
# 4 layers past its 3 dense ones.
REQUIRED = dict(vocab_size=128, hidden_size=1024, intermediate_size=32, num_hidden_layers=4, num_attention_heads=128,
                num_experts=64, num_experts_per_tok=2)

# Fields a family needs beyond REQUIRED: transformers' config leaves them None, which its model cannot run
# (LFM2's layer_types: Lfm2MoeDecoderLayer indexes the list), and minimoe refuses by name.
NEEDED = {"lfm2_moe": {"layer_types": ["conv", "full_attention"] * 2}}

# Where transformers' value differs from ours in form, not in what the model computes.
SAME_MEANING = {
    ("mixtral", "head_dim"): "None: hidden_size / heads, the value MoEConfig fills in",
    ("deepseek_v2", "head_dim"): "MLA reads qk_nope_head_dim, qk_rope_head_dim and v_head_dim, never head_dim",
    ("deepseek_v3", "head_dim"): "MLA reads qk_nope_head_dim, qk_rope_head_dim and v_head_dim, never head_dim",
    ("glm4_moe_lite", "head_dim"): "MLA reads qk_nope_head_dim, qk_rope_head_dim and v_head_dim, never head_dim",
    ("glm4_moe_lite", "num_key_value_heads"): "MLA gives every head its own key and value (kv_b_proj): not read",
    ("kimi_linear", "head_dim"): "KimiLinearConfig's head_dim is qk_rope_head_dim, which MLA reads as its own",
    ("mistral4", "head_dim"): "MLA reads qk_nope_head_dim, qk_rope_head_dim and v_head_dim, never head_dim",
    ("mistral4", "partial_rotary_factor"): "MLA turns its qk_rope_head_dim rope dims, the factor's share of n + r",
    ("deepseek_v32", "head_dim"): "MLA reads qk_nope_head_dim, qk_rope_head_dim and v_head_dim, never head_dim",
    ("deepseek_v32", "layer_types"): "'indexed_attention' in every layer picks transformers' cache classes only; "
                                     "ours None: every layer MLA with its indexer",
    ("glm_moe_dsa", "head_dim"): "MLA reads qk_nope_head_dim, qk_rope_head_dim and v_head_dim, never head_dim",
    ("glm_moe_dsa", "layer_types"): "'indexed_attention' in every layer picks transformers' cache classes only",
    ("glm_moe_dsa", "num_key_value_heads"): "MLA gives every head its own key and value (kv_b_proj): not read",
    ("deepseek_v2", "n_group"): "None with greedy top-K: no groups; ours 1 group of every expert, the same selection",
    ("deepseek_v2", "topk_group"): "None with greedy top-K: no groups; ours 1 group kept, the same selection",
    ("granitemoehybrid", "mixer_types"): "None in transformers 4.57's config: its layers_block_type property, which "
                                         "falls back to every layer Mamba, is shadowed by its attribute_map; ours is "
                                         "that fallback",
    ("qwen3_5_moe", "model_type"): "the family's name; config.json gets its text_model_type, this one",
    ("llama4_text", "moe_layers"): "None: every decoder_sparse_step-th layer (i + 1) % step == 0, the list "
                                    "transformers fills in (range(step - 1, layers, step))",
    ("nemotron_h", "layer_types"): "NemotronHConfig's layer_types is its layers_block_type (attribute_map), our "
                                   "mixer_types; ours, None, is every attention layer full, as its causal mask",
    ("nemotron_h", "n_shared_experts"): "never read by its modeling file (the shared expert is "
                                        "moe_shared_expert_intermediate_size wide): ours 0 leaves that width alone",
    ("gemma4_text", "rope_scaling"): "transformers 5's alias of rope_parameters, which ours holds per layer type "
                                     "(compared as rope_parameters); our rope_scaling is not read then",
    ("mimo_v2_flash", "rope_scaling"): "transformers 5's alias of rope_parameters, held per layer type as Gemma 4's",
}

# What a config.json of the family's MoE must say where transformers' defaults build another model (refused by name
# otherwise: Family.unread): Gemma4TextConfig's defaults are the dense Gemma 4 with per-layer embeddings.
MOE_REQUIRES = {"gemma4_text": dict(enable_moe_block=True, hidden_size_per_layer_input=0)}


@pytest.mark.parametrize("model_type", by_oracle(FAMILIES))
def test_a_config_json_without_optional_fields_reads_as_transformers_defaults(model_type):
    transformers = oracle("transformers")
    assert set(REQUIRED) == set(REQUIRED_FIELDS)
    family = FAMILIES[model_type]
    on_disk = {ours: disk for disk, ours in family.renames.items()}  # our field -> its config.json name
    d = {"model_type": model_type, **{on_disk.get(k, k): v for k, v in REQUIRED.items()}, **NEEDED.get(model_type, {}),
         **MOE_REQUIRES.get(model_type, {})}
    ours = config_from_dict(dict(d)).flat()  # the shared fields and those of the mixers the model holds
    # a multimodal release's text model (Qwen3.5): its text config class, which config.json names text_model_type
    reference = transformers.AutoConfig.for_model(**{**d, "model_type": family.text_model_type or model_type})
    globals_ = ours.get("global_head_dim") is not None  # Gemma 4: head_dim and KV heads per layer; ours name the
    if globals_:  # sliding layers' (the global ones': compared below)
        reference.allow_global_per_layer_attribute_access = True
    # transformers 5 holds rope_theta, its scaling and partial_rotary_factor in rope_parameters: read as we read it
    # (a family that reads a rope per layer type compares rope_parameters itself: Gemma 4)
    rope = rope_fields(reference.rope_parameters, {}, model_type) if hasattr(reference, "rope_parameters") \
        and "rope_parameters" not in family.config_fields and "rope_parameters" not in family.unread else {}
    wrong, compared = [], 0
    for name in ours:
        disk = on_disk.get(name, name)
        if name in REQUIRED or name in family.fixed or not (hasattr(reference, disk) or name in rope) \
                or family.renames.get(name, name) != name or name == "rope_parameters" and rope:
            continue  # given; the modeling file's (Family.fixed); a field transformers' config lacks; or a
            # config.json name the family reads into another of our fields (the hybrids' layer_types); or
            # rope_parameters, which a one-rope family reads as rope_theta and rope_scaling (`rope`)
        value, theirs = ours[name], rope[name] if name in rope else getattr(reference, disk)
        if name == "mixer_types" and family.layer_kinds:  # our mixers by config.json's names for their kinds
            back = {mixer: kind for kind, mixer in family.layer_kinds.items()}
            value = [back[m] for m in value]
        compared += 1
        if value != theirs and (model_type, name) not in SAME_MEANING:
            wrong.append(f"{name} ({disk}): ours {value!r}, transformers {theirs!r}")
    assert not wrong, f"{model_type}: defaults unlike transformers' {type(reference).__name__}: " + "; ".join(wrong)
    assert compared >= 15  # the comparison reached the family's fields, not only a few shared ones
    if globals_:  # Gemma 4's global layers: head width and KV heads
        full = reference.layer_types.index("full_attention")
        want = reference.per_layer_config[full]
        assert (ours["global_head_dim"], ours["num_global_key_value_heads"] or ours["num_key_value_heads"]) == \
            (want.head_dim, want.num_key_value_heads)


@pytest.mark.parametrize("model_type", NEEDED)
def test_a_config_json_without_a_needed_field_is_refused_by_name(model_type):
    on_disk = {ours: disk for disk, ours in FAMILIES[model_type].renames.items()}
    d = {"model_type": model_type, **{on_disk.get(k, k): v for k, v in REQUIRED.items()}}
    for name in NEEDED[model_type]:
        with pytest.raises(ValueError, match=name):
            config_from_dict(dict(d))


# The fields a config built in code may leave None that transformers' configs fill in otherwise than we run:
# every family whose config.json holds one (its config_fields), whatever its record's write_defaults say.
LEFT_NONE = [(m, name) for m, f in FAMILIES.items() for name in ("layer_types", "attention_multiplier")
             if name in f.config_fields]


@pytest.mark.parametrize("model_type,name", [pytest.param(*case, marks=pytest.mark.tf5) if case[0] in TRANSFORMERS_5_ONLY
                                             else case for case in LEFT_NONE])
def test_a_field_left_none_is_written_as_our_model_runs_it(model_type, name):
    """The write side (Family.write_defaults): a config built in code leaves the field None, and the
    config.json we write makes transformers' config run the layers as ours does, where its own fill-in
    would differ (gpt-oss's layer_types would alternate sliding and full; Granite's attention_multiplier
    would be None, not our 1/sqrt(head_dim))."""
    transformers = oracle("transformers")
    ours = tiny_config(model_type, **{name: None})
    reference = transformers.AutoConfig.for_model(**config_to_dict(ours))
    if name == "layer_types":  # each layer slides in transformers' config where it slides in ours
        assert [kind == "sliding_attention" for kind in reference.layer_types] == \
            [ours.window(i) is not None for i in range(ours.num_hidden_layers)]
    else:
        assert (name, getattr(reference, name)) == ("attention_multiplier", ours.attention_scale)
