"""Writes that readers never see half done: a temp file or folder beside the target, renamed over it.

A folder is replaced only if it is ours: `atomic_directory` writes a marker file (MARKER, holding
the folder's kind: "evaluation", "adapter", "checkpoint", ...) into every folder it creates, and
replaces an existing folder only if it carries the marker of the same kind, or is empty. Anything
else (a run folder, `runs/`, a downloaded checkpoint, an adapter where an evaluation should go) is
refused with FileExistsError, so a mistyped --out-dir never deletes what minimoe did not write there.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError

MARKER = ".minimoe-written"
WRITE_ERRORS = (OSError, SafetensorError)  # safetensors reports a full disk as SafetensorError


def check_replaceable(path, kind: str = "folder") -> None:
    """Raise FileExistsError unless `path` is absent, an empty folder, or a folder that
    atomic_directory wrote with the same kind."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return
    if path.is_dir() and not path.is_symlink():
        if not any(path.iterdir()):
            return
        marker = path / MARKER
        try:
            written = json.loads(marker.read_text()).get("kind") if marker.is_file() else None
        except (OSError, ValueError, AttributeError):
            written = None
        if written == kind:
            return
        what = (f"holds minimoe's {written!r} output, not {kind!r}" if written
                else f"was not written by minimoe (no {MARKER} marker)")
        raise FileExistsError(f"{path}: exists and {what}; refusing to replace it. Choose another path, or "
                              f"remove it yourself")
    raise FileExistsError(f"{path}: exists and is not a folder; refusing to replace it with a {kind!r} folder")


def _reraise(e: BaseException, path: Path, what: str):
    """A failed write (a full disk, no permission) as an OSError naming the target; anything else as it is."""
    if isinstance(e, WRITE_ERRORS) and not isinstance(e, (FileNotFoundError, FileExistsError)):
        raise OSError(f"{path}: could not write it ({getattr(e, 'strerror', None) or e}); the previous {what}, if "
                      f"any, is unchanged; check free disk space and permissions") from e
    raise e


@contextmanager
def atomic_file(path):
    """`with atomic_file(p) as tmp:` write tmp (a path beside p); on success it is synced and renamed
    over p, on any error removed. A failed write (a full disk) raises OSError naming p."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        _reraise(e, path, "file")


@contextmanager
def atomic_directory(path, kind: str = "folder"):
    """`with atomic_directory(p, kind) as tmp:` write into tmp, a folder beside p; on success tmp
    replaces p whole, on any error it is removed, so readers never see half a folder. An existing p
    must pass `check_replaceable` (checked before and after writing)."""
    path = Path(path)
    check_replaceable(path, kind)  # fail before any work
    path.parent.mkdir(parents=True, exist_ok=True)
    # mkdir, not tempfile.mkdtemp: the folder gets the mode of any folder the user makes (umask), not 0700
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    tmp.mkdir()
    try:
        yield tmp
        (tmp / MARKER).write_text(json.dumps({"kind": kind, "written_by": "minimoe.atomic.atomic_directory"}) + "\n")
        check_replaceable(path, kind)  # something may have appeared there meanwhile
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        _reraise(e, path, "folder")
    old = None
    if path.exists():
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old)
