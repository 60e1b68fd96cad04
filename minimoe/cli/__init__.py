"""The command lines: one module per command, and what they share (old flag names, 'tiny', errors).

    command          script or module                        code
    minimoe-train    python train.py                         minimoe/cli/train.py
    minimoe-eval     python evaluate.py                      minimoe/cli/evaluate.py
    minimoe-sweep    python sweep.py                         minimoe/cli/sweep.py
    minimoe-export   python export.py                        minimoe/cli/export.py
    minimoe-upcycle  python -m minimoe.making.upcycle        minimoe/cli/upcycle_llama.py
                     python -m minimoe.making.heal           minimoe/cli/heal_split.py    (the split test bed healed)
                     python -m minimoe.study.results         minimoe/cli/study_results.py (collect runs into results/)
                     python -m minimoe.runs.memory           minimoe/cli/memory_estimate.py (what fits on how many GPUs)
    minimoe-lm-eval  python -m minimoe.integrations.lm_eval  minimoe/cli/lm_eval_harness.py (lm-eval's own CLI, the
                                                             model "minimoe" registered; the lmeval extra)
Every console form is minimoe.cli.<module>:command (setup.cfg). A `python -m` module outside cli/ keeps only
a `__main__` that runs its command here as the program (runpy), so that the commands users know keep working
and no module below imports cli/.
Each command module holds the whole CLI of its command: its parser, `main(argv=None)`,
which returns what it made (metrics, cells) and raises on bad input, for tests and for code that calls
it, and `command()`, the console entry point (setup.cfg) and the script's `__main__`: `main` with bad
input turned into one line `<script>: error: ...` and an exit status (`run_command`). The scripts at
the top of the checkout are three-line shims, so `python evaluate.py` and `minimoe-eval` are one
program, and the console commands work from any install, a wheel included. The commands keep their
script's name as `prog` (`usage: evaluate.py ...`, `usage: python -m minimoe.runs.memory ...`), the name
the README and the errors use.

One name per concept across the scripts (the old spellings are hidden aliases that warn, for one release):
    --eval-batch-size  examples per forward in scoring      (evaluate.py's --batch-size)
    --out-dir          where run folders are made: train.py's OUT/<run name>, sweep.py's runs (and its report)
    --eval-dir         evaluate.py's evaluation folder itself (its --out-dir and --out; `report --out` is a file)
    --model            the base checkpoint: a folder, a hub id, 'tiny' or 'tiny:<model_type>' (export.py's --base-model)
    positional OUT     a folder written whole (export.py, upcycle); positional RUN/DIR: what is read
    --max-train-examples / --max-examples stay apart: the first N training examples of a run, and the
    first N examples of the split that evaluate.py scores.
"""
from __future__ import annotations

import argparse
import sys


class OldName(argparse.Action):
    """A flag's previous name: sets the new one's value and warns that the old one goes."""

    def __init__(self, option_strings, dest, new: str, **kwargs):
        self.new = new
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: warning: {option_string} is now {self.new}; the old name goes in the next release",
              file=sys.stderr)
        setattr(namespace, self.dest, values)


def old_name(group, old: str, new: str, **kwargs) -> None:
    """Accept `old` as a hidden alias of the option `new` (same dest, type and metavar)."""
    group.add_argument(old, action=OldName, new=new, dest=new.lstrip("-").replace("-", "_"), **kwargs)


def is_tiny(model: str | None) -> bool:
    """'tiny' or 'tiny:<model_type>': a random tiny checkpoint that the commands build (minimoe/making/tiny.py)."""
    return model == "tiny" or str(model).startswith("tiny:")


def model_path(model: str | None) -> str | None:
    """--model as every command reads it: 'tiny' (= 'tiny:olmoe') is the random tiny OLMoE (weights/tiny-olmoe)
    and 'tiny:<model_type>' a random tiny model of that family (weights/tiny-<model_type>), built on first use,
    so that their runs are named, found and evaluated alike; an unknown family is an error naming those
    there are. Anything else as given."""
    if not is_tiny(model):
        return model
    from minimoe.making.tiny import tiny_checkpoint, tiny_model_type  # torch: only when asked
    return str(tiny_checkpoint(tiny_model_type(model)))


def run_command(main, prog: str, status: int = 2) -> None:
    """`main()` as a console command: bad input (OSError, ValueError, KeyError, whose messages name the file or
    flag) ends in one line `prog: error: ...` and exit `status`, no traceback; and what main returns never
    reaches sys.exit (a console script exits with its function's value: a dict would print and exit 1)."""
    try:
        main()
    except (OSError, ValueError, KeyError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(status)
