"""minimoe/making/tiny.py: one builder of tiny models for the tests and for `--model tiny:<model_type>`."""
import pytest
import torch

import minimoe
from minimoe.core.decoder.family_record import FAMILIES
from minimoe.loading.config_json import read_config
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


def test_tiny_gpt_oss_stores_its_experts_in_mxfp4_as_the_release_does(tmp_path):
    """tiny:gpt_oss holds its expert banks as `_blocks` and `_scales` with the release's quantization_config,
    so --quantize mxfp4 runs without the 13 GB release: kept packed, its logits equal the dequantised-on-load
    model's bit for bit."""
    import json
    from safetensors.torch import load_file
    from minimoe.core.adaptation.quantized import is_quantized
    folder = build_tiny_checkpoint(tmp_path / "gpt_oss", "gpt_oss")
    keys = set(load_file(folder / "model.safetensors"))
    assert {k for k in keys if k.endswith(("_blocks", "_scales"))} == {
        f"model.layers.{i}.mlp.experts.{p}_{s}" for i in range(read_config(folder).num_hidden_layers)
        for p in ("gate_up_proj", "down_proj") for s in ("blocks", "scales")}
    assert json.loads((folder / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    dense = minimoe.from_pretrained(folder, dtype=torch.float32)
    kept = minimoe.from_pretrained(folder, dtype=torch.float32, quantize="mxfp4")
    assert any(is_quantized(m) for m in kept.modules())
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(kept(ids).logits, dense(ids).logits)
