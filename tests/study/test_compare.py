"""evaluate.py compare and minimoe/study/compare.py on hand-made predictions, against direct computation:
McNemar through scipy's exact binomial test on hand-counted discordant questions (and the binomial
sum written out), the bootstrap redrawn here resample by resample with the same fixed seed, the
differences and counts recounted from the written files; and the inputs it must refuse."""
import json
import math

import numpy as np
import pytest
from scipy.stats import binomtest

from minimoe.cli import evaluate
from minimoe.study import compare


def reference_bootstrap(differences, resamples, seed=compare.BOOTSTRAP_SEED, level=0.95):
    """The documented draws, done the slow way: per resample the seeds, then the questions, with
    replacement; the mean over the drawn [seed, question] block."""
    d = np.asarray(differences, dtype=np.float64)
    n_seeds, n_questions = d.shape
    rng = np.random.default_rng(seed)
    means = []
    for _ in range(resamples):
        seeds = rng.integers(0, n_seeds, n_seeds)
        questions = rng.integers(0, n_questions, n_questions)
        means.append(d[np.ix_(seeds, questions)].mean())
    return np.quantile(means, [(1 - level) / 2, (1 + level) / 2])


def write_evaluation(folder, ids, gold, prediction, nll, *, seed=42, method="CE", dataset="sciq"):
    folder.mkdir(parents=True)
    with open(folder / "predictions.jsonl", "w") as f:
        for i, g, p, n in zip(ids, gold, prediction, nll):
            f.write(json.dumps({"id": i, "gold": int(g), "prediction": int(p), "correct": bool(p == g),
                                "choice_nll": float(n)}) + "\n")
    (folder / "metrics.json").write_text(json.dumps({"method": method, "seed": seed, "dataset": dataset,
                                                     "split": "test", "settings": {},
                                                     "accuracy": float(np.mean(np.equal(prediction, gold)))}))
    return folder


def hand_made(tmp_path, seeds=(42, 43, 45), questions=60):
    """Per seed: a control A and a method B, 4 choices, B right more often; B's file in another order."""
    rng = np.random.default_rng(7)
    ids = [f"sciq:test:{i}" for i in range(questions)]
    gold = rng.integers(0, 4, questions)
    pairs = []
    for seed in seeds:
        pred_a = np.where(rng.random(questions) < 0.55, gold, (gold + 1) % 4)
        pred_b = np.where(rng.random(questions) < 0.7, gold, np.where(rng.random(questions) < 0.5, pred_a, (gold + 2) % 4))
        nll_a, nll_b = rng.gamma(2.0, 0.5, questions), rng.gamma(2.0, 0.45, questions)
        a = write_evaluation(tmp_path / f"A-seed{seed}", ids, gold, pred_a, nll_a, seed=seed)
        order = rng.permutation(questions)
        b = write_evaluation(tmp_path / f"B-seed{seed}", [ids[i] for i in order], gold[order], pred_b[order],
                             nll_b[order], seed=seed, method="ACS-IS")
        pairs.append(((a, pred_a, nll_a), (b, pred_b, nll_b)))
    return gold, pairs


def test_mcnemar_is_scipys_exact_binomial_test_on_the_discordant_questions():
    a = np.array([1] * 20 + [1] * 3 + [0] * 11 + [0] * 6, dtype=bool)  # 3 only A right, 11 only B right
    b = np.array([1] * 20 + [0] * 3 + [1] * 11 + [0] * 6, dtype=bool)
    result = compare.mcnemar_exact(a, b)
    assert (result["a_only_correct"], result["b_only_correct"]) == (3, 11)
    assert result["p"] == pytest.approx(binomtest(11, 14, 0.5).pvalue, rel=1e-12)
    two_sided = min(1.0, 2 * sum(math.comb(14, i) for i in range(0, 4)) / 2 ** 14)  # the tail sum written out
    assert result["p"] == pytest.approx(two_sided, rel=1e-12)
    assert compare.mcnemar_exact(a, a) == {"a_only_correct": 0, "b_only_correct": 0, "p": 1.0}
    with pytest.raises(ValueError, match="one length"):
        compare.mcnemar_exact(a, b[:-1])


@pytest.mark.parametrize("shape", [(1, 40), (3, 25)])
def test_bootstrap_is_the_documented_draws_with_the_fixed_seed(shape):
    """2,500 resamples: more than one block of draws, so the blocks must continue the same stream."""
    d = np.random.default_rng(3).integers(-1, 2, shape).astype(float)
    nll = np.random.default_rng(4).normal(0, 0.2, shape)
    got = compare.paired_bootstrap(np.stack([d, nll]), resamples=2500)
    np.testing.assert_allclose(got[0], reference_bootstrap(d, 2500), rtol=0, atol=1e-12)
    np.testing.assert_allclose(got[1], reference_bootstrap(nll, 2500), rtol=0, atol=1e-12)
    again = compare.paired_bootstrap(d, resamples=2500)
    np.testing.assert_array_equal(again, got[0])  # the same draws however many measures share them
    with pytest.raises(ValueError, match="seeds, questions"):
        compare.paired_bootstrap(np.zeros(5))


def test_compare_cli_against_a_recount_of_the_files(tmp_path, capsys):
    gold, pairs = hand_made(tmp_path)
    out = tmp_path / "cmp.json"
    evaluate.main(["compare", *[str(p[0]) for pair in pairs for p in pair], "--out", str(out)])
    result = json.loads(out.read_text())
    correct_a = np.stack([pa == gold for (_, pa, _), _ in pairs]).astype(float)
    correct_b = np.stack([pb == gold for _, (_, pb, _) in pairs]).astype(float)
    nll_diff = np.stack([nb - na for (_, _, na), (_, _, nb) in pairs])
    assert result["questions"] == 60 and result["seeds"] == [42, 43, 45]
    assert (result["a"], result["b"]) == ("CE", "ACS-IS")
    assert result["accuracy_difference"] == pytest.approx(100 * (correct_b - correct_a).mean(), abs=1e-9)
    assert result["choice_nll_difference"] == pytest.approx(nll_diff.mean(), abs=1e-12)
    np.testing.assert_allclose(result["accuracy_interval"], 100 * reference_bootstrap(correct_b - correct_a, 10_000),
                               atol=1e-9)
    np.testing.assert_allclose(result["choice_nll_interval"], reference_bootstrap(nll_diff, 10_000), atol=1e-12)
    for s, ((_, pa, na), (_, pb, nb)) in zip(result["per_seed"], pairs):
        a_only, b_only = int(np.sum((pa == gold) & (pb != gold))), int(np.sum((pa != gold) & (pb == gold)))
        assert (s["mcnemar"]["a_only_correct"], s["mcnemar"]["b_only_correct"]) == (a_only, b_only)
        assert s["mcnemar"]["p"] == pytest.approx(binomtest(b_only, a_only + b_only, 0.5).pvalue, rel=1e-12)
        assert s["differing_predictions"] == int(np.sum(pa != pb)) > 0
        assert s["choice_nll_difference"] == pytest.approx((nb - na).mean(), abs=1e-12)
    assert result["differing_predictions"] == sum(int(np.sum(pa != pb)) for (_, pa, _), (_, pb, _) in pairs)
    printed = capsys.readouterr().out
    assert f"| 42 | {100 * correct_a[0].mean():.2f} | {100 * correct_b[0].mean():.2f} |" in printed
    lo, hi = result["accuracy_interval"]
    assert f"Accuracy B - A: {result['accuracy_difference']:+.2f} [{lo:+.2f}, {hi:+.2f}] points" in printed


def test_a_run_folder_stands_for_the_evaluation_its_report_reads(tmp_path):
    """RUN/eval/test, or RUN/eval/test-selected where config.json says the run was scored there."""
    gold, [((a, pa, na), (b, pb, nb))] = hand_made(tmp_path, seeds=(42,))
    for name, chosen in (("run-a", "last"), ("run-b", "selected")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"test_checkpoint": chosen}))
    (tmp_path / "run-a" / "eval").mkdir()
    a.rename(tmp_path / "run-a" / "eval" / "test")
    (tmp_path / "run-b" / "eval").mkdir()
    b.rename(tmp_path / "run-b" / "eval" / "test-selected")
    result = compare.compare_paths([tmp_path / "run-a", tmp_path / "run-b"])
    assert result["per_seed"][0]["differing_predictions"] == int(np.sum(pa != pb))
    assert compare.reported_evaluation(tmp_path / "run-b") == tmp_path / "run-b" / "eval" / "test-selected"
    (tmp_path / "run-c").mkdir()
    (tmp_path / "run-c" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="not been scored"):
        compare.compare_paths([tmp_path / "run-a", tmp_path / "run-c"])
    with pytest.raises(FileNotFoundError, match="neither an evaluation folder"):
        compare.compare_paths([tmp_path / "run-a", tmp_path])


def test_refuses_evaluations_of_other_questions_and_mismatched_pairs(tmp_path, capsys):
    gold, pairs = hand_made(tmp_path, seeds=(42, 43))
    (a42, pa, na), (b42, pb, nb) = pairs[0]
    (a43, _, _), (b43, _, _) = pairs[1]
    ids = [f"sciq:test:{i}" for i in range(60)]
    fewer = write_evaluation(tmp_path / "fewer", ids[:50], gold[:50], pb[:50], nb[:50])
    with pytest.raises(ValueError, match="different questions"):
        compare.compare_paths([a42, fewer])
    other_gold = write_evaluation(tmp_path / "other-gold", ids, (gold + 1) % 4, pb, nb)
    with pytest.raises(ValueError, match="different gold answers"):
        compare.compare_paths([a42, other_gold])
    fewer43 = write_evaluation(tmp_path / "fewer43", ids[:50], gold[:50], pb[:50], nb[:50], seed=43)
    with pytest.raises(ValueError, match="different questions"):  # a second pair on other questions
        compare.compare_paths([a42, b42, fewer43, b43])
    with pytest.raises(ValueError, match="seed 42.*seed 43"):
        compare.compare_paths([a42, b43])
    with pytest.raises(ValueError, match="given twice"):
        compare.compare_paths([a42, b42, a42, b42])
    with pytest.raises(ValueError, match="another seed"):
        compare.compare_paths([a42, b42, write_evaluation(tmp_path / "A-again", ids, gold, pa, na, seed=42),
                               write_evaluation(tmp_path / "B-again", ids, gold, pb, nb, seed=42, method="ACS-IS")])
    with pytest.raises(ValueError, match="B side mixes methods"):
        compare.compare_paths([a42, b42, a43, write_evaluation(tmp_path / "TES", ids, gold, pb, nb, seed=43, method="TES-IS")])
    twice = write_evaluation(tmp_path / "twice", ids[:2] + ids[:1], gold[:3], pb[:3], nb[:3])
    with pytest.raises(ValueError, match="appears twice"):
        compare.compare_paths([a42, twice])
    with pytest.raises(SystemExit):  # an odd count: argparse's error, exit status 2
        evaluate.main(["compare", str(a42), str(b42), str(a43)])
    assert "expected pairs A B" in capsys.readouterr().err
