"""config.json as transformers 5 writes it (minimoe/loading/config_keys.py): its names read as 4.57's, and a key
that would change the model and that no record reads refused by name.

The tests marked `tf5` hold minimoe to transformers 5.23 itself (.ci/run's third environment): every family's
tiny checkpoint saved by it loads exactly. The others run in the main environment: a hand-written transformers-5
config.json needs no oracle to show that its rope theta is read."""
import copy
import json
import math

import pytest
import torch

import minimoe
from minimoe.core.decoder.family_record import CONFIG_FIELDS, FAMILIES
from minimoe.loading.config_json import config_from_dict, config_to_dict
from minimoe.loading.config_keys import HARMLESS, UNREAD
from tests.conftest import TRANSFORMERS_5_ONLY, oracle, tiny_config

FP32_TOL = 2e-5


def tiny(model_type: str) -> dict:
    """Our tiny config as config.json; the dense MLP's width set where the tiny model has no dense layer (a
    null intermediate_size, which transformers 5's strict configs refuse)."""
    # the gated norm per group of heads or over the whole width (GROUPED_NORM): one group
    over = {"mamba_n_groups": 1} if model_type == "granitemoehybrid" else {}
    if tiny_config(model_type).dense_intermediate_size is None:
        over["dense_intermediate_size"] = 48
    config = tiny_config(model_type, **over)
    return {**config_to_dict(config), "torch_dtype": "float32"}


# transformers 5.23 normalises Granite 4.0-H's Mamba-2 gated norm per group of heads (mamba_ssm's RMSNormGated with
# group_size = d_ssm // ngroups); transformers 4.57, and minimoe after it (core/token_mixers/mamba2.py), over the whole inner width.
# The two agree where mamba_n_groups is 1; at 2 groups they differ by 0.17 relative (docs/families.md).
GROUPED_NORM = "granitemoehybrid's Mamba-2 norm: per group in transformers 5.23, whole width in 4.57 and minimoe"


def as_transformers5(d: dict) -> dict:
    """A 4.57 config.json `d` in transformers 5's names, as its save_pretrained writes them (written by hand)."""
    d = copy.deepcopy(d)
    rope = {"rope_theta": d.pop("rope_theta"), **(d.pop("rope_scaling") or {"rope_type": "default"})}
    if "partial_rotary_factor" in d:
        rope["partial_rotary_factor"] = d.pop("partial_rotary_factor")
    d["rope_parameters"] = rope
    d["dtype"] = d.pop("torch_dtype")
    return d


def test_qwen3_moe_rope_parameters_theta_is_read():
    """The finding of issue 56: transformers 5's qwen3_moe config.json (rope_parameters, num_local_experts, dtype)
    loaded with the default theta 10000, logits off by 0.99 relative. Every field now reads as the 4.57 file's."""
    old = tiny("qwen3_moe")
    old["rope_theta"] = 1e6
    new = as_transformers5(old)
    new["num_local_experts"] = new.pop("num_experts")
    assert "rope_theta" not in new and new["rope_parameters"]["rope_theta"] == 1e6
    ours = config_from_dict(new)
    assert ours.rope_theta == 1e6 and ours.num_experts == old["num_experts"] and ours.rope_scaling is None
    assert ours.torch_dtype == "float32"
    assert ours == config_from_dict(old)


def test_rope_scaling_and_partial_rotary_are_read_from_rope_parameters():
    for model_type in ("gpt_oss", "glm4_moe", "qwen3_next"):  # YaRN; partial rotary 0.5; partial rotary 0.25
        old = tiny(model_type)
        assert config_from_dict(as_transformers5(old)) == config_from_dict(old), model_type


def test_per_layer_type_rope_is_one_rope_or_refused():
    d = as_transformers5(tiny("gpt_oss"))
    rope = d["rope_parameters"]
    d["rope_parameters"] = {"full_attention": rope, "sliding_attention": dict(rope)}
    assert config_from_dict(d) == config_from_dict(tiny("gpt_oss"))
    d["rope_parameters"]["sliding_attention"]["rope_theta"] = 1e6
    with pytest.raises(ValueError, match="rope_parameters differ between layer types"):
        config_from_dict(d)


@pytest.mark.parametrize("key,value", [("dtype", "bfloat16"), ("num_local_experts", 4), ("rope_theta", 5.0)])
def test_transformers5_names_disagreeing_with_4_57_names_are_refused(key, value):
    d = as_transformers5(tiny("qwen3_moe"))
    d.update({"torch_dtype": "float32", "num_experts": 8, "rope_theta": d["rope_parameters"]["rope_theta"]}, **{key: value})
    with pytest.raises(ValueError, match=key):
        config_from_dict(d)


def test_hybrid_layer_kinds_in_transformers5_names():
    """transformers 5 renames Granite-4.0-H's layer kinds mamba / attention to linear_attention / full_attention."""
    d = tiny("granitemoehybrid")
    renamed = {**d, "layer_types": [{"mamba": "linear_attention", "attention": "full_attention"}[k]
                                    for k in d["layer_types"]]}
    assert config_from_dict(renamed) == config_from_dict(d)


# A key no record reads: the value our model runs with (which loads), and one that changes what transformers
# computes (which must fail by its name).
PLANTED = [("gpt_oss", "swiglu_alpha", 1.702, 1.0),
           ("granitemoehybrid", "time_step_limit", [0.0, {"__float__": "Infinity"}], [0.0, 10.0]),  # inf as 5 writes it
           ("mixtral", "router_jitter_noise", 0.0, 0.1), ("olmoe", "attention_dropout", 0.0, 0.1),
           ("deepseek_v2", "mlp_bias", False, True), ("deepseek_v3", "qk_head_dim", 16 + 8, 7),
           ("granitemoe", "position_embedding_type", "rope", "nope"),
           ("qwen2_moe", "layer_types", ["full_attention"] * 2, ["full_attention", "sliding_attention"]),
           # Gemma 4: the dense model, per-layer embeddings, KV-shared layers, bidirectional attention; its global
           # layers' overrides as transformers 5.23 saves them, disagreeing with global_head_dim and its KV heads
           ("gemma4_text", "enable_moe_block", True, False), ("gemma4_text", "hidden_size_per_layer_input", 0, 256),
           ("gemma4_text", "num_kv_shared_layers", 0, 1), ("gemma4_text", "use_bidirectional_attention", "vision", "all"),
           ("gemma4_text", "per_layer_config", {"1": {"head_dim": 32, "num_key_value_heads": 1}}, {"1": {"head_dim": 32}}),
           ("mimo_v2_flash", "sliding_window_size", 3, 4)]  # SGLang's size: one less than our window of 4


@pytest.mark.parametrize("model_type,key,good,bad", PLANTED)
def test_a_planted_unread_field_that_matters_fails_by_name(model_type, key, good, bad):
    d = tiny(model_type)
    assert key not in CONFIG_FIELDS | FAMILIES[model_type].config_fields
    config_from_dict({**d, key: good})
    with pytest.raises(ValueError, match=f"{key} = .*minimoe's {model_type} runs with"):
        config_from_dict({**d, key: bad})


def test_gemma4_last_layer_sliding_is_refused():
    """Gemma4TextConfig turns a last sliding layer into a full one (with a warning): refused rather than run otherwise."""
    d = tiny("gemma4_text")
    with pytest.raises(ValueError, match="layer_types ends with 'sliding_attention'"):
        config_from_dict({**d, "layer_types": ["full_attention", "sliding_attention"]})


@pytest.mark.parametrize("rope,message", [
    ({"sliding_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_type 'yarn' is not supported"),
    ({"sliding_attention": {"rope_type": "default"}}, "has no rope_theta"),
    ({}, "expected one rope per layer type")])
def test_gemma4_rope_per_layer_type_we_do_not_compute_is_refused(rope, message):
    d = tiny("gemma4_text")
    with pytest.raises(ValueError, match=message):
        config_from_dict({**d, "rope_parameters": {"full_attention": d["rope_parameters"]["full_attention"], **rope}})


def test_qwen2_moe_sliding_from_max_window_layers_on_is_refused():
    """transformers slides Qwen2-MoE's layers from max_window_layers on; ours slides every layer or none."""
    d = {**tiny("qwen2_moe"), "use_sliding_window": True, "sliding_window": 4}
    config_from_dict({**d, "max_window_layers": 0})
    with pytest.raises(ValueError, match="max_window_layers = 1"):
        config_from_dict({**d, "max_window_layers": 1})


# ----------------------------------------------------------------------------- every key, read, held or harmless

def read_keys(model_type: str) -> set:
    """The config.json keys a family's record reads (in 4.57's names and transformers 5's)."""
    family = FAMILIES[model_type]
    back = {ours: disk for disk, ours in family.renames.items()}
    ours = CONFIG_FIELDS | family.config_fields | set(family.defaults) | set(family.fixed)
    return {back.get(k, k) for k in ours} | set(family.renames) | {"rope_parameters", "dtype", "num_local_experts",
                                                                  "layer_types" if family.layer_kinds else "model_type"}


def unclassified_keys(model_type: str) -> list:
    """Keys transformers' config class of the family writes (every one, defaults too) that no record reads, holds
    or calls harmless: each could change the model unseen."""
    transformers = oracle("transformers")
    written = transformers.AutoConfig.for_model(**tiny(model_type)).to_dict()
    family = FAMILIES[model_type]
    known = read_keys(model_type) | HARMLESS | family.harmless | set(UNREAD) | set(family.unread)
    return sorted(set(written) - known)


@pytest.mark.parametrize("model_type", [f for f in FAMILIES if f not in TRANSFORMERS_5_ONLY])
def test_every_key_transformers_4_writes_is_read_held_or_harmless(model_type):
    assert unclassified_keys(model_type) == []


@pytest.mark.tf5
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_every_key_transformers_5_writes_is_read_held_or_harmless(model_type):
    assert unclassified_keys(model_type) == []


# ----------------------------------------------------------------------------- transformers 5.23 as the oracle

@pytest.mark.tf5
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_every_family_saved_by_transformers5_loads_exactly(model_type, tmp_path):
    """A tiny checkpoint saved by transformers 5.23 (its config.json: rope_parameters, dtype, ...; its weights as its
    save_pretrained writes them) loads into minimoe with fp32 logits within 2e-5 relative of transformers 5.23's,
    padded and unpadded."""
    from tests.core.decoder.test_model import batch, reference_model, rel_err
    ref = reference_model(tiny(model_type), tmp_path)
    on_disk = json.loads((tmp_path / "config.json").read_text())
    family = FAMILIES[model_type]  # Kimi Linear's and Nemotron-H's configs name no rope
    if not family.fixed.get("mla_nope") and family.fixed.get("position_embedding_type") != "nope":
        assert "rope_parameters" in on_disk  # the form this test is about; DeepseekV4Config (its two ropes held by
        assert "rope_theta" not in on_disk or "rope_parameters" in family.unread  # unread) keeps rope_theta beside
    ours = minimoe.from_pretrained(tmp_path, dtype=torch.float32)
    ids, mask = batch()
    with torch.no_grad():
        assert rel_err(ours(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits, mask) <= FP32_TOL
        full = torch.ones_like(mask)
        assert rel_err(ours(ids).logits, ref(ids).logits, full) <= FP32_TOL
    assert math.isfinite(ours.config.rope_theta)


def test_a_released_qwen3_5_config_json_reads_its_text_config():
    """Qwen3.5's releases write the vision-language model's config.json (model_type qwen3_5_moe, the text model's
    fields under text_config, the vision tower's under vision_config): it reads as the flat config.json that
    Qwen3_5MoeForCausalLM writes (model_type qwen3_5_moe_text); a text_config of another model, or a
    tie_word_embeddings that disagrees with it, is refused by name."""
    flat = tiny("qwen3_5_moe")
    assert flat["model_type"] == "qwen3_5_moe_text"
    released = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
                "text_config": flat, "vision_config": {"depth": 27}, "image_token_id": 248056,
                "tie_word_embeddings": False}
    assert config_from_dict(released) == config_from_dict(flat)
    assert config_from_dict(released).model_type == "qwen3_5_moe"
    with pytest.raises(ValueError, match="text_config's model_type 'qwen3_next'"):
        config_from_dict({**released, "text_config": {**flat, "model_type": "qwen3_next"}})
    with pytest.raises(ValueError, match="tie_word_embeddings True and text_config's False disagree"):
        config_from_dict({**released, "tie_word_embeddings": True})


def test_nemotron_h_reads_its_layer_pattern_or_list_and_refuses_them_disagreeing():
    """Nemotron-H's layers: layers_block_type, or an older config.json's hybrid_override_pattern (one character a
    layer, as NemotronHConfig reads it where the list is missing); both given and disagreeing is refused by name."""
    d = {k: v for k, v in tiny("nemotron_h").items() if k != "layers_block_type"}
    config = config_from_dict({**d, "hybrid_override_pattern": "M*-EE"})
    assert config.mixer_types == ["mamba2", "attention", "mlp", "moe", "moe"] and config.sparse_layers == [3, 4]
    listed = ["linear_attention", "full_attention", "mlp", "moe", "moe"]
    assert config_from_dict({**d, "layers_block_type": listed, "hybrid_override_pattern": "M*-EE"}) == config
    with pytest.raises(ValueError, match="hybrid_override_pattern = 'M\\*EE-', but minimoe's nemotron_h runs with 'M\\*-EE'"):
        config_from_dict({**d, "layers_block_type": listed, "hybrid_override_pattern": "M*EE-"})


def test_two_keys_giving_one_field_must_agree():
    """Nemotron-H's config.json may hold a field under its transformers 5 name and its older one (n_groups,
    mamba_n_groups): equal, it loads; unequal, it is refused naming both, never one taken silently."""
    d = tiny("nemotron_h")
    assert config_from_dict({**d, "mamba_n_groups": d["n_groups"]}).mixers["mamba2"].mamba_n_groups == d["n_groups"]
    with pytest.raises(ValueError, match="n_groups = 2 and mamba_n_groups = 1 disagree; both give mamba_n_groups"):
        config_from_dict({**d, "mamba_n_groups": 1})


@pytest.mark.tf5
def test_mimo_reads_its_released_config_json_as_transformers_does():
    """MiMo-V2-Flash's released config.json writes routed_scaling_factor null and its window as sliding_window_size
    (SGLang's, one less than transformers' sliding_window); and a rope_parameters entry may omit partial_rotary_factor:
    each read as MiMoV2FlashConfig and its rotary embedding read them (null: 1.0; the window size + 1; 0.334 of the
    head), not as our defaults for other families."""
    transformers = oracle("transformers")
    d = {k: v for k, v in tiny("mimo_v2_flash").items() if k != "sliding_window"}
    d |= {"routed_scaling_factor": None, "sliding_window_size": 6}
    theirs = transformers.AutoConfig.for_model(**d)
    ours = config_from_dict(d)
    assert (ours.routed_scaling_factor, ours.sliding_window) == (theirs.routed_scaling_factor, theirs.sliding_window) \
        == (1.0, 7)
    from transformers.models.mimo_v2_flash.modeling_mimo_v2_flash import MiMoV2FlashRotaryEmbedding
    from minimoe.core.layers.rope import layer_type_frequencies
    rope = MiMoV2FlashRotaryEmbedding(theirs)
    for kind in ("full_attention", "sliding_attention"):  # the tiny sliding entry gives no partial_rotary_factor
        want = getattr(rope, f"{kind}_inv_freq")
        got = layer_type_frequencies(ours.rope_parameters[kind], ours.head_dim, ours.mixers["attention"].layer_rope_partial)
        assert torch.equal(got, want)


def test_a_default_computed_from_a_missing_field_names_that_field():
    """DeepSeek-V4's config.json without its layer count: the defaults that read it (the layer schedules) refuse it
    naming num_hidden_layers, where a KeyError stopped the load before."""
    with pytest.raises(ValueError, match=r"missing field.*num_hidden_layers"):
        config_from_dict({"model_type": "deepseek_v4"})
