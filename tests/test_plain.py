"""minimoe without the test extra, as a plain `pip install -e .` has it (.ci/run's second environment, where
these run again, with every other `plain` test: setup.cfg's marker). Here the oracles are hidden from a child
process, so that the first environment checks the same: every module imports without any of them, and a
feature that needs an extra says which one, in one line, with nothing left behind."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ORACLES

pytestmark = pytest.mark.plain
REPO = Path(__file__).resolve().parents[1]

# Put first on sys.meta_path in the child: importing an oracle fails as it does where none is installed.
HIDE_ORACLES = f"""
import importlib.abc, sys
class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {ORACLES!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, NotInstalled())
"""


def without_oracles(code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", HIDE_ORACLES + code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_every_module_imports_without_the_oracles(tmp_path):
    """Every module of the package, the scripts' shims too; only the lm-eval integration needs its package (the
    `minimoe-lm-eval` command says so: the next test)."""
    done = without_oracles("""
import importlib, json, pkgutil, sys
import minimoe
failed = {}
for m in pkgutil.walk_packages(minimoe.__path__, "minimoe."):
    try:
        importlib.import_module(m.name)
    except Exception as e:
        failed[m.name] = f"{type(e).__name__}: {e}"
print(json.dumps({"failed": failed, "oracles": sorted(n for n in sys.modules if n.split(".")[0] in %r)}))
""" % (ORACLES,), tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["failed"] == {"minimoe.integrations.lm_eval": "ModuleNotFoundError: No module named 'lm_eval'"}
    assert out["oracles"] == []


def test_a_feature_that_needs_an_extra_names_it_in_one_line_and_leaves_nothing(tmp_path):
    """--report-to wandb / tensorboard, sweep.py --slurm and minimoe-lm-eval without their packages: one line
    naming the extra to install, no traceback, no run folder."""
    smoke = ["--model", "tiny", "--max-train-examples", "8", "--batch-size", "8", "--epochs", "1", "--quiet",
             "--no-test-eval", "--data-dir", str(tmp_path / "splits"), "--out-dir", str(tmp_path / "runs")]
    done = without_oracles(f"""
import contextlib, io, json, sys
from minimoe.cli import evaluate, run_command, sweep, train
from minimoe.cli.lm_eval_harness import command as lm_eval
def one(call):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            call()
        except SystemExit as e:
            return [e.code if isinstance(e.code, int) else 1, (err.getvalue() + (e.code if isinstance(e.code, str) else "")).strip()]
    return [0, err.getvalue().strip()]
print(json.dumps({{
    "wandb": one(lambda: run_command(lambda: train.main({smoke!r} + ["--report-to", "wandb"]), "train.py")),
    "tensorboard": one(lambda: run_command(lambda: train.main({smoke!r} + ["--report-to", "tensorboard"]), "train.py")),
    "slurm": one(lambda: sweep.main(["--models", "tiny", "--rows", "CE", "--benchmarks", "arc_challenge", "--seeds", "42",
                                     "--out-dir", {str(tmp_path / "sweep")!r}, "--slurm"])),
    "lm_eval": one(lm_eval),
}}))
""", tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.splitlines()[-1])
    extra = {"wandb": ".[wandb]", "tensorboard": ".[tensorboard]", "slurm": ".[slurm]", "lm_eval": ".[lmeval]"}
    for name, (status, err) in out.items():
        last = err.splitlines()[-1] if err else ""
        assert status != 0 and f'pip install -e "{extra[name]}"' in last, (name, status, err[-1500:])
        assert "Traceback" not in err, (name, err[-1500:])
    assert not any((tmp_path / "runs").glob("*")) and not (tmp_path / "sweep").exists()


def test_the_readmes_smoke_run_builds_the_tiny_model_and_trains_as_a_user_runs_it(tmp_path):
    """`python train.py --model tiny` (the README's offline smoke run), smaller, from a fresh weights folder: the
    tiny checkpoint and its BPE are built with this environment's tokenizers, then trained, scored and saved."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "MINIMOE_WEIGHTS": str(tmp_path / "weights"),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(REPO / "train.py"), "--model", "tiny", "--max-train-examples", "8",
                           "--batch-size", "8", "--epochs", "1", "--quiet",
                           "--data-dir", str(tmp_path / "splits"), "--out-dir", str(tmp_path / "runs")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    run = Path(done.stdout.splitlines()[-1].removeprefix("run folder: "))
    assert (tmp_path / "weights" / "tiny-olmoe" / "tokenizer.json").is_file()
    assert 0 <= json.loads((run / "eval" / "test" / "metrics.json").read_text())["accuracy"] <= 1
    assert (run / "checkpoints" / "epoch-1" / "adapter.safetensors").is_file()


def test_ci_runs_the_plain_tests_in_its_second_environment():
    """The markers are declared (setup.cfg); .ci/run's plain environment selects `plain`, its third (transformers
    5.23 as the oracle) `tf5`; the first runs everything."""
    import configparser
    import re
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    assert re.search(r"^plain:", cfg["tool:pytest"]["markers"], re.M) and re.search(r"^tf5:", cfg["tool:pytest"]["markers"], re.M)
    runs = re.findall(r"-m pytest ([^;}\n]*)", (REPO / ".ci" / "run").read_text(encoding="utf-8"))
    assert len(runs) == 3 and " -m " not in runs[0] and re.search(r"-m plain\b", runs[1]), runs
    assert re.search(r"-m tf5\b", runs[2]), runs


def test_a_missing_oracle_skips_at_its_first_use_not_when_pytest_inspects_the_file():
    """`transformers = oracle("transformers")` at a file's top: pytest's collection reads every global's attributes
    (fixture markers); a skip there skipped the whole file on a plain install, its oracle-free tests too."""
    from tests.conftest import MissingOracle
    missing = MissingOracle("transformers")
    try:
        assert getattr(missing, "_pytestfixturefunction", None) is None
    except pytest.skip.Exception:
        pytest.fail("pytest's look-up of a fixture marker skipped: the whole file would be skipped")
    with pytest.raises(pytest.skip.Exception, match="transformers is not installed"):
        missing.AutoConfig
