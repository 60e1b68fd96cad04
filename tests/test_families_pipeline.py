"""The whole pipeline on transformers-saved tiny checkpoints of DeepSeek-V2, DeepSeek-V3 and gpt-oss: train.py
with every method (killed and resumed), evaluate.py and sweep.py (tests/test_families.py's pipeline test, here
on a folder transformers wrote), a hub id from an offline cache, and lm-eval's model scoring a local task."""
import shutil

import pytest
import torch

import minimoe
import tests.test_families as test_families
import tests.tiny_families as tiny_families
from minimoe.loading.checkpoint import read_config
from minimoe.loading.tiny import tiny_checkpoint
from tests.test_checkpoint import offline, populate_hub_cache  # noqa: F401  (offline: a fixture)
from tests.test_families_parity import batch, rel_err

# One transformers variant per family: V2's group-limited top-K with low-rank q, V3's sigmoid scores with the
# correction bias and YaRN, gpt-oss's sinks, sliding layers, biases and YaRN.
VARIANTS = ["deepseek_v2-group", "deepseek_v3", "gpt_oss"]


def transformers_saved(variant: str, folder, monkeypatch):
    """tests/tiny_families.py's model of `variant`, saved by transformers at the tiny tokenizer's vocabulary,
    beside that tokenizer: (transformers' model, folder)."""
    base = read_config(tiny_checkpoint())
    for key in ("vocab_size", "pad_token_id", "eos_token_id"):
        monkeypatch.setitem(tiny_families.COMMON, key, getattr(base, key))
    ref = tiny_families.reference_model(variant, folder)
    shutil.copy(tiny_checkpoint() / "tokenizer.json", folder / "tokenizer.json")
    return ref, folder


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_pipeline_runs_on_a_transformers_saved_checkpoint(variant, tmp_path, monkeypatch):
    folder = tmp_path / "saved"
    transformers_saved(variant, folder, monkeypatch)
    monkeypatch.setattr(test_families, "family_checkpoint", lambda model_type, f: folder)
    test_families.test_the_pipeline_runs_on_each_new_family(tiny_families.family_of(variant), tmp_path)
