"""Paired comparison of two methods scored on the same questions: `evaluate.py compare` and the
sweep report's group table.

A pair is (A, B) = (control, method), e.g. (CE, ACS-IS), one pair per seed; every difference is
B minus A. The unit is the question: each evaluation's predictions.jsonl gives, per question, whether
the mean-token prediction is right and the length-normalised answer-choice NLL
(minimoe/evaluation/accuracy.py). Numbers:
- accuracy difference, in points, averaged over the pairs (seeds), with a 95% percentile interval
  from a paired bootstrap over questions and seeds (`paired_bootstrap`): each resample draws the
  seeds with replacement and the questions with replacement, one question draw for every drawn
  seed (a question's outcomes under different seeds are not independent: it is the same question),
  and averages the B - A differences over the drawn (seed, question) cells. The resampling seed is
  fixed (BOOTSTRAP_SEED), so a report reads the same every time it is written. With one seed this
  is the ordinary paired bootstrap over questions; with three, the seed draw is coarse, but it is
  what lets seed-to-seed spread widen the interval.
- the exact McNemar test per seed (`mcnemar_exact`): under H0 a discordant question is as likely to
  favour A as B, so B's count among the n discordant ones is Binomial(n, 1/2); the two-sided p is
  scipy.stats.binomtest's. No discordant question: p = 1 (no evidence either way).
- the choice-NLL difference (mean over questions and seeds; the same bootstrap gives its interval),
  and how many questions' predictions differ (the chosen answer, right or wrong), per seed and in all.

Inputs are refused unless they answer the same questions: every evaluation must list the same
question ids with the same gold answers (order may differ; B is aligned to A by id), and the two
sides of a pair must not carry different seeds.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.stats import binomtest

from minimoe.evaluation.diagnostics import row_label
from minimoe.evaluation.folders import METRICS, PREDICTIONS, test_evaluation

BOOTSTRAP_SEED = 2024  # fixed: the same inputs give the same interval in every report
BOOTSTRAP_RESAMPLES = 10_000
LEVEL = 0.95
BLOCK = 1000  # resamples whose draw counts are held at once ([BLOCK, Q] floats)


# ---- statistics ---------------------------------------------------------------------------------

def mcnemar_exact(a_correct, b_correct) -> dict:
    """Exact two-sided McNemar test on one seed's paired outcomes ([Q] booleans each)."""
    a, b = np.asarray(a_correct, dtype=bool), np.asarray(b_correct, dtype=bool)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"mcnemar_exact: expected two [Q] vectors of one length, got {a.shape} and {b.shape}")
    a_only, b_only = int(np.sum(a & ~b)), int(np.sum(~a & b))
    n = a_only + b_only
    p = 1.0 if n == 0 else float(binomtest(b_only, n, 0.5, alternative="two-sided").pvalue)
    return {"a_only_correct": a_only, "b_only_correct": b_only, "p": p}


def paired_bootstrap(differences, *, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED,
                     level: float = LEVEL) -> np.ndarray:
    """differences [..., S, Q]: B - A per seed and question, for one or more measures that share the
    draws -> [..., 2] percentile interval of the mean over (seed, question) cells.

    Resample r draws seeds = rng.integers(0, S, S), then questions = rng.integers(0, Q, Q), and takes
    differences[..., seeds, :][..., questions].mean(). Computed here from the draw counts, a block of
    resamples at a time: sum_{s,q} seed_count[s] * d[s, q] * question_count[q], the same sums without
    copying [S, Q] blocks.
    """
    d = np.asarray(differences, dtype=np.float64)
    if d.ndim < 2 or 0 in d.shape[-2:]:
        raise ValueError(f"paired_bootstrap: expected [..., seeds, questions] with both > 0, got shape {d.shape}")
    if not 0 < level < 1 or resamples < 1:
        raise ValueError(f"paired_bootstrap: level {level} must be in (0, 1) and resamples {resamples} >= 1")
    n_seeds, n_questions = d.shape[-2:]
    rng = np.random.default_rng(seed)
    means = np.empty((resamples, *d.shape[:-2]))
    for start in range(0, resamples, BLOCK):
        block = range(start, min(start + BLOCK, resamples))
        seed_counts = np.zeros((len(block), n_seeds))  # [R, S]
        question_counts = np.zeros((len(block), n_questions))  # [R, Q]
        for i in range(len(block)):  # the draws in resample order: seeds, then questions
            seed_counts[i] = np.bincount(rng.integers(0, n_seeds, n_seeds), minlength=n_seeds)
            question_counts[i] = np.bincount(rng.integers(0, n_questions, n_questions), minlength=n_questions)
        means[block] = np.einsum("rs,...sq,rq->r...", seed_counts, d, question_counts) / (n_seeds * n_questions)
    tails = [(1 - level) / 2, (1 + level) / 2]
    return np.moveaxis(np.quantile(means, tails, axis=0), 0, -1)


# ---- evaluations --------------------------------------------------------------------------------

@dataclass
class Predictions:
    """One evaluation's per-question outcomes, in the order of its predictions.jsonl."""
    folder: Path
    ids: list[str]
    gold: np.ndarray  # [Q] int
    prediction: np.ndarray  # [Q] int, the mean-token choice (the paper's accuracy)
    choice_nll: np.ndarray  # [Q] float
    metrics: dict  # its metrics.json ({} where there is none)

    @property
    def correct(self) -> np.ndarray:
        return self.prediction == self.gold

    @property
    def seed(self) -> int | None:
        return self.metrics.get("seed")

    @property
    def label(self) -> str:
        return row_label(self.metrics) if "method" in self.metrics else self.folder.name

    def aligned_to(self, ids: list[str]) -> "Predictions":
        where = {q: i for i, q in enumerate(self.ids)}
        order = np.array([where[q] for q in ids], dtype=np.int64)
        return Predictions(self.folder, list(ids), self.gold[order], self.prediction[order],
                           self.choice_nll[order], self.metrics)


def reported_evaluation(path) -> Path:
    """The evaluation folder that a report reads for `path`: an evaluation folder (predictions.jsonl)
    as it is, a run folder (config.json) through `test_evaluation`."""
    path = Path(path)
    if path.is_file() and path.name in (PREDICTIONS, METRICS):
        path = path.parent
    if (path / PREDICTIONS).is_file():
        return path
    if (path / "config.json").is_file():
        return test_evaluation(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such run or evaluation folder")
    raise FileNotFoundError(f"{path}: neither an evaluation folder ({PREDICTIONS}) nor a run folder (config.json)")


def read_predictions(path) -> Predictions:
    """A run or evaluation folder (`reported_evaluation`) -> its Predictions; ids must be unique."""
    folder = reported_evaluation(path)
    file = folder / PREDICTIONS
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no predictions; the run has not been scored on its test split "
                                f"(not finished, or trained with --no-test-eval)")
    ids, gold, prediction, nll = [], [], [], []
    for n, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        try:
            record = json.loads(line)
            ids.append(str(record["id"]))
            gold.append(int(record["gold"]))
            prediction.append(int(record["prediction"]))
            nll.append(float(record["choice_nll"]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{file}:{n}: expected a JSON object with id, gold, prediction and choice_nll ({e})") from None
    if not ids:
        raise ValueError(f"{file}: no predictions")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{file}: a question id appears twice")
    metrics_file = folder / METRICS
    metrics = json.loads(metrics_file.read_text(encoding="utf-8")) if metrics_file.is_file() else {}
    return Predictions(folder, ids, np.array(gold), np.array(prediction), np.array(nll, dtype=np.float64), metrics)


def check_same_questions(evaluations: list[Predictions]) -> list[Predictions]:
    """Every evaluation aligned to the first's question order; refused unless all hold the same
    question ids with the same gold answers."""
    first = evaluations[0]
    aligned = [first]
    for other in evaluations[1:]:
        missing, extra = set(first.ids) - set(other.ids), set(other.ids) - set(first.ids)
        if missing or extra:
            raise ValueError(f"{other.folder} and {first.folder} were scored on different questions "
                             f"({len(missing)} of {len(first.ids)} missing, {len(extra)} others; e.g. "
                             f"{sorted(missing or extra)[0]!r}); compare only evaluations of the same split")
        other = other.aligned_to(first.ids)
        if np.any(other.gold != first.gold):
            q = first.ids[int(np.argmax(other.gold != first.gold))]
            raise ValueError(f"{other.folder} and {first.folder} give question {q!r} different gold answers: "
                             f"not the same data")
        aligned.append(other)
    return aligned


# ---- the comparison -----------------------------------------------------------------------------

def compare_pairs(pairs: list[tuple[Predictions, Predictions]], **bootstrap) -> dict:
    """(A, B) per seed -> the numbers of the module docstring, as a JSON-ready dict (accuracies in points)."""
    if not pairs:
        raise ValueError("compare: no pair of evaluations")
    for a, b in pairs:
        if a.seed is not None and b.seed is not None and a.seed != b.seed:
            raise ValueError(f"{a.folder} (seed {a.seed}) and {b.folder} (seed {b.seed}): a pair is one seed of "
                             f"each method; pass them in matching order")
    folders = [p.folder.resolve() for pair in pairs for p in pair]
    if len(set(folders)) != len(folders):
        raise ValueError("compare: an evaluation is given twice")
    seeds = [a.seed if a.seed is not None else b.seed for a, b in pairs]
    if any(s is not None and seeds.count(s) > 1 for s in seeds):
        raise ValueError(f"compare: seeds {seeds}: each pair must be another seed (a seed twice counts its questions twice)")
    for side, name in ((0, "A"), (1, "B")):
        labels = {pair[side].label for pair in pairs if "method" in pair[side].metrics}
        if len(labels) > 1:
            raise ValueError(f"compare: the {name} side mixes methods ({', '.join(sorted(labels))}); every pair "
                             f"must be the same two methods, control A first")
    aligned = check_same_questions([p for pair in pairs for p in pair])
    a_side, b_side = aligned[0::2], aligned[1::2]
    correct_a = np.stack([a.correct for a in a_side]).astype(np.float64)  # [S, Q]
    correct_b = np.stack([b.correct for b in b_side]).astype(np.float64)
    nll_a = np.stack([a.choice_nll for a in a_side])
    nll_b = np.stack([b.choice_nll for b in b_side])
    (acc_lo, acc_hi), (nll_lo, nll_hi) = paired_bootstrap(np.stack([correct_b - correct_a, nll_b - nll_a]),
                                                          **bootstrap)
    per_seed = []
    for a, b in zip(a_side, b_side):
        per_seed.append({"seed": a.seed if a.seed is not None else b.seed,
                         "a": str(a.folder), "b": str(b.folder),
                         "accuracy_a": 100 * float(a.correct.mean()), "accuracy_b": 100 * float(b.correct.mean()),
                         "accuracy_difference": 100 * float(b.correct.mean() - a.correct.mean()),
                         "mcnemar": mcnemar_exact(a.correct, b.correct),
                         "choice_nll_difference": float((b.choice_nll - a.choice_nll).mean()),
                         "differing_predictions": int(np.sum(a.prediction != b.prediction))})
    return {"a": a_side[0].label, "b": b_side[0].label, "questions": len(a_side[0].ids),
            "dataset": a_side[0].metrics.get("dataset"), "split": a_side[0].metrics.get("split"),
            "seeds": [s["seed"] for s in per_seed],
            "accuracy_difference": 100 * float((correct_b - correct_a).mean()),
            "accuracy_interval": [100 * float(acc_lo), 100 * float(acc_hi)],
            "choice_nll_difference": float((nll_b - nll_a).mean()),
            "choice_nll_interval": [float(nll_lo), float(nll_hi)],
            "differing_predictions": sum(s["differing_predictions"] for s in per_seed),
            "per_seed": per_seed,
            "bootstrap": {"over": "questions and seeds", "level": bootstrap.get("level", LEVEL),
                          "resamples": bootstrap.get("resamples", BOOTSTRAP_RESAMPLES),
                          "seed": bootstrap.get("seed", BOOTSTRAP_SEED)}}


def compare_paths(paths, **bootstrap) -> dict:
    """[A1, B1, A2, B2, ...] run or evaluation folders, one (A, B) pair per seed -> compare_pairs, or
    compare_losses for chat and completion evaluations (their predictions.jsonl carry a loss per example)."""
    paths = list(paths)
    if not paths or len(paths) % 2:
        raise ValueError(f"compare: expected pairs A B [A B ...], got {len(paths)} folder(s)")
    if all(scores_losses(p) for p in paths):
        read = [read_losses(p) for p in paths]
        return compare_losses(list(zip(read[0::2], read[1::2])), **bootstrap)
    read = [read_predictions(p) for p in paths]
    return compare_pairs(list(zip(read[0::2], read[1::2])), **bootstrap)


# ---- chat and completion evaluations: the held-out loss per example ----------------------------

def scores_losses(path) -> bool:
    """Whether the evaluation is a chat or completion one (evaluation/heldout.py): its metrics say perplexity."""
    metrics = reported_evaluation(path) / METRICS
    return metrics.is_file() and "perplexity" in json.loads(metrics.read_text(encoding="utf-8"))


def read_losses(path) -> tuple[Path, dict[str, float], dict]:
    """-> (folder, {example id: its mean CE per supervised token}, metrics.json)."""
    folder = reported_evaluation(path)
    losses = {}
    for n, line in enumerate((folder / PREDICTIONS).read_text(encoding="utf-8").splitlines(), 1):
        try:
            record = json.loads(line)
            losses[str(record["id"])] = float(record["loss"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{folder / PREDICTIONS}:{n}: expected a JSON object with id and loss ({e})") from None
    return folder, losses, json.loads((folder / METRICS).read_text(encoding="utf-8"))


def compare_losses(pairs, **bootstrap) -> dict:
    """(A, B) per seed, each read_losses' -> the mean over examples (and seeds) of B's loss minus A's, with the
    paired bootstrap's interval over examples and seeds (`paired_bootstrap`); refused unless every
    evaluation scored the same example ids."""
    ids = sorted(pairs[0][0][1])
    for folder, losses, _ in (side for pair in pairs for side in pair):
        if sorted(losses) != ids:
            raise ValueError(f"{folder} and {pairs[0][0][0]} were scored on different examples; compare only "
                             f"evaluations of the same split")
    a = np.array([[p[0][1][q] for q in ids] for p in pairs])  # [S, Q]
    b = np.array([[p[1][1][q] for q in ids] for p in pairs])
    lo, hi = paired_bootstrap(b - a, **bootstrap)
    def label(side):
        folder, _, metrics = side
        return row_label(metrics) if "method" in metrics else folder.name
    return {"a": label(pairs[0][0]), "b": label(pairs[0][1]),
            "examples": len(ids), "dataset": pairs[0][0][2].get("dataset"), "split": pairs[0][0][2].get("split"),
            "loss_difference": float((b - a).mean()), "loss_interval": [float(lo), float(hi)],
            "per_seed": [{"seed": p[0][2].get("seed"), "a": str(p[0][0]), "b": str(p[1][0]),
                          "loss_a": float(x.mean()), "loss_b": float(y.mean())} for p, x, y in zip(pairs, a, b)],
            "bootstrap": {"over": "examples and seeds", "level": bootstrap.get("level", LEVEL),
                          "resamples": bootstrap.get("resamples", BOOTSTRAP_RESAMPLES),
                          "seed": bootstrap.get("seed", BOOTSTRAP_SEED)}}


def interval_text(mean: float, interval, digits: int) -> str:
    return f"{mean:+.{digits}f} [{interval[0]:+.{digits}f}, {interval[1]:+.{digits}f}]"


def p_text(p: float) -> str:
    return f"{p:.3g}"


def pair_table(result: dict) -> str:
    """Markdown: one line per seed, then the pooled line with the bootstrap intervals."""
    if "loss_difference" in result:
        return loss_table(result)
    lines = [f"B = {result['b']} vs A = {result['a']}: {result['dataset'] or '?'} {result['split'] or ''}, "
             f"{result['questions']} questions; differences are B - A, intervals {100 * result['bootstrap']['level']:g}% "
             f"(paired bootstrap over questions and seeds, {result['bootstrap']['resamples']} resamples, "
             f"seed {result['bootstrap']['seed']})", "",
             "| Seed | A acc (%) | B acc (%) | B - A (points) | A only right | B only right | McNemar p "
             "| Predictions differing | Choice NLL B - A |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in result["per_seed"]:
        m = s["mcnemar"]
        lines.append(f"| {s['seed']} | {s['accuracy_a']:.2f} | {s['accuracy_b']:.2f} | {s['accuracy_difference']:+.2f} "
                     f"| {m['a_only_correct']} | {m['b_only_correct']} | {p_text(m['p'])} | {s['differing_predictions']} "
                     f"| {s['choice_nll_difference']:+.4f} |")
    if len(result["per_seed"]) > 1:
        mean_a = sum(s["accuracy_a"] for s in result["per_seed"]) / len(result["per_seed"])
        mean_b = sum(s["accuracy_b"] for s in result["per_seed"]) / len(result["per_seed"])
        acc, nll = (f"{result['accuracy_difference']:+.2f}", f"{result['choice_nll_difference']:+.4f}")
        lines.append(f"| all | {mean_a:.2f} | {mean_b:.2f} | {acc} | | | | {result['differing_predictions']} | {nll} |")
    lines += ["", f"Accuracy B - A: {interval_text(result['accuracy_difference'], result['accuracy_interval'], 2)} "
                  f"points; choice NLL B - A: {interval_text(result['choice_nll_difference'], result['choice_nll_interval'], 4)}"]
    return "\n".join(lines) + "\n"


def loss_table(result: dict) -> str:
    """compare_losses' result as Markdown: each seed's mean loss per example, then the paired difference."""
    lines = [f"B = {result['b']} vs A = {result['a']}: {result['dataset'] or '?'} {result['split'] or ''}, "
             f"{result['examples']} examples; loss = an example's mean CE per supervised token, B - A, interval "
             f"{100 * result['bootstrap']['level']:g}% (paired bootstrap over examples and seeds)", "",
             "| Seed | A loss | B loss | B - A |", "|---|---|---|---|"]
    lines += [f"| {s['seed']} | {s['loss_a']:.4f} | {s['loss_b']:.4f} | {s['loss_b'] - s['loss_a']:+.4f} |"
              for s in result["per_seed"]]
    lines.append(f"| all | | | {interval_text(result['loss_difference'], result['loss_interval'], 4)} |")
    return "\n".join(lines) + "\n"
