"""Tests for minimoe.core.token_mixers.mixers: each token mixer owns its options (its `config_class`, defined and checked in
the mixer's own file), MoEConfig holds one per kind its layers run and keeps only what the families share,
and a flat config (config.json's names, a run's recorded model_config) reads into them and back."""
import re
from dataclasses import fields

import pytest

from tests.conftest import tiny_config
from minimoe.core.token_mixers.attention import AttentionConfig
from minimoe.core.token_mixers.deltanet import DeltaNetConfig
from minimoe.core.decoder.family_record import FAMILIES
from minimoe.core.token_mixers.mamba2 import Mamba2Config
from minimoe.core.token_mixers.mixers import MIXERS, mixer_field_names
from minimoe.core.token_mixers.mla import MLAConfig
from minimoe.core.decoder.model import MoEConfig
from minimoe.loading.config_json import config_from_dict, config_to_dict

MLA = dict(kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)


def test_moe_config_holds_no_mixers_option():
    """A mixer's options live in its config alone: none is a MoEConfig field (no mamba_*, linear_*, MLA or
    attention option), no two mixers share a name (MoEConfig.from_flat gives each flat name one owner), and
    each config is defined in its mixer's file."""
    shared = {f.name for f in fields(MoEConfig)}
    owned = [f.name for mixer in MIXERS.values() for f in fields(mixer.config_class)]
    assert len(owned) == len(set(owned)) == len(mixer_field_names())
    assert not shared & set(owned)
    assert not [name for name in shared if name.startswith(("mamba_", "linear_", "qk_", "attn_"))]
    assert not shared & {"kv_lora_rank", "q_lora_rank", "v_head_dim", "attention_sinks", "no_rope_layers", "clip_qkv"}
    assert all(mixer.config_class.__module__ == mixer.__module__ for mixer in MIXERS.values())


@pytest.mark.parametrize("options,bad,message", [
    (Mamba2Config, dict(mamba_d_state=0), "mamba_d_state 0; expected an int >= 1"),
    (Mamba2Config, dict(mamba_d_head=-64), "mamba_d_head -64; expected an int >= 1 or 'auto'"),
    (Mamba2Config, dict(mamba_n_heads=6, mamba_n_groups=4), "mamba_n_heads 6 is not a multiple of mamba_n_groups 4"),
    (DeltaNetConfig, dict(linear_key_head_dim=0), "linear_key_head_dim 0; expected an int >= 1"),
    (DeltaNetConfig, dict(linear_num_key_heads=3), "linear_num_value_heads 32 is not a multiple of linear_num_key_heads 3"),
    (MLAConfig, {**MLA, "qk_rope_head_dim": 0}, "qk_rope_head_dim 0; expected an int >= 1"),
    (MLAConfig, {}, "kv_lora_rank None; expected an int >= 1"),
    (MLAConfig, {**MLA, "q_lora_rank": 0}, "q_lora_rank 0; expected an int >= 1 or null"),
    (AttentionConfig, dict(qk_norm="rms"), "qk_norm 'rms'; expected one of (None, 'full', 'head', 'l2')"),
    (AttentionConfig, dict(clip_qkv=-1.0), "clip_qkv -1.0; expected a number > 0 or null"),
])
def test_a_mixer_config_refuses_a_bad_value_by_name(options, bad, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        options(**bad)


def test_a_bad_option_in_config_json_is_refused_by_name():
    """Read from config.json, a mixer's option is checked by its config (and what needs the model's shared
    fields, by its `resolve`): the error names the field as config.json does."""
    d = config_to_dict(tiny_config("granitemoehybrid"))
    with pytest.raises(ValueError, match="mamba_d_state 0; expected an int >= 1"):
        config_from_dict({**d, "mamba_d_state": 0})
    d = config_to_dict(tiny_config("deepseek_v3"))
    with pytest.raises(ValueError, match="v_head_dim 0; expected an int >= 1"):
        config_from_dict({**d, "v_head_dim": 0})
    d = config_to_dict(tiny_config("llama4_text"))
    with pytest.raises(ValueError, match="no_rope_layers has 2 entries; expected at least num_hidden_layers=3"):
        config_from_dict({**d, "no_rope_layers": [1, 0]})


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_a_config_holds_the_mixers_its_layers_run_and_reads_back_flat(model_type):
    """One config per kind the layers run, plus each kind of a hybrid family (its config.json carries them
    all); flat() and from_flat() are each other's inverse."""
    config = tiny_config(model_type)
    kinds = set(FAMILIES[model_type].layer_kinds.values()) & set(MIXERS)  # not Nemotron-H's feed-forward blocks
    assert set(config.mixers) == config.mixer_kinds | kinds
    assert all(isinstance(options, MIXERS[kind].config_class) for kind, options in config.mixers.items())
    assert MoEConfig.from_flat(config.flat()) == config


def test_a_mixer_config_only_where_a_layer_may_run_it():
    """A config given for a mixer no layer runs is refused by name; a flat config's options of such a mixer
    (an older run's record holds every mixer's) are dropped, as no layer reads them."""
    shape = {f.name: getattr(tiny_config("olmoe"), f.name) for f in fields(MoEConfig) if f.name != "mixers"}
    with pytest.raises(ValueError, match=r"mixers\['mamba2'\] .* expected a mamba2 config only where a layer runs"):
        MoEConfig(**shape, mixers={"mamba2": Mamba2Config()})
    config = MoEConfig.from_flat({**tiny_config("olmoe").flat(), "mamba_n_heads": 8, "kv_lora_rank": None})
    assert set(config.mixers) == {"attention"} and config == tiny_config("olmoe")
    # MLA runs where its options are given (DeepSeek's config.json: kv_lora_rank set), attention's are not built
    config = MoEConfig(**shape, mixers={"mla": MLAConfig(**MLA)})
    assert config.mixer_kinds == {"mla"} and set(config.mixers) == {"mla"} and config.rope_dim == 4
