"""Where cells run (no scheduler of our own):
  local     one after another, train.py as a subprocess with this interpreter
  gpus      one cell per listed device at a time, CUDA_VISIBLE_DEVICES=<device> in each child
  slurm     submitit (pip install -e ".[slurm]"): one job per cell, its logs in out_dir/submitit/<run name>
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from minimoe.atomic import atomic_file
from minimoe.evaluation.folders import METRICS, eval_dir
from minimoe.study.grid import Cell


TRAIN = ("-m", "minimoe.cli.train")  # train.py as the package runs it: no checkout needed (minimoe/cli/train.py)


def train_command(cell: Cell, nproc: int = 1) -> list[str]:
    """train.py for the cell; with nproc > 1 under torchrun on this node (--standalone: a free port of its own)."""
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    return [*launcher, *TRAIN, *cell.train_args(resume=(cell.run / "config.json").is_file())]


def train_eval_command(cell: Cell) -> list[str]:
    """evaluate.py on the run's train split, cut as the run's training population was."""
    limit = json.loads((cell.run / "config.json").read_text()).get("max_train_examples")
    return [sys.executable, "-m", "minimoe.cli.evaluate", "--adapter", str(cell.run), "--split", "train",
            "--eval-dir", str(eval_dir(cell.run, "train")), *(["--max-examples", str(limit)] if limit else [])]


def run_cell(cell: Cell, env: dict | None = None, nproc: int = 1) -> int:
    """train.py for one cell (continued with --resume when its folder exists; nproc > 1: data-parallel
    under torchrun), then the train-split evaluation when the cell needs it; returns the first non-zero
    exit code, else 0."""
    code = 0 if cell.trained() else subprocess.run(train_command(cell, nproc), env=env).returncode
    if code == 0 and cell.train_eval and not (eval_dir(cell.run, "train") / METRICS).is_file():
        code = subprocess.run(train_eval_command(cell), env=env).returncode
    return code


def run_local(cells, launch=run_cell) -> dict:
    return {c.run: launch(c) for c in cells}


def run_on_devices(cells, devices, launch=run_cell) -> dict:
    """One cell per device at a time; each child sees only its device (CUDA_VISIBLE_DEVICES)."""
    free = queue.Queue()
    for d in devices:
        free.put(str(d))

    def one(cell):
        device = free.get()
        try:
            return launch(cell, {**os.environ, "CUDA_VISIBLE_DEVICES": device})
        finally:
            free.put(device)

    with ThreadPoolExecutor(max_workers=len(devices)) as pool:
        return dict(zip([c.run for c in cells], pool.map(one, cells)))


def visible_devices() -> list[str]:
    """CUDA_VISIBLE_DEVICES if set, else every device torch sees."""
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        return os.environ["CUDA_VISIBLE_DEVICES"].split(",")
    import torch
    return [str(i) for i in range(torch.cuda.device_count())]


# SLURM states of a job that has yet to run or is running: its cell is not submitted again.
SLURM_ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED"}


def queued_job(cell, cluster: str) -> str | None:
    """The id of this cell's last SLURM job if SLURM still holds it (sacct, through submitit), so that
    running the same --slurm command twice does not queue every unfinished run twice."""
    record = cell.slurm_dir / "job_id"
    if cluster != "slurm" or not record.is_file():
        return None
    from submitit.slurm.slurm import SlurmJob
    job_id = record.read_text().strip()
    return job_id if SlurmJob(record.parent, job_id).state in SLURM_ACTIVE else None


def submit_slurm(cells, *, cluster: str | None = None, wait: bool = False, nproc: int = 1, **slurm_params) -> list:
    """One submitit job per cell, named after its run folder, unless SLURM still holds the cell's
    last job (`queued_job`); cluster="local"/"debug" runs them here (tests). nproc > 1: the job's one
    task runs train.py under torchrun with that many processes (one per GPU of the node).

    Why torchrun in one task rather than submitit's tasks_per_node: train.py's DDP is written and
    tested for torchrun's environment, a job stays one task whose exit code, logs and resume are the
    cell's (as with one GPU), and the train-split evaluation after training runs once, not per rank."""
    try:
        import submitit
    except ImportError:
        raise SystemExit('sweep.py: error: --slurm needs submitit: pip install -e ".[slurm]"') from None
    jobs = []
    for cell in cells:
        executor = submitit.AutoExecutor(folder=cell.slurm_dir, cluster=cluster)
        if held := queued_job(cell, executor.cluster):
            print(f"sweep: {cell.run.name} is queued or running as SLURM job {held}; not submitted again")
            continue
        executor.update_parameters(name=cell.run.name, **slurm_params)
        jobs.append(executor.submit(run_cell, cell, None, nproc))
        with atomic_file(cell.slurm_dir / "job_id") as tmp:
            tmp.write_text(str(jobs[-1].job_id))
    if wait:
        for job in jobs:
            job.result()
    return jobs
