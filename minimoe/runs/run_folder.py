"""The run rules that train.py, evaluate.py, export.py and sweep.py share: which adapter a run or adapter
folder stands for; and the run folder's own: one writer at a time, a log that survives kills, state
that loads safely. Device, dtype and autocast: runs/device.py; the process group's rank and sums:
runs/ranks.py.

A run folder (train.py) holds config.json, metrics.jsonl, checkpoints/epoch-N/{adapter files,
training_state.pt}, selection.json, eval/ and train.lock; with --save-every-steps also one
mid-epoch checkpoint, checkpoints/step-G (G = global optimizer step). Decisions:
- One writer: the training process holds an exclusive `fcntl.flock` on train.lock for its whole
  life (the kernel drops it when the process dies, also on kill -9); a second process on the same
  folder fails at once with RunInUse naming the holder's pid, written into the lock file.
- A checkpoint is complete once its training_state.pt exists (written last). Its state holds the
  position: `epoch` (epochs complete), `epoch_step` (steps of the next epoch done; 0 for an epoch
  checkpoint) and `step` (global). Only the latest step checkpoint is kept: it is removed once a
  later step or epoch checkpoint is complete. --resume continues from the newest complete
  checkpoint that reads back (`latest_checkpoint`), epoch or step, ordered by global step.
- metrics.jsonl is appended one whole line per write. On --resume it is cut back to the resumed
  position: the records of epochs <= `epoch`, then the step records of the next epoch up to global
  step `step` (none when no checkpoint exists), dropping a torn last line (a kill or a full disk
  mid-write), and rewritten atomically.
- training_state.pt holds only tensors, numbers, strings and lists (python's and numpy's RNG
  states converted), so it loads with `torch.load(weights_only=True)`: a crafted file cannot run
  code. A file that needs anything else is refused; a truncated one counts as missing, and
  --resume falls back to the previous complete checkpoint and says so.
- Orphans of a kill (`.<name>.tmp-*`, `.<name>.old-*` left by atomic_file/atomic_directory) are
  removed when the run resumes, under the lock.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import pickle
import random
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from minimoe.atomic import KINDS, MARKER, atomic_file, mark, written_kind
from minimoe.core.routing_methods.methods import Method
from minimoe.evaluation.folders import EVAL, is_base
from minimoe.runs.compat import adapter_record, settings_of
from minimoe.runs.config import method_for
from minimoe.runs.user_methods import method_of

log = logging.getLogger(__name__)

LOCK = "train.lock"
METRICS = "metrics.jsonl"
STATE = "training_state.pt"


class RunInUse(OSError):
    """Another process holds the run folder's lock."""


class CorruptFile(ValueError):
    """A run file that cannot be read back (truncated, half written)."""


# ----------------------------------------------------------------------------- which adapter

@dataclass
class AdapterSource:
    folder: Path  # the adapter folder load_adapter reads
    run: Path | None  # the run folder it belongs to, if any
    run_config: dict  # RUN/config.json, {} outside a run
    checkpoint: str | None  # "last" | "selected" when resolved through selection.json
    epoch: int | None
    router: dict | None  # adapter_config.json's method record (compat.adapter_record: any version's)

    @cached_property
    def method(self) -> Method:
        """The method the adapter was trained with, resolved once (evaluate.py and export.py hand this object
        to load_adapter): its run's (config.json, every setting) or, outside a run or where config.json names
        no method, its own record's; native without one (LoRA alone). export.py's peft and merged exports
        both read this."""
        if self.run_config.get("method"):
            return method_for(settings_of(self.run_config))
        return method_of(self.router or {"name": "native"})

    @property
    def label(self) -> str:
        """The run's label (e.g. "TES-IS"); outside a run the router method, "CE" for LoRA on native routing."""
        return self.run_config.get("label") or self.method.row


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from None


def resolve_adapter(path, checkpoint: str | None = None, *, flag: str | None = "--adapter") -> AdapterSource:
    """A run folder (config.json + checkpoints/ + selection.json) or an adapter folder -> AdapterSource.
    `flag`: how the caller's command names the folder in errors (export.py has no --adapter: None).

    A run resolves to checkpoints/epoch-<last_epoch> (checkpoint "last", the paper's primary
    endpoint) or epoch-<selected_epoch> ("selected", minimum validation choice NLL).
    """
    path = Path(path)
    named = f"{flag} {path}" if flag else str(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{named}: no such folder; expected a run folder (config.json, "
                                f"checkpoints/, selection.json) or an adapter folder (adapter_config.json)")
    if (path / "adapter_config.json").is_file():
        if checkpoint is not None:
            raise ValueError(f"--checkpoint {checkpoint} applies to run folders; {path} is a checkpoint folder already")
        run = path.parent.parent if path.parent.name == "checkpoints" else None
        run_config = read_json(run / "config.json") if run and (run / "config.json").is_file() else {}
        epoch = int(path.name.removeprefix("epoch-")) if run and path.name.removeprefix("epoch-").isdigit() else None
        return AdapterSource(path, run if run_config else None, run_config, None, epoch,
                             adapter_record(read_json(path / "adapter_config.json")))
    if not ((path / "config.json").is_file() and (path / "checkpoints").is_dir()):
        hint = " (it looks like a model checkpoint: pass it as --model)" if (path / "config.json").is_file() else ""
        raise FileNotFoundError(f"{named}: neither a run folder (config.json and checkpoints/) nor an "
                                f"adapter folder (adapter_config.json){hint}")
    checkpoint = checkpoint or "last"
    if checkpoint not in ("last", "selected"):
        raise ValueError(f"--checkpoint {checkpoint!r}; expected 'last' or 'selected'")
    selection_path = path / "selection.json"
    if not selection_path.is_file():
        raise FileNotFoundError(f"{selection_path}: missing, so the run has not finished; pass a checkpoint "
                                f"folder ({path / 'checkpoints'}/epoch-N) to evaluate it anyway")
    selection = read_json(selection_path)
    key = "last_epoch" if checkpoint == "last" else "selected_epoch"
    epoch = selection.get(key)
    if not isinstance(epoch, int) or isinstance(epoch, bool):
        raise ValueError(f"{selection_path}: {key!r} is {epoch!r}; expected an epoch number")
    folder = path / "checkpoints" / f"epoch-{epoch}"
    if not (folder / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{folder}: no adapter_config.json; {selection_path} names epoch {epoch} ({key})")
    return AdapterSource(folder, path, read_json(path / "config.json"), checkpoint, epoch,
                         adapter_record(read_json(folder / "adapter_config.json")))


# ----------------------------------------------------------------------------- one writer

@contextmanager
def run_lock(run: Path):
    """Hold the run folder's exclusive lock inside the block. `run` must be a run folder already
    (atomic.MARKER of kind "run"): the lock is never written anywhere else. The lock file is opened
    without following a symlink (O_NOFOLLOW), so a link planted there cannot make us write elsewhere."""
    if written_kind(run) != "run":
        raise FileNotFoundError(f"{run}: not a train.py run folder (no {MARKER} of kind 'run'); refusing to "
                                f"write {LOCK} there")
    path = run / LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if path.is_symlink():
            raise OSError(f"{path}: is a symbolic link; refusing to follow it (remove it, then run again)") from None
        raise OSError(f"{path}: cannot open the run's lock ({e.strerror or e})") from None
    with os.fdopen(fd, "r+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            raise RunInUse(f"{run}: in use by process {holder} (it holds {path}); wait for it to end or stop it, "
                           f"or choose another --run-name") from None
        try:
            f.seek(0)
            f.truncate()
            f.write(f"{os.getpid()}\n")
            f.flush()
        except OSError as e:
            raise OSError(f"{path}: could not write the lock holder's pid ({e.strerror or e}); check free disk "
                          f"space") from e
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def is_run_record(config: Path) -> bool:
    """A config.json that train.py wrote (a run's record, not a model's config)."""
    try:
        record = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and "model_config" in record and "label" in record


def is_run_folder(run: Path) -> bool:
    """A folder marked as a run, or one an older version wrote without the marker (its config.json a run's)."""
    kind = written_kind(run)
    return kind == "run" or (kind is None and is_run_record(run / "config.json"))


def claim_run_folder(run: Path, *, resume: bool) -> bool:
    """Make `run` a run folder (atomic.MARKER of kind "run") before anything is written into it; returns
    True when this call created it. A new run needs an absent folder; --resume needs a run folder
    (one that an older version wrote without the marker is recognised by its config.json)."""
    if not resume:
        try:
            run.mkdir(parents=True)
        except FileExistsError:
            raise FileExistsError(f"{run}: exists; pass --resume to continue it, --rerun to start it again, or "
                                  f"choose another --run-name") from None
        try:
            mark(run, "run")
        except OSError:
            run.rmdir()
            raise
        return True
    if not is_run_folder(run):
        kind = written_kind(run)
        what = KINDS.get(kind, repr(kind)) if kind else "not a train.py run folder (no config.json of a run)"
        raise FileNotFoundError(f"{run}: {what}; refusing to treat it as a run folder")
    if written_kind(run) is None:
        mark(run, "run")  # a run folder of an older version
    return False


def has_training_output(run: Path) -> bool:
    """Anything a failed start must not delete: a checkpoint, a training record or a test score
    (the base model's zero-shot score, remade by any rerun, does not count)."""
    metrics = run / METRICS
    evals = [p for p in (run / EVAL).iterdir() if not p.name.startswith(".")] if (run / EVAL).is_dir() else []
    return (any((run / "checkpoints").iterdir()) if (run / "checkpoints").is_dir() else False) or (
        metrics.is_file() and metrics.stat().st_size > 0) or any(not is_base(folder) for folder in evals)


def set_aside(run: Path) -> Path:
    """Move a run folder out of the way of a rerun: to <run>.replaced-<UTC time>, kept whole."""
    from datetime import datetime, timezone
    aside = run.with_name(f"{run.name}.replaced-{datetime.now(timezone.utc):%Y%m%dT%H%M%S%fZ}")
    os.replace(run, aside)
    return aside


def remove_orphans(run: Path) -> list[Path]:
    """Remove the temp files and folders a killed writer left under `run`; returns what went."""
    found = sorted((p for p in run.rglob(".*") if ".tmp-" in p.name or ".old-" in p.name), key=lambda p: len(p.parts))
    removed = []
    for p in found:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        elif p.exists() or p.is_symlink():
            p.unlink(missing_ok=True)
        else:
            continue  # inside a folder removed just before
        removed.append(p)
    return removed


# ----------------------------------------------------------------------------- metrics.jsonl

def append_metrics(run: Path, record: dict):
    line = json.dumps(record) + "\n"
    try:
        with open(run / METRICS, "a") as f:
            f.write(line)  # one write: a kill leaves at most a torn last line, which resume drops
    except OSError as e:
        raise OSError(f"{run / METRICS}: could not append a record ({e.strerror or e}); free some space, then "
                      f"continue with --resume from the last complete checkpoint") from e


def truncate_metrics(run: Path, epoch: int, step: int = 0) -> list[dict]:
    """Keep the records up to a checkpoint's position (epochs <= `epoch`, then the step records of
    epoch + 1 up to global step `step`), atomically; a torn last line (no newline) is dropped."""
    path = run / METRICS
    text = path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
    lines = text.split("\n")
    if lines.pop():
        log.warning("%s: dropped a torn last line (the process was killed or the disk filled mid-write)", path)
    records = []
    for lineno, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg}); expected one record per line. Remove "
                             f"that line to resume") from None
    kept = [r for r in records if r.get("epoch", 0) <= epoch
            or (r.get("kind") == "step" and r.get("epoch") == epoch + 1 and r.get("step", 0) <= step)]
    done = {r["epoch"] for r in kept if r.get("kind") == "epoch"}
    if missing := sorted(set(range(1, epoch + 1)) - done):
        raise ValueError(f"{path}: no epoch record for epoch(s) {missing}, which checkpoints/ holds; the log does "
                         f"not belong to these checkpoints")
    if step and not any(r.get("step") == step for r in kept):
        raise ValueError(f"{path}: no record of step {step}, which checkpoints/ holds; the log does not belong to "
                         f"these checkpoints")
    with atomic_file(path) as tmp:
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    return kept


def read_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / METRICS).read_text(encoding="utf-8").splitlines()]


# ----------------------------------------------------------------------------- training state

def rng_state(device=None) -> dict:
    """Every RNG a run draws from, as tensors and plain numbers (loadable with weights_only=True): with
    a CUDA `device` (the run's), also that device's generator, which LoRA dropout draws from there."""
    version, mt, gauss = random.getstate()
    key, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(),
             "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
             "numpy": {"key": key, "state": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}
    if device is not None and torch.device(device).type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def params_device(optimizer):
    """The device of the optimizer's parameters (the run's), None without any."""
    return next((p.device for group in optimizer.param_groups for p in group["params"]), None)


def set_rng_state(state: dict, device=None):
    """Back to `rng_state`'s; a saved CUDA generator goes to `device` when that is a CUDA device. (Under
    DDP every rank gets rank 0's: exact for one process, as before for several.)"""
    torch.set_rng_state(state["torch"])
    if "cuda" in state and device is not None and torch.device(device).type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    n = state["numpy"]
    keys = n["state"].numpy().astype(np.uint32)
    np.random.set_state((n["key"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))


def save_state(path: Path, optimizer, scheduler, epoch: int, step: int, epoch_step: int = 0, *,
               optimizer_state: dict | None = None):
    """The position (`epoch` complete, `epoch_step` steps of the next one, `step` global), the
    optimizer (`optimizer_state` when given: a sharded run's, gathered by parameter name), the
    scheduler and every RNG."""
    state = {"optimizer": optimizer.state_dict() if optimizer_state is None else optimizer_state, "scheduler": scheduler.state_dict(), "epoch": epoch, "step": step,
             "epoch_step": epoch_step, "rng": rng_state(params_device(optimizer))}
    with atomic_file(path) as tmp:
        try:
            torch.save(state, tmp)
        except RuntimeError as e:  # torch reports a full disk as "[enforce fail at inline_container.cc]"
            raise OSError(f"torch.save failed: {e}") from e


def load_state(path: Path) -> dict:
    """training_state.pt with weights_only=True; CorruptFile if it cannot be read, ValueError if it
    would need to unpickle anything but tensors and plain values."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"{path}: holds objects that only a full unpickle could load (it could run code); refusing "
                         f"it. train.py writes plain tensors and numbers only: this file was not written by it, or "
                         f"by an older version ({str(e).splitlines()[0]})") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise CorruptFile(f"{path}: unreadable ({str(e).splitlines()[0]}); truncated or corrupt") from None


def check_adapter_readable(folder: Path):
    """CorruptFile unless the adapter files parse (load_adapter checks their content)."""
    try:
        json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
        load_file(str(folder / "adapter.safetensors"))
    except (OSError, ValueError, SafetensorError) as e:
        raise CorruptFile(f"{folder}: adapter unreadable ({e}); truncated or corrupt") from None


def complete_checkpoints(run: Path, kind: str) -> list[tuple[int, Path]]:
    """(N, folder) for each checkpoints/<kind>-N (kind "epoch" or "step") whose training_state.pt
    exists (it is written last), newest first."""
    found = [(int(p.name.split("-")[1]), p) for p in (run / "checkpoints").glob(f"{kind}-*")
             if p.name.split("-")[1].isdigit() and (p / STATE).is_file()]
    return sorted(found, reverse=True)


def latest_checkpoint(run: Path) -> tuple[Path | None, dict | None]:
    """(the newest checkpoint that reads back, its training state); (None, None) if none does.
    Newest: the latest readable epoch checkpoint, unless a readable step checkpoint lies past it.
    A corrupt checkpoint is skipped with a warning, so the run falls back to the one before it."""
    corrupt = []

    def readable(folder: Path) -> dict | None:
        try:
            state = load_state(folder / STATE)
            check_adapter_readable(folder)
        except CorruptFile as e:
            corrupt.append(str(e))
            return None
        return state

    folder = state = None
    for _, epoch_folder in complete_checkpoints(run, "epoch"):
        if (state := readable(epoch_folder)) is not None:
            folder = epoch_folder
            break
    for step, step_folder in complete_checkpoints(run, "step"):
        if step > (state["step"] if state else 0) and (step_state := readable(step_folder)) is not None:
            folder, state = step_folder, step_state
            break
    for message in corrupt:
        log.warning("%s; resuming from %s instead", message, describe(folder, state))
    return folder, state


def describe(folder: Path | None, state: dict | None) -> str:
    if folder is None:
        return "the start"
    if folder.name.startswith("epoch-"):
        return f"epoch {state['epoch']}"
    return f"step {state['step']} (step {state['epoch_step']} of epoch {state['epoch'] + 1})"


def drop_later_checkpoints(run: Path, epoch: int, step: int = 0):
    """Remove checkpoints/epoch-K for K > epoch (they will be trained again, and may be corrupt) and
    every step checkpoint but step-`step` (later ones will be redone, earlier ones are superseded)."""
    for p in (run / "checkpoints").glob("epoch-*"):
        if p.name.split("-")[1].isdigit() and int(p.name.split("-")[1]) > epoch:
            shutil.rmtree(p)
    drop_step_checkpoints(run, keep=step)


def drop_step_checkpoints(run: Path, keep: int | None = None):
    """Remove every checkpoints/step-G (complete or partial) but step-`keep`."""
    for p in (run / "checkpoints").glob("step-*"):
        if p.name.split("-")[1].isdigit() and int(p.name.split("-")[1]) != keep:
            shutil.rmtree(p)
