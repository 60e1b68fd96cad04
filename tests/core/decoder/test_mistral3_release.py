"""Mistral Small 4's released form: Mistral3ForConditionalGeneration (config.json of model_type mistral3 with the
mistral4 text model's fields under text_config, a Pixtral vision tower and a projector beside it) loads as mistral4,
with transformers 5.23's logits on text-only ids (its language path: the embedding, the text model, lm_head).
transformers 5.23's save_pretrained writes the text model under language_model.model. (its llava conversion
reversed); in memory, and as it reads them too, the keys are model.language_model. and lm_head.: both are read.
The vision tower's and projector's tensors are ignored, never read."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import minimoe
from minimoe.loading.config_json import config_from_dict
from tests.core.decoder.test_model import batch, rel_err
from tests.loading.test_checkpoint import offline, populate_hub_cache  # noqa: F401 (a fixture)
from tests.tiny_families import variant_config

FP32_TOL = 2e-5
pytestmark = pytest.mark.tf5
VISION = dict(model_type="pixtral", hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
              head_dim=16, image_size=28, patch_size=14)


def release(folder, tie: bool = False):
    """A tiny Mistral3ForConditionalGeneration around tiny:mistral4's text config, random weights as the parity
    tests draw them (norms near 1), saved by transformers 5.23; returns the model, eval mode."""
    import transformers
    text = {**variant_config("mistral4"), "tie_word_embeddings": tie}
    torch.manual_seed(0)
    ref = transformers.Mistral3ForConditionalGeneration(transformers.Mistral3Config(
        text_config=text, vision_config=VISION, tie_word_embeddings=tie))
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    ref.eval().save_pretrained(folder)
    return ref


def assert_same_logits(ours, ref):
    ids, mask = batch(ours)
    with torch.no_grad():
        assert rel_err(ours(ids, attention_mask=mask).logits, ref(input_ids=ids, attention_mask=mask).logits,
                       mask) <= FP32_TOL
        assert rel_err(ours(ids).logits, ref(input_ids=ids).logits, torch.ones_like(ids)) <= FP32_TOL
    return ids, mask


@pytest.mark.parametrize("tie", [False, True])
def test_the_release_loads_its_text_model_with_transformers_logits(tmp_path, tie):
    """Saved by transformers 5.23 (language_model.model., vision_tower., multi_modal_projector.), then the same
    tensors under transformers' in-memory names (model.language_model., lm_head., model.vision_tower.), which
    transformers reads as the same model: each loads as mistral4 with its logits, padded and unpadded. Saved, it is a
    mistral4 checkpoint that Mistral4ForCausalLM loads with those logits."""
    import transformers
    ref = release(tmp_path / "saved", tie)
    tensors = load_file(tmp_path / "saved" / "model.safetensors")
    assert "language_model.model.embed_tokens.weight" in tensors and any(k.startswith("vision_tower.") for k in tensors)
    assert ("language_model.lm_head.weight" in tensors) != tie
    renamed = {("lm_head." + k.removeprefix("language_model.lm_head.")) if k.startswith("language_model.lm_head.")
               else ("model.language_model." + k.removeprefix("language_model.model."))
               if k.startswith("language_model.model.") else "model." + k: v for k, v in tensors.items()}
    (tmp_path / "in_memory").mkdir()
    (tmp_path / "in_memory" / "config.json").write_text((tmp_path / "saved" / "config.json").read_text())
    save_file(renamed, tmp_path / "in_memory" / "model.safetensors", metadata={"format": "pt"})
    read_back = transformers.Mistral3ForConditionalGeneration.from_pretrained(tmp_path / "in_memory",
                                                                             dtype=torch.float32).eval()
    for folder, want in (("saved", ref), ("in_memory", read_back)):
        ours = minimoe.from_pretrained(tmp_path / folder, dtype=torch.float32)
        assert ours.config.model_type == "mistral4" and ours.config.tie_word_embeddings == tie
        ids, mask = assert_same_logits(ours, want)
    minimoe.save_pretrained(ours, tmp_path / "text")
    assert json.loads((tmp_path / "text" / "config.json").read_text())["model_type"] == "mistral4"
    hf = transformers.Mistral4ForCausalLM.from_pretrained(tmp_path / "text", dtype=torch.float32).eval()
    with torch.no_grad():
        assert rel_err(hf(ids, attention_mask=mask).logits, ref(input_ids=ids, attention_mask=mask).logits,
                       mask) <= FP32_TOL


def test_the_release_loads_by_hub_id_from_an_offline_cache(tmp_path, offline):  # noqa: F811
    ref = release(tmp_path / "saved")
    populate_hub_cache(tmp_path / "cache", "mistralai/Mistral-Small-4-tiny", tmp_path / "saved")
    ours = minimoe.from_pretrained("mistralai/Mistral-Small-4-tiny", cache_dir=tmp_path / "cache", dtype=torch.float32)
    assert_same_logits(ours, ref)


def wrapper(**changes) -> dict:
    text = {**variant_config("mistral4"), **changes.pop("text", {})}
    return {"model_type": "mistral3", "text_config": {k: v for k, v in text.items() if v is not None},
            "vision_config": VISION, "tie_word_embeddings": False, **changes}


def test_a_mistral3_wrapper_of_another_text_model_is_refused_by_name():
    """Mistral Small 3.x's wrapper holds a dense Mistral (text_config model_type mistral, or none: Mistral3Config's
    default); a text_config's tying that disagrees with the wrapper's (which Mistral3ForConditionalGeneration ties by,
    True by default) is refused as in every release."""
    assert config_from_dict(wrapper()).model_type == "mistral4"
    with pytest.raises(ValueError, match=r"text_config's model_type 'mistral'; minimoe holds a mistral3 config.json "
                                         r"whose text model is 'mistral4' only"):
        config_from_dict(wrapper(text={"model_type": "mistral"}))
    with pytest.raises(ValueError, match=r"model_type 'mistral' \(it names none"):
        config_from_dict(wrapper(text={"model_type": None}))
    with pytest.raises(ValueError, match="tie_word_embeddings True and text_config's False disagree"):
        config_from_dict(wrapper(tie_word_embeddings=True))
