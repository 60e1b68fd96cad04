"""Where evaluations live: a run's evaluation folders under RUN/eval/, and the files in one.

    RUN/eval/<split>            the last epoch's adapter (train.py's test scoring, evaluate.py --adapter RUN)
    RUN/eval/<split>-selected   the validation-NLL-selected epoch's (--checkpoint selected)
    RUN/eval/<split>-base       the base model before training (train.py --zero-shot)
and in each one (evaluation.score):
    metrics.json                the numbers, identity keys and "diagnostics"
    predictions.jsonl           one line per example
    tokens-<split>.npz          per gold-answer-token arrays (tokens-train.npz too, with train diagnostics)
    error-prediction-layer<l>.png, error-prediction-pooled.png   an error-predicting method's decile curves
Every writer and reader of these names (evaluation, compare, sweep, runs, train.py) takes them from
here, so the layout can change in one place. No torch: compare.py and the report read it.
"""
from __future__ import annotations

import json
from pathlib import Path

EVAL = "eval"  # RUN/eval
METRICS = "metrics.json"
PREDICTIONS = "predictions.jsonl"
CHECKPOINTS = ("last", "selected", "base")  # what an evaluation folder's suffix names


def eval_dir(run, split: str = "test", checkpoint: str | None = None) -> Path:
    """RUN/eval/<split> for the last epoch (checkpoint None or "last"), else RUN/eval/<split>-<checkpoint>."""
    if checkpoint is not None and checkpoint not in CHECKPOINTS:
        raise ValueError(f"checkpoint {checkpoint!r}: expected one of {CHECKPOINTS}")
    return Path(run) / EVAL / (split if checkpoint in (None, "last") else f"{split}-{checkpoint}")


def is_base(folder) -> bool:
    """An evaluation of the base model (train.py --zero-shot), not of anything the run trained."""
    return Path(folder).name.endswith("-base")


def tokens_file(split: str) -> str:
    return f"tokens-{split}.npz"


def plot_file(layer: int | None) -> str:
    """An error-predicting layer's decile plot; None: the plot of every such layer pooled."""
    return "error-prediction-pooled.png" if layer is None else f"error-prediction-layer{layer}.png"


def test_evaluation(run) -> Path:
    """The evaluation a run's report reads: RUN/eval/test, or RUN/eval/test-selected where the run's
    config.json says train.py scored the validation-selected epoch instead (test_checkpoint "selected":
    the OLMoE affinity-tuned group)."""
    config = Path(run) / "config.json"
    chosen = json.loads(config.read_text(encoding="utf-8")).get("test_checkpoint") if config.is_file() else None
    return eval_dir(run, "test", "selected" if chosen == "selected" else None)


def is_run(folder) -> bool:
    """A train.py run folder as the report and compare see one: its config.json and its eval/ folder."""
    return (Path(folder) / "config.json").is_file() and (Path(folder) / EVAL).is_dir()


def report_evaluations(run, split: str = "test") -> list[Path]:
    """The metrics.json files that stand for a run in a report: its evaluation of `split` (for test the
    one `test_evaluation` names, as compare reads) and its base model's (--zero-shot). Other folders
    under RUN/eval, a re-evaluation into eval/again say, are not the run's result and are left out."""
    main = test_evaluation(run) if split == "test" else eval_dir(run, split)
    return [f for f in (main / METRICS, eval_dir(run, split, "base") / METRICS) if f.is_file()]
