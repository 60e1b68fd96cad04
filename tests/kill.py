"""The resume tests' fault injector: a train.py run stopped at a chosen point, as a kill stops it.

minimoe.runs.training.train calls `on_step` after each optimizer step and `on_epoch_end` after each epoch,
the points a killed run resumes from; `killed_after` ends the run there.

    with pytest.raises(SystemExit, match="stopped after epoch 1"), killed_after(epochs=1):
        train.main([...])          # in this process: SystemExit, the run folder as the kill left it
    python -m tests.kill --after-steps 5 TRAIN_FLAGS...    # a process of its own, ended by SIGKILL
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from contextlib import contextmanager
from functools import partial
from unittest import mock

from minimoe.cli import train as train_cli
from minimoe.runs import training


def exit_now(message: str):
    raise SystemExit(message)


def sigkill(message: str):
    """No exception to catch, no cleanup, no flush: what `kill -9` leaves of the process."""
    print(message, file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


@contextmanager
def killed_after(*, epochs: int | None = None, steps: int | None = None, kill=exit_now):
    """Inside the block, train.py's training loop calls `kill` once it has finished epoch `epochs`
    (validated and checkpointed) or global optimizer step `steps` (logged, and its step checkpoint
    written when one is due)."""
    if (epochs is None) == (steps is None):
        raise ValueError(f"killed_after: pass epochs or steps, one of them; got epochs={epochs}, steps={steps}")

    def after_step(position: training.Position):
        if position.step == steps:
            kill(f"stopped after step {steps} (tests/kill.py); continue with --resume")

    def after_epoch(position: training.Position):
        if position.epoch == epochs:
            kill(f"stopped after epoch {epochs} (tests/kill.py); continue with --resume")
    hook = {"on_step": after_step} if steps is not None else {"on_epoch_end": after_epoch}
    with mock.patch.object(train_cli, "train", partial(training.train, **hook)):  # the loop cli/train.py runs
        yield


def main(argv=None):
    p = argparse.ArgumentParser(description="train.py, killed by SIGKILL after an epoch or a step",
                                allow_abbrev=False)
    when = p.add_mutually_exclusive_group(required=True)
    when.add_argument("--after-epochs", type=int, metavar="N")
    when.add_argument("--after-steps", type=int, metavar="N")
    args, train_flags = p.parse_known_args(argv)
    with killed_after(epochs=args.after_epochs, steps=args.after_steps, kill=sigkill):
        train_cli.main(train_flags)


if __name__ == "__main__":
    main()
