"""The study on a real model: the paper's rows x datasets x seeds through train.py, then the accuracy table.

    python bench/study.py                                   # SmolLM2-135M upcycled (4 experts, top-2)
    python bench/study.py --rows CE TES-IS --seeds 42 --max-train-examples 32   # one small slice

Each cell is one `train.py` process writing OUT/<dataset>-<row>-seed<seed>/. The command is
resumable: a cell whose eval/test/metrics.json exists is skipped, a cell with a config.json but no
test metrics (a killed run) is continued with `train.py --resume` from its last complete epoch, and
any other cell starts fresh. The CE cells also score the base model before training (--zero-shot;
eval/test-base/), which gives the table its zero-shot row. It ends in `evaluate.py report`, written
to OUT/table.md; OUT/wall_times.json holds each cell's wall time. Arguments after `--` go to every
train.py call unchanged (e.g. `-- --batch-size 4`).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from minimoe.atomic import atomic_file  # noqa: E402
from minimoe.diagnostics import PAPER_SEEDS  # noqa: E402

# The paper's rows that apply to a model trained here, as train.py flags.
ROWS = {
    "CE": ["--method", "ce"],
    "ACS-IS": ["--method", "acs", "--objective", "is"],
    "ACS-ENLL": ["--method", "acs", "--objective", "enll"],
    "CE + affinity tuning": ["--method", "ce", "--tune-router"],
    "Dual Affinity": ["--method", "dual"],
    "TES-IS": ["--method", "tes", "--objective", "is"],
    "TES-ENLL": ["--method", "tes", "--objective", "enll"],
}
DATASETS = ("sciq", "arc_easy")


def slug(row: str) -> str:
    return row.replace(" + ", "+").replace(" ", "_")


def cell_state(run: Path) -> str:
    if (run / "eval" / "test" / "metrics.json").is_file():
        return "done"
    return "resume" if (run / "config.json").is_file() else "new"


def parse_args(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    passthrough = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint folder, hub id or 'tiny' (default: weights/smollm2-135m-moe, built on first use)")
    p.add_argument("--out", type=Path, default=Path("runs/study"), help="parent of the run folders (default runs/study)")
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS), metavar="ROW",
                   help=f"rows to run (default: all): {', '.join(ROWS)}")
    p.add_argument("--data", nargs="+", default=list(DATASETS),
                   help="offline benchmark names or manifest folders (default: sciq arc_easy)")
    p.add_argument("--seeds", nargs="+", type=int, default=list(PAPER_SEEDS), help="default: 42 43 45")
    p.add_argument("--epochs", type=int, default=1, help="epochs per run (default 1; the paper's recipe has 3)")
    p.add_argument("--max-train-examples", type=int, help="keep only the first N training examples of each dataset")
    p.add_argument("--data-dir", default="runs/splits", help="where train.py builds the split manifests")
    args = p.parse_args(argv)
    args.train_args = passthrough
    return args


def main(argv=None) -> str:
    args = parse_args(argv)
    if args.model is None:
        from minimoe.smollm import smollm_checkpoint
        args.model = str(smollm_checkpoint())
    args.out.mkdir(parents=True, exist_ok=True)
    times_path = args.out / "wall_times.json"
    times = json.loads(times_path.read_text()) if times_path.is_file() else {}
    cells = [(d, r, s) for d in args.data for r in args.rows for s in args.seeds]
    for i, (data, row, seed) in enumerate(cells, 1):
        name = f"{Path(data).name}-{slug(row)}-seed{seed}"
        run = args.out / name
        state = cell_state(run)
        print(f"[{i}/{len(cells)}] {name}: {'skipped (finished)' if state == 'done' else state}", flush=True)
        if state == "done":
            continue
        cmd = [sys.executable, str(REPO / "train.py"), "--model", args.model, "--data", data, *ROWS[row],
               "--seed", str(seed), "--epochs", str(args.epochs), "--out-dir", str(args.out), "--run-name", name,
               "--data-dir", args.data_dir, "--zero-shot" if row == "CE" else "--no-zero-shot", "--quiet"]
        if args.max_train_examples:
            cmd += ["--max-train-examples", str(args.max_train_examples)]
        if state == "resume":
            cmd.append("--resume")
        start = time.perf_counter()
        done = subprocess.run(cmd + args.train_args)
        times[name] = times.get(name, 0.0) + time.perf_counter() - start  # a resumed cell adds its parts
        with atomic_file(times_path) as tmp:
            tmp.write_text(json.dumps(times, indent=1, sort_keys=True) + "\n")
        if done.returncode:
            sys.exit(f"study: {name} failed (exit {done.returncode}); run the same command again to continue it")
    import evaluate
    return evaluate.report([str(args.out), "--seeds", *map(str, args.seeds), "--out", str(args.out / "table.md")])


if __name__ == "__main__":
    main()
