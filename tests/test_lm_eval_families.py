"""lm-eval's minimoe model on a transformers-saved tiny checkpoint of each of DeepSeek-V2, DeepSeek-V3 and
gpt-oss: a local task scores as lm-eval's own `hf` model scores it on transformers, offline."""
import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
from tests.test_families_pipeline import VARIANTS, transformers_saved  # noqa: E402
from tests.test_lm_eval import TASK, evaluate, task_dir  # noqa: E402,F401  (task_dir: a fixture)


@pytest.mark.parametrize("variant", VARIANTS)
def test_local_task_scores_as_lm_evals_hf_model(variant, task_dir, tmp_path, monkeypatch):
    _, folder = transformers_saved(variant, tmp_path / "saved", monkeypatch)
    ours = evaluate("minimoe", f"pretrained={folder},dtype=float32", task_dir)
    theirs = evaluate("hf", f"pretrained={folder},dtype=float32,device=cpu", task_dir)
    a, b = ours["results"][TASK], theirs["results"][TASK]
    assert (a["acc,none"], a["acc_norm,none"]) == (b["acc,none"], b["acc_norm,none"])
    ll = lambda result: [r[0] for s in result["samples"][TASK] for r in s["filtered_resps"]]
    assert ll(ours) == pytest.approx(ll(theirs), abs=1e-4)
    assert len(set(round(x, 3) for x in ll(ours))) > len(ll(ours)) // 2  # spread, not a constant
