"""The FSDP tests' worker: one torchrun launch runs a whole plan of train.py runs, since starting gloo
processes is the slow part (tests/runs/test_sharding.py).

    torchrun --nproc_per_node 2 -m tests.fsdp_worker PLAN.json

PLAN.json: {"runs": [{"flags": [...], "kill_after_steps": N (optional)}, ...], "loads": [{"model":
FOLDER, "out": FILE}, ...]}. Each run is train.main(flags), in order, in these processes; a run with
kill_after_steps stops there as a kill would (tests/kill.py). Each load builds FOLDER sharded
(runs/sharding.py) and writes, per rank, the bytes it read from the safetensors files and each base
weight gathered whole, to FILE.rank<r>.safetensors.
"""
from __future__ import annotations

import json
import sys
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import torch.distributed as dist
from safetensors.torch import save_file

from minimoe.cli import train
from minimoe.loading.checkpoint import checkpoint_layout
from minimoe.runs.config import build_config
from minimoe.runs.sharding import build_sharded, full
from minimoe.runs.training import install_method
from tests.kill import killed_after


def load(model: str, out: str):
    cfg, method = build_config({"model": model, "dtype": "float32", "device": "cpu", "method": "tes"}, "tiny")
    built, read = build_sharded(Path(model), cfg, lambda m: install_method(m, cfg, method))
    tensors = {name: full(built.get_parameter(name)).detach().contiguous() for name in checkpoint_layout(built.config)}
    if dist.get_rank() == 0:
        save_file(tensors, f"{out}.rank0.safetensors", metadata={"bytes_read": str(read)})
    else:
        save_file({}, f"{out}.rank{dist.get_rank()}.safetensors", metadata={"bytes_read": str(read)})


def main(path: str):
    plan = json.loads(Path(path).read_text())
    dist.init_process_group("gloo")  # one group for the whole plan: train.main finds it and leaves it open
    with mock.patch.object(train.dist, "destroy_process_group", lambda: None):  # a second init would hang
        for run in plan.get("runs", []):
            steps = run.get("kill_after_steps")
            try:
                with killed_after(steps=steps) if steps else nullcontext():
                    train.main(run["flags"])
            except SystemExit as stop:  # the kill: the run folder as it left it
                if not steps:
                    raise
                print(stop, file=sys.stderr, flush=True)
    for item in plan.get("loads", []):
        load(item["model"], item["out"])
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
