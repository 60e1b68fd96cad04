"""The default run's training epoch, this tree against another checkout of minimoe, interleaved.

    git worktree add /tmp/minimoe-before eff8984       # or any other commit
    python bench/default_run.py --before /tmp/minimoe-before --rounds 3
    python bench/default_run.py --before /tmp/minimoe-before --after-flags "--dtype bfloat16"   # this tree in bf16

Each round runs `train.py` (the default model, SciQ, TES-IS, one epoch; `--no-test-eval
--no-zero-shot` unless --flags says otherwise) once in each tree, in an order that rotates, each a
fresh process with the same environment; a slow spell of the shared machine then hits both sides of
a round's ratio alike. Per process: the epoch (the sum of metrics.jsonl's step seconds), the
validation after it, the whole process, and its peak RSS (the child's own, from wait4). The other
tree must have weights/smollm2-135m-moe too (a symlink to this tree's will do). The table goes to
stdout and bench/results/default-run.md.

    python bench/default_run.py --before /tmp/minimoe-before --steps 12 --flags "--dtype bfloat16"

--steps N kills each process (SIGKILL) once its metrics.jsonl holds N step records, before any
validation: the step time (median over steps 2..N) and the peak RSS of training, in a fraction of an
epoch's time. The kill comes from outside, so the other tree needs no flag of this tree's.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def step_records(metrics: Path) -> list[dict]:
    """The complete step records of a metrics.jsonl being written (a last line may be torn)."""
    lines = metrics.read_text().split("\n")[:-1] if metrics.is_file() else []
    return [r for r in map(json.loads, lines) if r["kind"] == "step"]


def one_run(tree: Path, flags: list[str], steps: int | None = None) -> dict:
    """train.py in `tree`, in a fresh process and a fresh run folder -> its timings and peak RSS;
    with `steps`, killed once it has logged that many optimizer steps."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "train.py", "--out-dir", out, "--run-name", "run", "--quiet", *flags]
        env = dict(os.environ, PYTHONPATH=str(tree))
        metrics, log = Path(out) / "run" / "metrics.jsonl", Path(out) / "train.log"
        t0 = time.perf_counter()
        with open(log, "w") as output:
            child = subprocess.Popen(cmd, cwd=tree, env=env, stdout=output, stderr=subprocess.STDOUT, text=True)
        killed = False
        while not (ended := os.wait4(child.pid, os.WNOHANG if steps else 0))[0]:  # wait4: the child's own peak RSS
            if not killed and len(step_records(metrics)) >= steps:
                child.kill()
                killed = True
            time.sleep(0.05)
        _, status, usage = ended
        wall = time.perf_counter() - t0
        if os.waitstatus_to_exitcode(status) and not killed:
            raise SystemExit(f"{tree}: train.py failed:\n{log.read_text()[-3000:]}")
        records = [json.loads(line) for line in metrics.read_text().split("\n")[:-1]]
    steps = [r for r in records if r["kind"] == "step"][:steps]
    epoch = [r for r in records if r["kind"] == "epoch"]
    return {"epoch_s": sum(r["seconds"] for r in steps), "val_s": sum(r["val_seconds"] for r in epoch),
            "step_s": statistics.median(r["seconds"] for r in steps[1:] or steps),  # the first compiles kernels
            "process_s": wall, "peak_rss_gib": usage.ru_maxrss / 2**20, "steps": len(steps),
            "val_choice_nll": epoch[-1]["val_choice_nll"] if epoch else float("nan"),
            "val_accuracy": epoch[-1]["val_accuracy"] if epoch else float("nan")}


def spread(values, digits=1) -> str:
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, help="another minimoe checkout (e.g. a worktree at the old commit)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: %(default)s)")
    p.add_argument("--flags", default="--no-test-eval --no-zero-shot",
                   help="train.py flags for both sides (default: %(default)r)")
    p.add_argument("--after-flags", default="", help="extra train.py flags for this tree only")
    p.add_argument("--steps", type=int, help="kill each process once it has logged this many optimizer steps "
                   "(no validation)")
    args = p.parse_args(argv)
    sides = {"before": (Path(args.before).resolve(), shlex.split(args.flags)),
             "after": (ROOT, shlex.split(args.flags) + shlex.split(args.after_flags))}
    runs = {name: [] for name in sides}
    names = list(sides)
    for r in range(args.rounds):
        for name in names[r % 2:] + names[:r % 2]:
            runs[name].append(one_run(*sides[name], steps=args.steps))
            print(f"round {r + 1} {name}: " + json.dumps(runs[name][-1]), file=sys.stderr, flush=True)
    what = "step_s" if args.steps else "epoch_s"
    ratio = [b[what] / a[what] for a, b in zip(runs["after"], runs["before"])]
    lines = [f"train.py {args.flags} {args.after_flags and '(after: + ' + args.after_flags + ')'}"
             f"{f', killed after {args.steps} steps' if args.steps else ''}; "
             f"{args.rounds} interleaved rounds, median [min-max]; load average at the end "
             f"{os.getloadavg()[0]:.1f}", "",
             "| tree | epoch s | median step s | validation s | process s | peak RSS GiB | val choice NLL | val accuracy |",
             "|---|---|---|---|---|---|---|---|"]
    for name, (tree, _) in sides.items():
        rs = runs[name]
        lines.append(f"| {name} ({tree.name}) | {spread([x['epoch_s'] for x in rs])} | {spread([x['step_s'] for x in rs], 2)} | "
                     f"{spread([x['val_s'] for x in rs])} | "
                     f"{spread([x['process_s'] for x in rs])} | {spread([x['peak_rss_gib'] for x in rs], 2)} | "
                     f"{rs[0]['val_choice_nll']:.4f} | {rs[0]['val_accuracy']:.3f} |")
    lines += ["", f"{'step' if args.steps else 'epoch'} speed-up (before / after, per round): {spread(ratio, 2)}x"]
    table = "\n".join(lines)
    print(table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "default-run.md").write_text(table + "\n")
    (RESULTS / "default-run.json").write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
