"""Does bf16 change the default run's answers? Paired predictions of two runs, fp32 against bf16.

    python train.py --dtype float32 --run-name fp32 && python train.py --dtype bfloat16 --run-name bf16
    python bench/dtype_parity.py runs/fp32 runs/bf16

For each evaluation both run folders hold (eval/test-base: the base model before training; eval/test:
after the epoch), over the same test examples: the share of examples with the same predicted answer,
both accuracies, and an exact McNemar test of the paired accuracy difference (a two-sided binomial
test, scipy.stats.binomtest, on the discordant pairs: right in one dtype and wrong in the other).
The bar (issue 23): >= 98% the same answer, and McNemar's p >= 0.05. The table goes to stdout and
bench/results/dtype-parity.md.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from scipy.stats import binomtest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minimoe.evaluation.folders import PREDICTIONS, eval_dir  # noqa: E402
from bench.common import write_report  # noqa: E402


def read_predictions(folder: Path) -> dict[str, dict]:
    lines = (folder / PREDICTIONS).read_text(encoding="utf-8").splitlines()
    return {r["id"]: r for r in map(json.loads, lines)}


def compare(a: dict[str, dict], b: dict[str, dict]) -> dict:
    """Paired comparison of two prediction sets over the same example ids."""
    if a.keys() != b.keys():
        raise ValueError(f"the two evaluations scored different examples ({len(a)} and {len(b)} ids)")
    same = sum(a[i]["prediction"] == b[i]["prediction"] for i in a)
    only_a = sum(a[i]["correct"] and not b[i]["correct"] for i in a)  # discordant pairs
    only_b = sum(b[i]["correct"] and not a[i]["correct"] for i in a)
    p = binomtest(only_a, only_a + only_b, 0.5).pvalue if only_a + only_b else 1.0
    return {"n": len(a), "agreement": same / len(a), "accuracy_a": sum(r["correct"] for r in a.values()) / len(a),
            "accuracy_b": sum(r["correct"] for r in b.values()) / len(b), "only_a": only_a, "only_b": only_b,
            "mcnemar_p": p, "passes": same / len(a) >= 0.98 and p >= 0.05}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("fp32_run", type=Path)
    p.add_argument("bf16_run", type=Path)
    args = p.parse_args(argv)
    lines = ["| evaluation | examples | same answer | accuracy fp32 | accuracy bf16 | right only in fp32 / only in bf16 "
             "| exact McNemar p | bar (>= 98%, p >= 0.05) |", "|---|---|---|---|---|---|---|---|"]
    for checkpoint in ("base", "last"):
        folders = [eval_dir(run, "test", checkpoint) for run in (args.fp32_run, args.bf16_run)]
        name = folders[0].name
        if not all((f / PREDICTIONS).is_file() for f in folders):
            continue
        c = compare(*map(read_predictions, folders))
        lines.append(f"| {name} | {c['n']} | {c['agreement']:.1%} | {c['accuracy_a']:.3f} | {c['accuracy_b']:.3f} | "
                     f"{c['only_a']} / {c['only_b']} | {c['mcnemar_p']:.3g} | {'met' if c['passes'] else 'NOT met'} |")
    write_report("\n".join(lines), "dtype-parity")


if __name__ == "__main__":
    main()
