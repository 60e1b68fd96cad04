"""The whole pipeline on a tiny checkpoint of each family beyond the paper's two (the hybrids included), saved by
transformers 4.57: train.py
(TES over every MoE layer, killed after epoch 1 and resumed), evaluate.py on the run, sweep.py --models on the folder;
and a hub id from an offline cache (lm-eval's model on them: tests/integrations/test_lm_eval.py).

One method per family, and it is TES: what a family changes (its router, its dense and sparse layers, its checkpoint
names) every method meets through the same code, and TES touches the most of it (an error head on every sparse
layer, trained, checkpointed and resumed). Each method is run on each family's router by
tests/core/decoder/test_families_parity.py (a training step reaching every LoRA tensor and the method's head), and every
method trains, resumes and is evaluated through train.py on tiny OLMoE by tests/cli/test_train_cli.py. So the
pipeline runs once per family in CI (the budget: docs/install.md); MINIMOE_ALL_FAMILIES=1 adds CE, Dual Affinity
and ACS to each."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

import minimoe
import tests.tiny_families as tiny_families
from minimoe.cli import evaluate, sweep, train
from minimoe.core.decoder.family_record import FAMILIES
from minimoe.loading.config_json import read_config
from minimoe.making.tiny import tiny_checkpoint
from minimoe.study.grid import guess_recipe
from tests.conftest import ALL_FAMILIES, TRANSFORMERS_5_ONLY
from tests.core.decoder.test_families_parity import FP32_TOL, batch, rel_err
from tests.core.decoder.test_model import reference_model
from tests.kill import killed_after
from tests.loading.test_checkpoint import offline, populate_hub_cache  # noqa: F401  (offline: a fixture)

# tests/tiny_families.py's variants: V2's group-limited top-K with low-rank q, V3's sigmoid scores with the
# correction bias and YaRN, gpt-oss's sinks, sliding layers, biases and YaRN.
VARIANTS = ["deepseek_v2-group", "deepseek_v3", "gpt_oss"]
# Issue 49's families whose router or attention is new (GLM's V3 router with partial rotary; Llama 4's top-1
# sigmoid scaling the input, NoPE and chunked layers): tests/tiny_families.py's variants too.
ROUND2 = ["glm4_moe", "llama4_text"]
# tests/core/decoder/test_model.py's families, with minimoe/making/tiny.py's switches (dense layers, shared experts,
# windows, OLMo-2's norm placement).
FAMILY_SWITCHES = ["qwen3_moe", "qwen2_moe", "mixtral", "granitemoeshared", "flex_olmo"]
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
    ref = reference_model(tiny_families.variant_config(variant), folder)
    return ref, with_tokenizer(folder)


def saved(name: str, tmp_path, monkeypatch):
    """A tiny checkpoint of `name` (a VARIANTS, ROUND2 or FAMILY_SWITCHES entry) that transformers saved, beside
    the tiny tokenizer."""
    if name in VARIANTS + ROUND2 + HYBRIDS + ROUND3_HUB:
        return transformers_saved(name, tmp_path / "saved", monkeypatch)[1]
    from tests.core.decoder.test_model import tiny
    base = read_config(tiny_checkpoint())
    reference_model(tiny(name, vocab_size=base.vocab_size, pad_token_id=base.pad_token_id,
                         eos_token_id=base.eos_token_id, max_position_embeddings=256), folder := tmp_path / "ref")
    return with_tokenizer(folder)


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


@pytest.mark.parametrize("name", [*FAMILY_SWITCHES, *VARIANTS, *ROUND2, *HYBRIDS])
def test_the_pipeline_runs_on_a_transformers_saved_checkpoint(name, tmp_path, monkeypatch):
    """A random tiny model of the family, so the numbers are not the point: every step runs, and TES's heads sit
    on the family's sparse layers."""
    folder = saved(name, tmp_path, monkeypatch)
    model_type = read_config(folder).model_type
    runs = tmp_path / "runs"
    common = ["--model", str(folder), "--out-dir", str(runs), "--data-dir", str(tmp_path / "splits"),
              "--max-train-examples", "8", "--batch-size", "8", "--quiet", "--no-test-eval", "--layers", "all"]
    for method in ("ce", "dual", "acs") if os.environ.get(ALL_FAMILIES) == "1" else ():
        train.main([*common, "--epochs", "1", "--method", method, "--run-name", method])
    tes = [*common, "--epochs", "2", "--method", "tes", "--run-name", "tes"]
    with pytest.raises(SystemExit, match="stopped after epoch 1"), killed_after(epochs=1):
        train.main(tes)
    train.main([*tes, "--resume"])
    assert json.loads((runs / "tes" / "config.json").read_text())["recipe"] == FAMILIES[model_type].recipe
    tensors = load_file(runs / "tes" / "checkpoints" / "epoch-2" / "adapter.safetensors")
    assert {int(k.split(".")[2]) for k in tensors if ".router.error_head." in k} == set(read_config(folder).sparse_layers)
    metrics = evaluate.main(["--adapter", str(runs / "tes"), "--eval-dir", str(tmp_path / "eval"),
                             "--eval-batch-size", "8", "--split", "val"])
    assert 0 <= metrics["accuracy"] <= 1
    cells = sweep.main(["--models", str(folder), "--benchmarks", "sciq", "--rows", "CE", "--seeds", "42",
                        "--out-dir", str(tmp_path / "sweep"), "--dry-run", "--", "--max-train-examples", "8"])
    assert [c.model for c in cells] == [str(folder)] and guess_recipe(str(folder)) == FAMILIES[model_type].recipe


# Round 3's families whose hub path runs here too, under transformers 5.23 (tf5: their oracle)
ROUND3_HUB = ["qwen3_5_moe", "lfm2_moe", "nemotron_h", "deepseek_v32", "glm_moe_dsa", "gemma4_text", "granitemoe_swa",
              "mimo_v2_flash"]


@pytest.mark.parametrize("variant", VARIANTS + ROUND2 + HYBRIDS + tiny_families.declared(ROUND3_HUB))
def test_a_hub_id_loads_from_an_offline_cache_with_transformers_logits(variant, tmp_path, monkeypatch, offline):
    """The hub path (HF_HUB_OFFLINE=1, a cache laid out as huggingface_hub writes it) gives transformers' logits
    (Qwen3.5-MoE's: transformers 5.23's, a tf5 case)."""
    ref, folder = transformers_saved(variant, tmp_path / "saved", monkeypatch)
    populate_hub_cache(tmp_path / "cache", f"org/{variant}-tiny", folder)
    ours = minimoe.from_pretrained(f"org/{variant}-tiny", cache_dir=tmp_path / "cache")
    assert type(ours).__module__.startswith("minimoe") and ours.config.model_type == tiny_families.family_of(variant)
    ids, mask = batch(ours, vocab=ref.config.vocab_size)  # clear of routing and selection ties
    with torch.no_grad():
        assert rel_err(ours(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits, mask) <= FP32_TOL


# Round 3 (issue 56): transformers-5-only families. Their oracle tests run in the tf5 environment
# (tests/core/decoder/test_families_parity.py); here, in the main one, every method trains on the family's tiny checkpoint.
ROUND3 = sorted(TRANSFORMERS_5_ONLY)  # conftest's one list of them
METHOD_FLAGS = ["ce", "dual", "tes", "acs", "densemixer", "router", "esft"]


@pytest.mark.parametrize("model_type", ROUND3)
def test_every_method_trains_a_few_steps_on_the_tiny_checkpoint(model_type, tmp_path):
    """--model tiny:<model_type>, each built-in method and baseline: two steps of 4 questions, the loss finite."""
    common = ["--model", f"tiny:{model_type}", "--out-dir", str(tmp_path / "runs"), "--data-dir",
              str(tmp_path / "splits"), "--max-train-examples", "8", "--batch-size", "4", "--epochs", "1",
              "--quiet", "--no-test-eval", "--layers", "all"]
    for method in METHOD_FLAGS:
        train.main([*common, "--method", method, "--run-name", method])
        steps = [json.loads(line) for line in (tmp_path / "runs" / method / "metrics.jsonl").read_text().splitlines()]
        losses = [s["loss"] for s in steps if "loss" in s]
        assert len(losses) >= 2 and all(torch.isfinite(torch.tensor(losses))), (method, steps[:3])
