"""lm-eval's minimoe model on a transformers-saved tiny checkpoint of each of today's families (Qwen3-MoE,
Qwen2-MoE, Mixtral, DeepSeek-V2, DeepSeek-V3, gpt-oss, and issue 49's FlexOlmo, GLM-4.5, Llama 4): a local task scores as lm-eval's own `hf` model
scores it on transformers, offline."""
import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
from minimoe.loading.checkpoint import read_config  # noqa: E402
from minimoe.loading.tiny import tiny_checkpoint  # noqa: E402
from tests.test_families_pipeline import ROUND2, VARIANTS, transformers_saved, with_tokenizer  # noqa: E402
from tests.integrations.test_lm_eval import TASK, evaluate, task_dir  # noqa: E402,F401  (task_dir: a fixture)


def saved(name, tmp_path, monkeypatch):
    """A tiny checkpoint that transformers saved: tests/tiny_families.py's variants, tests/test_model.py's
    families (at the tokenizer's vocabulary, with positions for a question), beside the tiny tokenizer."""
    if name in VARIANTS + ROUND2:
        return transformers_saved(name, tmp_path / "saved", monkeypatch)[1]
    from tests.core.test_model import reference_model
    base = read_config(tiny_checkpoint())
    _, folder = reference_model(name, tmp_path, vocab_size=base.vocab_size, pad_token_id=base.pad_token_id,
                                eos_token_id=base.eos_token_id, max_position_embeddings=256)
    return with_tokenizer(folder)


# granitemoeshared is left out (the CI budget): Granite's path through lm-eval is test_lm_eval.py's, and its
# shared expert is the parity suite's.
@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "mixtral", *VARIANTS, "flex_olmo", *ROUND2])
def test_local_task_scores_as_lm_evals_hf_model(name, task_dir, tmp_path, monkeypatch):
    folder = saved(name, tmp_path, monkeypatch)
    ours = evaluate("minimoe", f"pretrained={folder},dtype=float32", task_dir)
    theirs = evaluate("hf", f"pretrained={folder},dtype=float32,device=cpu", task_dir)
    a, b = ours["results"][TASK], theirs["results"][TASK]
    assert (a["acc,none"], a["acc_norm,none"]) == (b["acc,none"], b["acc_norm,none"])
    ll = lambda result: [r[0] for s in result["samples"][TASK] for r in s["filtered_resps"]]
    assert ll(ours) == pytest.approx(ll(theirs), abs=1e-4)
    assert len(set(round(x, 3) for x in ll(ours))) > len(ll(ours)) // 2  # spread, not a constant
