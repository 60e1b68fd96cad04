"""What the command lines share: the console commands, device strings, and old flag names kept for a release.

Console commands (setup.cfg's entry points, installed with the package):
    minimoe-train   = python train.py        minimoe-sweep  = python sweep.py
    minimoe-eval    = python evaluate.py     minimoe-export = python export.py
    minimoe-upcycle = python -m minimoe.upcycle
Each runs the script beside the package as `python <script>` would (same __main__, same exit codes), so
the scripts stay the one source of each CLI. That needs the source checkout the README installs from
(`pip install -e .`); a wheel built without the scripts says so.

One name per concept across the scripts (the old spellings are hidden aliases that warn, for one release):
    --eval-batch-size  examples per forward in scoring      (evaluate.py's --batch-size)
    --out-dir          the folder a command writes into     (evaluate.py's --out; `report --out` is a file)
    --max-train-examples / --max-examples stay apart: the first N training examples of a run, and the
    first N examples of the split that evaluate.py scores.
"""
from __future__ import annotations

import argparse
import re
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


def device(text: str) -> str:
    """--device, alike in every script: auto (cuda when present), cpu, cuda, cuda:N, mps."""
    if not DEVICE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r}: expected auto, cpu, cuda, cuda:N or mps")
    return text


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


def _run_script(name: str) -> None:
    script = ROOT / name
    if not script.is_file():
        sys.exit(f"minimoe: {script} not found; the console commands run the scripts of a source checkout "
                 f"(git clone, then pip install -e .)")
    sys.argv[0] = str(script)
    sys.path.insert(0, str(ROOT))
    runpy.run_path(str(script), run_name="__main__")


def train():
    _run_script("train.py")


def evaluate():
    _run_script("evaluate.py")


def sweep():
    _run_script("sweep.py")


def export():
    _run_script("export.py")
