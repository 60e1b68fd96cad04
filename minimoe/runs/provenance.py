"""What produced a run: the exact weights, the code, the command line, the packages and the device.

train.py writes `provenance(...)` into config.json, evaluate.py into metrics.json, so a result can
be traced to the bits that made it:
- weights: a hub id's snapshot folder is named by the commit that `snapshot_download` resolved (a
  branch or tag is not a version: `main` moves); a local folder has no commit, so its weight files'
  sha256 stand in for one.
- code: the installed minimoe version, and the git commit (plus whether the tree had uncommitted
  changes) when the package runs from a git checkout.
"""
from __future__ import annotations

import functools
import importlib.metadata
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch

from minimoe.atomic import sha256_file

PACKAGES = ("torch", "safetensors", "tokenizers", "huggingface-hub")
REPO = Path(__file__).resolve().parents[2]


def weights_record(name_or_path: str, folder: Path, revision: str | None = None) -> dict:
    """The weights as loaded: a hub snapshot's commit, or the sha256 of a local folder's weight files."""
    folder = Path(folder)
    if folder.parent.name == "snapshots" and not Path(name_or_path).is_dir():  # huggingface_hub's cache layout
        return {"source": "hub", "repo_id": str(name_or_path), "revision": revision or "main", "commit": folder.name}
    files = sorted(folder.glob("*.safetensors"))
    return {"source": "local", "path": str(folder.resolve()), "sha256": {f.name: file_digest(f) for f in files}}


def file_digest(path: Path) -> str:
    """sha256_file, once per process for a file whose size and modification time have not changed: a
    run records its weights three times (train.py, the zero-shot and the test scoring), each a full
    read and hash of the checkpoint (the default model: 1.5 GB)."""
    stat = path.stat()
    return _digest(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.cache
def _digest(path: str, size: int, mtime_ns: int) -> str:  # size and mtime are the cache key
    return sha256_file(path)


def git_commit() -> dict | None:
    """{"commit", "dirty"} of the checkout minimoe runs from; None when it is not a git checkout."""
    if not (REPO / ".git").exists():
        return None
    try:
        def git(*args):
            return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):  # no git binary, or not a repository after all
        return None


def device_name(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor()
    try:  # Linux names the CPU model here; platform.processor() is often just the architecture
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"cpu: {cpu or platform.machine()}"


def provenance(name_or_path: str, folder: Path, *, revision: str | None = None, device="cpu") -> dict:
    versions = {"python": platform.python_version()}
    for package in ("minimoe", *PACKAGES):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {"weights": weights_record(name_or_path, folder, revision), "minimoe_git": git_commit(),
            "command": shlex.join([Path(sys.executable).name, *sys.argv]), "versions": versions,
            "device": device_name(device)}
