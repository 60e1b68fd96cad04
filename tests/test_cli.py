"""The command lines together: console commands, device strings, old flag names, a bare sweep.py."""
import configparser
import os
import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest

from minimoe.cli import evaluate, sweep
from minimoe.cli import train

REPO = Path(__file__).resolve().parents[1]
COMMANDS = {"minimoe-train": "train.py", "minimoe-eval": "evaluate.py", "minimoe-sweep": "sweep.py",
            "minimoe-export": "export.py", "minimoe-upcycle": "python -m minimoe.making.upcycle",
            "minimoe-lm-eval": "lm-eval"}  # what --help names


def declared_commands() -> dict:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    lines = [line.split("=", 1) for line in cfg["options.entry_points"]["console_scripts"].splitlines() if line]
    return {name.strip(): target.strip() for name, target in lines}


@pytest.mark.plain
def test_console_commands_are_declared_and_installed():
    """setup.cfg declares the six; each target imports; where the package is installed with its entry
    points (pip install -e ., as CI does), each command is on PATH, and `--help` prints the script's help."""
    declared = declared_commands()
    assert set(declared) == set(COMMANDS)
    for target in declared.values():
        module, attr = target.split(":")
        assert callable(getattr(__import__(module, fromlist=[attr]), attr)), target
    try:
        installed = {ep.name for ep in distribution("minimoe").entry_points if ep.group == "console_scripts"}
    except PackageNotFoundError:
        pytest.skip("minimoe is not installed (pip install -e .)")
    assert set(COMMANDS) <= installed
    paths = {name: shutil.which(name) or str(Path(sys.executable).parent / name) for name in COMMANDS}
    assert all(Path(path).is_file() for path in paths.values()), paths
    # Run two, one of each kind of target (a command module's `command`, a library module's main); each imports torch.
    runs = {name: subprocess.Popen([paths[name], "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for name in ("minimoe-train", "minimoe-upcycle")}
    for name, proc in runs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, (name, err[-500:])
        assert out.startswith(f"usage: {COMMANDS[name]} "), (name, out[:80])


IN_PACKAGE = {"minimoe-train": "train", "minimoe-eval": "evaluate", "minimoe-sweep": "sweep",
              "minimoe-export": "export"}  # -> minimoe/cli/


@pytest.mark.plain
def test_console_commands_run_from_a_wheel_without_the_checkout(tmp_path):
    """The commands are the package's functions, not the checkout's scripts: setup.cfg points each at
    minimoe.cli.<script>:command, and a wheel built from the package alone (setup.cfg, README, minimoe/;
    no top-level scripts) installs them into an empty folder (pip, no dependencies: seconds). There,
    from a folder outside any checkout, `minimoe-train --help`, `minimoe-eval --help` and
    `minimoe-export --help` print their usage and a bare `minimoe-sweep` lists the presets with exit status 2,
    a usage error (not 1: a console script exits with its function's return value, and a returned list
    would print and exit 1)."""
    declared = declared_commands()
    assert {name: declared[name] for name in IN_PACKAGE} == {
        name: f"minimoe.cli.{module}:command" for name, module in IN_PACKAGE.items()}
    source, target, elsewhere = tmp_path / "src", tmp_path / "site", tmp_path / "elsewhere"
    shutil.copytree(REPO / "minimoe", source / "minimoe", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-compile",
                    "--target", str(target), str(source)], check=True, capture_output=True)
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target)}  # this wheel's minimoe, before the editable install's
    calls = {"minimoe-train": ["--help"], "minimoe-eval": ["--help"], "minimoe-export": ["--help"], "minimoe-sweep": []}
    runs = {name: subprocess.Popen([str(target / "bin" / name), *args], cwd=elsewhere, env=env, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE) for name, args in calls.items()}
    out = {}
    for name, proc in runs.items():
        out[name], err = proc.communicate(timeout=300)
        if name == "minimoe-sweep":
            out[name] = err
        assert proc.returncode == (2 if name == "minimoe-sweep" else 0), (name, err[-800:])
    assert out["minimoe-eval"].startswith("usage: evaluate.py ") and "report" in out["minimoe-eval"]
    assert out["minimoe-export"].startswith("usage: export.py ")
    assert out["minimoe-train"].startswith("usage: train.py ") and "--method-module" in out["minimoe-train"]
    assert "--preset" in out["minimoe-sweep"] and all(name in out["minimoe-sweep"] for name in sweep.PRESETS)
    assert not (elsewhere / "runs").exists()


@pytest.mark.parametrize("text, ok", [("cuda:1", True), ("cuda", True), ("cpu", True), ("auto", True),
                                      ("gpu", False), ("cuda:x", False)])
def test_device_strings_are_accepted_alike(text, ok, capsys):
    for parse in (lambda: train.parse_args(["--device", text]),
                  lambda: evaluate.evaluate_parser().parse_args(["--device", text])):
        if ok:
            assert parse().device == text
        else:
            with pytest.raises(SystemExit):
                parse()
            assert "expected auto, cpu, cuda, cuda:N or mps" in capsys.readouterr().err


def test_old_flag_names_set_the_new_ones_and_warn(capsys):
    parser = evaluate.evaluate_parser()
    new = parser.parse_args(["--eval-batch-size", "4", "--eval-dir", "x"])
    old = parser.parse_args(["--batch-size", "4", "--out", "x"])
    older = parser.parse_args(["--out-dir", "x"])  # --out-dir is where train.py and sweep.py make run folders
    err = capsys.readouterr().err
    assert "evaluate.py: warning: --batch-size is now --eval-batch-size" in err
    assert "evaluate.py: warning: --out-dir is now --eval-dir" in err
    assert (old.eval_batch_size, old.eval_dir) == (new.eval_batch_size, new.eval_dir) == (4, Path("x")) == (
        4, older.eval_dir)
    assert "--batch-size" not in parser.format_help() and "--eval-batch-size" in parser.format_help()
    assert parser.parse_args(["report", "runs", "--out", "t.md"]).out == Path("t.md")  # report's own: a file


def test_bare_sweep_lists_the_presets_runs_nothing_and_exits_2(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        sweep.main([])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "sweep.py: error: choose a grid: --preset NAME" in err
    assert all(name in err for name in sweep.PRESETS)
    assert not (tmp_path / "runs").exists()


def test_export_takes_model_as_the_other_commands_and_its_old_name_warns(capsys, monkeypatch):
    from minimoe.cli import export
    seen = []
    monkeypatch.setattr(export, "export_peft", lambda adapter, out, checkpoint, base_model, transformers: seen.append(base_model))
    export.main(["run", "out", "--model", "some/base"])
    export.main(["run", "out", "--base-model", "some/base"])
    assert seen == ["some/base", "some/base"]
    assert "export.py: warning: --base-model is now --model" in capsys.readouterr().err
