"""minimoe/making/tiny.py: one builder of tiny models for the tests and for `--model tiny:<model_type>`."""
import pytest
import torch

import minimoe
from minimoe.core.decoder.families import FAMILIES
from minimoe.loading.checkpoint import read_config
from minimoe.making.tiny import FAMILY_SWITCHES, build_tiny_checkpoint, tiny_checkpoint, tiny_model_type


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_each_familys_tiny_checkpoint_builds_loads_and_runs_forward(model_type, tmp_path):
    """The checkpoint holds the family's switches (its config reads back as the builder's, with the smoke
    tokenizer's ids and widths) and runs forward through from_pretrained."""
    folder = build_tiny_checkpoint(tmp_path / model_type, model_type)
    config = read_config(folder)
    assert config.model_type == model_type
    if model_type != "olmoe":  # --model tiny's own widths (test below)
        switches = {k: v for k, v in FAMILY_SWITCHES[model_type].items()
                    if k not in ("pad_token_id", "eos_token_id", "max_position_embeddings")}  # the tokenizer's; 1024
        assert {k: config.flat()[k] for k in switches} == switches
    model = minimoe.from_pretrained(folder, dtype=torch.float32)
    tokenizer = minimoe.load_tokenizer(folder)
    ids = torch.tensor([tokenizer.encode("Which gas do plants take in? carbon dioxide")])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], config.vocab_size) and logits.isfinite().all()


def test_tiny_is_the_smoke_olmoe_and_tiny_xyz_names_the_families():
    assert tiny_model_type("tiny") == tiny_model_type("tiny:olmoe") == "olmoe"
    assert tiny_model_type("tiny:deepseek_v3") == "deepseek_v3"
    assert tiny_model_type("allenai/OLMoE-1B-7B-0924") is None and tiny_model_type("weights/tiny-olmoe") is None
    with pytest.raises(ValueError, match=r"--model tiny:xyz: no family 'xyz'; .*tiny:qwen3_moe.*tiny:deepseek_v3"):
        tiny_model_type("tiny:xyz")
    assert tiny_checkpoint().name == "tiny-olmoe"  # what --model tiny has always been
    config = read_config(tiny_checkpoint())
    assert (config.num_hidden_layers, config.intermediate_size, config.mixers["attention"].clip_qkv) == (4, 64, None)
