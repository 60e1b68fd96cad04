"""The whole pipeline on transformers-saved tiny checkpoints of DeepSeek-V2, DeepSeek-V3, gpt-oss and the two hybrids
(Granite 4.0-H, Qwen3-Next): train.py
with every method (killed and resumed), evaluate.py and sweep.py (tests/core/test_families.py's pipeline test, here
on a folder transformers wrote) and a hub id from an offline cache (lm-eval's model on them:
tests/integrations/test_lm_eval_families.py)."""
import json
import shutil

import pytest
import torch

import minimoe
import tests.core.test_families as test_families
import tests.tiny_families as tiny_families
from minimoe.loading.checkpoint import read_config
from minimoe.loading.tiny import tiny_checkpoint
from tests.loading.test_checkpoint import offline, populate_hub_cache  # noqa: F401  (offline: a fixture)
from tests.core.test_families_parity import FP32_TOL, batch, rel_err

# One transformers variant per family: V2's group-limited top-K with low-rank q, V3's sigmoid scores with the
# correction bias and YaRN, gpt-oss's sinks, sliding layers, biases and YaRN.
VARIANTS = ["deepseek_v2-group", "deepseek_v3", "gpt_oss"]
# Issue 49's families whose router or attention is new (GLM's V3 router with partial rotary; Llama 4's top-1
# sigmoid scaling the input, NoPE and chunked layers): TES only, killed and resumed (the CI budget; every
# method's training step on them is tests/core/test_families_parity.py's).
ROUND2 = ["glm4_moe", "llama4_text"]
# The hybrids (Mamba-2, Gated DeltaNet), TES only as ROUND2; not in lm-eval's comparison (its 1e-4 absolute
# tolerance on summed log-likelihoods near -130 is 8e-7 relative, which Qwen3-Next's delta rule's rounding reaches).
HYBRIDS = ["granitemoehybrid", "qwen3_next"]


def transformers_saved(variant: str, folder, monkeypatch):
    """tests/tiny_families.py's model of `variant`, saved by transformers at the tiny tokenizer's vocabulary and
    with positions for a benchmark question, beside that tokenizer: (transformers' model, folder)."""
    base = read_config(tiny_checkpoint())
    for key in ("vocab_size", "pad_token_id", "eos_token_id"):
        monkeypatch.setitem(tiny_families.COMMON, key, getattr(base, key))
    for switches in (tiny_families.MLA, tiny_families.VARIANTS[variant]):
        if "max_position_embeddings" in switches:
            monkeypatch.setitem(switches, "max_position_embeddings", 256)
    ref = tiny_families.reference_model(variant, folder)
    return ref, with_tokenizer(folder)


def with_tokenizer(folder):
    """The tiny checkpoint's tokenizer beside the weights in `folder`."""
    base = read_config(tiny_checkpoint())
    tokenizer = tiny_checkpoint() / "tokenizer.json"
    shutil.copy(tokenizer, folder / "tokenizer.json")
    # AutoTokenizer (lm-eval's hf model) reads tokenizer.json only through a config naming the fast class;
    # without one it takes the family's own class (Llama's, for DeepSeek), whose BOS the vocabulary lacks.
    special = {t["id"]: t["content"] for t in json.loads(tokenizer.read_text())["added_tokens"]}
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
        "eos_token": special[base.eos_token_id], "pad_token": special[base.pad_token_id]}))
    return folder


@pytest.mark.parametrize("variant", VARIANTS + ROUND2 + HYBRIDS)
def test_the_pipeline_runs_on_a_transformers_saved_checkpoint(variant, tmp_path, monkeypatch):
    folder = tmp_path / "saved"
    transformers_saved(variant, folder, monkeypatch)
    monkeypatch.setattr(test_families, "family_checkpoint", lambda model_type, f: folder)
    methods = () if variant in ROUND2 + HYBRIDS else ("ce", "dual", "acs")
    test_families.test_the_pipeline_runs_on_each_new_family(tiny_families.family_of(variant), tmp_path, methods)


@pytest.mark.parametrize("variant", VARIANTS + ROUND2 + HYBRIDS)
def test_a_hub_id_loads_from_an_offline_cache_with_transformers_logits(variant, tmp_path, monkeypatch, offline):
    """The hub path (HF_HUB_OFFLINE=1, a cache laid out as huggingface_hub writes it) gives transformers' logits."""
    ref, folder = transformers_saved(variant, tmp_path / "saved", monkeypatch)
    populate_hub_cache(tmp_path / "cache", f"org/{variant}-tiny", folder)
    ours = minimoe.from_pretrained(f"org/{variant}-tiny", cache_dir=tmp_path / "cache")
    assert type(ours).__module__.startswith("minimoe") and ours.config.model_type == tiny_families.family_of(variant)
    ids, mask = batch(vocab=ref.config.vocab_size)
    with torch.no_grad():
        assert rel_err(ours(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits, mask) <= FP32_TOL
