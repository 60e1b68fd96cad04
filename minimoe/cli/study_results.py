"""The command `python -m minimoe.study.results`: `collect` finished runs into results/, `list` what a results
folder holds (minimoe/study/results.py, whose docstring is its --help)."""
from __future__ import annotations

import argparse
from pathlib import Path

import minimoe.study.results as results_module
from minimoe.cli import run_command
from minimoe.study.results import collect, read, test_evaluation_name


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m minimoe.study.results", description=results_module.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = p.add_subparsers(dest="command", required=True)
    c = commands.add_parser("collect", help="gather finished run folders into RESULTS/<benchmark>.jsonl.gz")
    c.add_argument("runs", nargs="+", type=Path, metavar="RUNS_DIR",
                   help="folders of run folders (a sweep's --out-dir)")
    c.add_argument("--out", type=Path, default=Path("results"), help="the results folder (default: %(default)s)")
    s = commands.add_parser("list", help="the runs a results folder holds, with their reported test accuracy")
    s.add_argument("results", type=Path, metavar="RESULTS")
    args = p.parse_args(argv)
    if args.command == "collect":
        done = collect(args.runs, args.out)
        for run, why in sorted(done["skipped"].items()):
            print(f"skipped {run}: {why}")
        print(f"collected {len(done['collected'])} runs; " + (f"wrote {', '.join(done['written'])}"
                                                              if done["written"] else "no file changed"))
        return done
    records = read(args.results)
    for r in records:
        metrics = r["evaluations"][test_evaluation_name(r)]["metrics"]
        print(f"{r['run']}  accuracy {metrics.get('accuracy')}")
    print(f"{len(records)} runs")
    return records


def command():
    """The console entry point and `python -m minimoe.study.results`: main, its bad input as one line and exit status 2."""
    run_command(main, "python -m minimoe.study.results")


if __name__ == "__main__":
    command()
