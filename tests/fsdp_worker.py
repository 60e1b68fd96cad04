"""The FSDP tests' worker: one torchrun launch runs a whole plan of train.py runs, since starting gloo
processes is the slow part (tests/runs/test_sharding.py).

    torchrun --nproc_per_node 2 -m tests.fsdp_worker PLAN.json

PLAN.json: {"runs": [{"flags": [...], "kill_after_steps": N or "refused": true (optional), "eager": true
(optional)}, ...]}. Each run is train.main(flags), in order, in these processes; "eager" runs torch.compile's
callers eagerly (torchao's low-bit step compiles itself: tests/runs/test_optimizers.py says why not here); a run
with kill_after_steps stops there
as a kill would (tests/kill.py); a refused one is expected to end in SystemExit on every rank, and
each rank prints `rank R: exit STATUS: MESSAGE`.
"""
from __future__ import annotations

import json
import sys
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

from minimoe.cli import train
from tests.kill import killed_after


def main(path: str):
    plan = json.loads(Path(path).read_text())
    # one group for the whole plan: train.main finds it and leaves it open. A rank left waiting in a
    # collective (its peer refused alone) fails the test in minutes, not gloo's default 30.
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    with mock.patch.object(train.dist, "destroy_process_group", lambda: None):  # a second init would hang
        for run in plan.get("runs", []):
            steps = run.get("kill_after_steps")
            try:
                with (killed_after(steps=steps) if steps else nullcontext(),
                      mock.patch.object(torch, "compile", lambda fn, **options: fn) if run.get("eager") else nullcontext()):
                    train.main(run["flags"])
            except SystemExit as stop:  # the kill: the run folder as it left it; or the refusal
                if not (steps or run.get("refused")):
                    raise
                status = 1 if isinstance(stop.code, str) else stop.code
                # one write of the whole line: print writes its end apart, and the other rank's line can land
                # between the two in the shared stderr (seen on a loaded machine)
                sys.stderr.write(f"{stop}\n" if steps else f"rank {dist.get_rank()}: exit {status}: {stop}\n")
                sys.stderr.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
