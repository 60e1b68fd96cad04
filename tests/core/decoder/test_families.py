"""Tests for minimoe.core.decoder.families: every record complete and read by everything that names a family, and
no module outside the records and the model builders naming one."""
import ast
import json
from dataclasses import fields, replace
from pathlib import Path

import pytest

from tests.conftest import tiny_config
from minimoe.cli.train import check_quantization, parse_args, resolve_config
from minimoe.core.decoder.family_record import (CONFIG_FIELDS, FAMILIES, REQUIRED, Family, family_of,
                                                register_family)
from minimoe.core.adaptation.lora import TARGETS, resolve_targets
from minimoe.core.decoder.model import MoEConfig, MoEForCausalLM, config_field_names
from minimoe.loading.checkpoint import tensor_names
from minimoe.loading.checkpoint import checkpoint_layout
from minimoe.loading.config_json import config_from_dict, config_to_dict
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
    assert "lora_targets" not in RECIPES[f.recipe]  # the family's (train.py and add_lora read the record)
    resolve_targets(f.lora_targets)  # known names
    assert set(f.lora_paths) <= set(TARGETS)
    ours = set(config_field_names())
    assert set(f.renames.values()) <= ours and f.config_fields <= ours and set(f.fixed) <= ours
    assert set(f.defaults) <= ours and CONFIG_FIELDS <= ours
    assert not set(f.fixed) & f.config_fields  # a fixed field is neither read nor written
    assert set(f.write_defaults) <= CONFIG_FIELDS | f.config_fields | set(f.unread)  # written fields, or a held key
    # Every name the table maps is a parameter of the family's model.
    model = MoEForCausalLM(tiny_config(model_type))
    params = {n.split(".", 3)[-1] for n in tensor_names(model) if n.startswith("model.layers.")}  # any layer: dense ones too
    assert set(f.layer_keys) <= params


def test_each_record_names_the_oldest_transformers_that_holds_it():
    """Family.since_transformers (the tf5 mark of a family's oracle tests, export_peft's default) against the
    installed transformers' own list of model types: 4 where it holds the family, 5 where it does not."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    major = int(transformers.__version__.split(".")[0])
    for name, record in FAMILIES.items():
        held = (record.text_model_type or name) in CONFIG_MAPPING_NAMES or name in CONFIG_MAPPING_NAMES
        assert held == (record.since_transformers <= major), (name, record.since_transformers, major)


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
    assert config.num_experts == 8 and config.norm_topk_prob and config.mixers["attention"].qk_norm == "full"
    back = config_to_dict(config)
    assert back["architectures"] == ["OlmoeLikeForCausalLM"] and back["n_experts"] == 8 and "num_experts" not in back
    layout = checkpoint_layout(config)
    assert layout["model.layers.0.mlp.experts.down_proj.weight"][0] == "model.layers.0.mlp.experts.0.down_proj.weight"
    args = parse_args(["--model", "x"])
    cfg = resolve_config(args, config)
    assert cfg.recipe == "granite" and cfg.lr == RECIPES["granite"]["lr"]
    assert cfg.lora_targets == ["q", "k", "v", "experts"]  # the record's, not OLMoE's q, k, v, o
    folder = tmp_path / "some-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(back))
    assert guess_recipe(str(folder)) == "granite"
    assert guess_recipe("org/OLMoE-like-1B") == "granite"


def test_train_and_sweep_take_the_recipe_from_the_record_never_a_default():
    for model_type, family in FAMILIES.items():
        cfg = resolve_config(parse_args(["--model", "x"]), tiny_config(model_type))
        assert cfg.recipe == family.recipe and cfg.lora_targets == list(family.lora_targets)
        other = "olmoe" if family.recipe == "granite" else "granite"  # --recipe: the optimisation, not the targets
        assert resolve_config(parse_args(["--model", "x", "--recipe", other]), tiny_config(model_type)).lora_targets \
            == list(family.lora_targets)
    assert guess_recipe("ibm-granite/granite-3.1-3b-a800m-base") == "granite"
    assert guess_recipe("allenai/OLMoE-1B-7B-0924") == "olmoe"
    assert guess_recipe("someone/unknown-moe") is None  # train.py reads the checkpoint's model_type


def test_family_fixed_fields_override_the_file():
    # Granite hard-codes top-K on logits (renormalised); a config.json saying otherwise does not change it.
    d = config_to_dict(tiny_config("granitemoe"))
    d["norm_topk_prob"] = False
    assert config_from_dict(d).norm_topk_prob and config_from_dict(d).topk_on_logits
    assert MoEConfig.from_flat({**tiny_config("olmoe").flat(), "qk_norm": None}).mixers["attention"].qk_norm == "full"
    assert {f.name for f in fields(Family)} >= set(REQUIRED)


def test_mxfp4_is_kept_packed_for_the_one_family_released_in_it():
    """train.py --quantize mxfp4 reads the record (Family.packed_release): gpt-oss's release stores its experts
    in MXFP4 (openai/gpt-oss-20b), no other family's does; the others are refused before any run folder."""
    accepted = []
    for model_type in FAMILIES:
        config = tiny_config(model_type)
        cfg = resolve_config(parse_args(["--model", "x", "--quantize", "mxfp4"]), config)
        try:
            check_quantization(cfg, config)
            accepted.append(model_type)
        except SystemExit as e:
            assert f"this model is {model_type}; use --quantize nf4" in str(e)
    assert accepted == ["gpt_oss"]


# Where a module may name a family by its model_type: the records, and the builders that make a model of
# one on purpose (making/tiny.py's tiny models; making/upcycle.py, which writes a Granite-MoE checkpoint).
# "olmoe" is also the paper's name for a recipe (recipes are named for the backbone that trained them):
# allowed as a recipe name where recipes are declared (runs/recipes.py) and the paper's grid picks them.
REPO = Path(__file__).resolve().parents[3]
ALLOWED = {"minimoe/core/decoder/families.py": set(FAMILIES), "minimoe/core/decoder/families_2026.py": set(FAMILIES),
           "minimoe/core/decoder/families_2026_hybrids.py": set(FAMILIES),
           "minimoe/core/decoder/families_2026_deepseek_v4.py": set(FAMILIES),
           "minimoe/making/tiny.py": set(FAMILIES),
           "minimoe/making/upcycle.py": {"granitemoe"},
           "minimoe/runs/recipes.py": set(RECIPES) & set(FAMILIES),
           "minimoe/study/grid.py": set(RECIPES) & set(FAMILIES)}


def family_names(source: str) -> list[tuple[int, str]]:
    """(line, model_type) of each string constant, name or imported module in `source` that is exactly a
    family's model_type: code that branches on a family, keys a table by one or imports a module of one
    (prose naming a family inside a longer string is not)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [part for module in [getattr(node, "module", None) or ""] + [a.name for a in node.names]
                     for part in module.split(".")]
        else:
            names = [getattr(node, "id", None) or getattr(node, "attr", None)]
        found += [(node.lineno, name) for name in names if name in FAMILIES]
    return found


def test_no_module_outside_the_records_and_the_builders_names_a_family():
    """Every fact about a family is on its record (core/decoder/families.py): checkpoint conversions, export layouts,
    LoRA paths, recipes. A module that compares a model_type with a family's name, or imports a module
    of one, holds a fact off its record."""
    assert family_names('if config.model_type == "gpt_oss":\n    pass') == [(1, "gpt_oss")]  # the check bites
    assert family_names("from minimoe.loading import gpt_oss") == [(1, "gpt_oss")]
    files = sorted((REPO / "minimoe").rglob("*.py"))
    found = [f"{rel}:{line}: {name!r}" for path in files for rel in [path.relative_to(REPO).as_posix()]
             for line, name in family_names(path.read_text(encoding="utf-8")) if name not in ALLOWED.get(rel, ())]
    found += [f"{path.relative_to(REPO).as_posix()}: a module named for a family" for path in files
              if path.stem in FAMILIES]
    assert not found, "a family named outside its record (put the fact on its core/decoder/families.py record):\n" + \
        "\n".join(found)
