"""Hub conventions and run records: a hub id resolves through the standard Hugging Face cache (offline),
--model-revision picks the snapshot, and config.json / metrics.json say exactly what ran."""
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from minimoe.making.tiny import tiny_checkpoint

REPO = Path(__file__).resolve().parents[2]
SHA = "0123456789abcdef0123456789abcdef01234567"  # the commit the fake hub snapshot claims
REPO_ID = "someorg/tiny-olmoe"


@pytest.fixture
def hf_home(tmp_path):
    """HF_HOME with REPO_ID cached as huggingface_hub lays it out: blobs aside, snapshots/<commit>/, refs/main."""
    home = tmp_path / "hf-home"
    cached = home / "hub" / f"models--{REPO_ID.replace('/', '--')}"
    shutil.copytree(tiny_checkpoint(), cached / "snapshots" / SHA)
    (cached / "refs").mkdir()
    (cached / "refs" / "main").write_text(SHA)
    return home


def cli(script, *flags, hf_home, cwd):
    """A CLI as a user runs it, offline, with only HF_HOME saying where the cache is (the default location)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "MINIMOE_WEIGHTS")}
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, str(REPO / script), *flags], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


SMOKE = ["--max-train-examples", "8", "--batch-size", "8", "--epochs", "1", "--no-test-eval", "--quiet",
         "--recipe", "tiny", "--method", "tes"]


@pytest.mark.plain
def test_hub_id_trains_from_the_default_cache_offline_and_config_json_records_what_ran(tmp_path, hf_home):
    done = cli("train.py", "--model", REPO_ID, "--out-dir", str(tmp_path / "runs"), "--run-name", "r",
               "--data-dir", str(tmp_path / "splits"), *SMOKE, hf_home=hf_home, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert not list(REPO.glob("weights/models--*")) and not (tmp_path / "weights").exists()  # not minimoe's own cache
    record = json.loads((tmp_path / "runs" / "r" / "config.json").read_text())
    origin = record["provenance"]
    assert origin["weights"] == {"source": "hub", "repo_id": REPO_ID, "revision": "main", "commit": SHA}
    assert origin["command"].split()[1:] == [str(REPO / "train.py"), "--model", REPO_ID, "--out-dir",
                                             str(tmp_path / "runs"), "--run-name", "r", "--data-dir",
                                             str(tmp_path / "splits"), *SMOKE]
    for package in ("minimoe", "torch", "safetensors", "tokenizers", "huggingface-hub"):
        assert origin["versions"][package] == importlib.metadata.version(package), package
    assert origin["versions"]["python"] == platform.python_version()
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:  # a git checkout (CI's is one)
        assert origin["minimoe_git"]["commit"] == head.stdout.strip()
    assert origin["device"].startswith("cpu: ")
    assert record["model"] == REPO_ID and record["model_revision"] is None


@pytest.mark.plain
def test_model_revision_selects_the_snapshot_and_an_unknown_one_is_one_line(tmp_path, hf_home):
    out = tmp_path / "eval"
    common = ["--model", REPO_ID, "--data", "arc_challenge", "--data-dir", str(tmp_path / "splits"),
              "--max-examples", "4", "--split", "val", "--out-dir", str(out)]
    done = cli("evaluate.py", *common, "--model-revision", SHA, hf_home=hf_home, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    weights = json.loads((out / "metrics.json").read_text())["provenance"]["weights"]
    assert weights == {"source": "hub", "repo_id": REPO_ID, "revision": SHA, "commit": SHA}
    bad = cli("evaluate.py", *common, "--model-revision", "v9.9", hf_home=hf_home, cwd=tmp_path)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert f"{REPO_ID}@v9.9: not in the local cache" in bad.stderr


def test_local_folder_records_the_sha256_of_its_weight_files(tmp_path):
    folder = tiny_checkpoint()
    done = cli("evaluate.py", "--model", str(folder), "--data", "arc_challenge", "--data-dir", str(tmp_path / "splits"),
               "--max-examples", "4", "--split", "val", "--out-dir", str(tmp_path / "eval"), hf_home=tmp_path, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    weights = json.loads((tmp_path / "eval" / "metrics.json").read_text())["provenance"]["weights"]
    files = sorted(folder.glob("*.safetensors"))
    assert files and weights == {"source": "local", "path": str(folder.resolve()),
                                 "sha256": {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}}
