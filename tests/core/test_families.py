"""Tests for minimoe.core.families: every record complete and read by everything that names a family."""
import json
from dataclasses import fields, replace

import pytest

from tests.conftest import tiny_config
from minimoe.cli.train import parse_args, resolve_config
from minimoe.core.families import CONFIG_FIELDS, FAMILIES, REQUIRED, Family, family_of, register_family
from minimoe.core.lora import resolve_targets
from minimoe.core.model import MoEConfig, MoEForCausalLM, config_field_names
from minimoe.loading.checkpoint import checkpoint_layout, config_from_dict, config_to_dict
from minimoe.runs.recipes import RECIPES
from minimoe.study.grid import guess_recipe


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_every_record_is_complete_and_consistent(model_type):
    f = FAMILIES[model_type]
    assert f.model_type == model_type
    for name in REQUIRED:
        assert getattr(f, name), f"{model_type}: {name} is empty"
    assert all(h.count("/") == 1 for h in f.hub_examples)
    assert f.recipe in RECIPES
    # The recipe's LoRA targets are the family's own, so that train.py and add_lora agree.
    assert resolve_targets(RECIPES[f.recipe]["lora_targets"]) == resolve_targets(f.lora_targets)
    ours = set(config_field_names())
    assert set(f.renames.values()) <= ours and f.config_fields <= ours and set(f.fixed) <= ours
    assert set(f.defaults) <= ours and CONFIG_FIELDS <= ours
    assert not set(f.fixed) & f.config_fields  # a fixed field is neither read nor written
    # Every name the table maps is a parameter of the family's model.
    model = MoEForCausalLM(tiny_config(model_type))
    params = {n.split(".", 3)[-1] for n, _ in model.named_parameters() if n.startswith("model.layers.")}  # any layer: dense ones too
    assert set(f.layer_keys) <= params


def test_unknown_model_type_names_the_families_there_are():
    with pytest.raises(ValueError, match=r"unknown model_type 'llama4'; expected one of \[.*'granitemoe'.*'olmoe'"):
        family_of("llama4")
    with pytest.raises(ValueError, match="unknown model_type 'llama4'"):
        config_from_dict({"model_type": "llama4", "hidden_size": 8})


@pytest.fixture
def declared():
    """A family added by one record (a renamed OLMoE trained with Granite's recipe), removed afterwards."""
    olmoe = FAMILIES["olmoe"]
    family = register_family(replace(olmoe, model_type="olmoe_like", architecture="OlmoeLikeForCausalLM",
                                     recipe="granite", lora_targets=("q", "k", "v", "experts"),
                                     name_hints=("olmoe-like",), renames={"n_experts": "num_experts"},
                                     defaults={"norm_topk_prob": True}))
    yield family
    del FAMILIES["olmoe_like"]


def test_a_family_is_one_declaration(declared, tmp_path):
    # Config mapping, architecture, checkpoint names, LoRA targets and the recipe all follow the record.
    d = config_to_dict(tiny_config("olmoe"))
    d.update(model_type="olmoe_like", n_experts=d.pop("num_experts"))
    d.pop("norm_topk_prob")
    config = config_from_dict(d)
    assert config.num_experts == 8 and config.norm_topk_prob and config.qk_norm == "full"
    back = config_to_dict(config)
    assert back["architectures"] == ["OlmoeLikeForCausalLM"] and back["n_experts"] == 8 and "num_experts" not in back
    layout = checkpoint_layout(config)
    assert layout["model.layers.0.mlp.experts.down_proj.weight"][0] == "model.layers.0.mlp.experts.0.down_proj.weight"
    args = parse_args(["--model", "x"])
    cfg = resolve_config(args, config)
    assert cfg.recipe == "granite" and cfg.lr == RECIPES["granite"]["lr"]
    folder = tmp_path / "some-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(back))
    assert guess_recipe(str(folder)) == "granite"
    assert guess_recipe("org/OLMoE-like-1B") == "granite"


def test_train_and_sweep_take_the_recipe_from_the_record_never_a_default():
    for model_type, family in FAMILIES.items():
        cfg = resolve_config(parse_args(["--model", "x"]), tiny_config(model_type))
        assert cfg.recipe == family.recipe
    assert guess_recipe("ibm-granite/granite-3.1-3b-a800m-base") == "granite"
    assert guess_recipe("allenai/OLMoE-1B-7B-0924") == "olmoe"
    assert guess_recipe("someone/unknown-moe") is None  # train.py reads the checkpoint's model_type


def test_family_fixed_fields_override_the_file():
    # Granite hard-codes top-K on logits (renormalised); a config.json saying otherwise does not change it.
    d = config_to_dict(tiny_config("granitemoe"))
    d["norm_topk_prob"] = False
    assert config_from_dict(d).norm_topk_prob and config_from_dict(d).topk_on_logits
    assert MoEConfig(**{**vars(tiny_config("olmoe")), "qk_norm": None}).qk_norm == "full"
    assert {f.name for f in fields(Family)} >= set(REQUIRED)
