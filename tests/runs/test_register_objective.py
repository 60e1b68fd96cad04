"""A supervision objective from the user's own file (docs/methods.md "Adding an objective",
examples/my_objective.py), registered as the docs show: train.py takes it by --objective, records it,
and --resume in a fresh process finds it again and continues as an uninterrupted run does. What it
computes is tested against its formula in tests/core/task/test_step.py. Bad input names what was expected."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from minimoe.cli import train
from minimoe.core.routing_methods.objectives import OBJECTIVES, Objective, itakura_saito
from minimoe.runs.user_methods import register_objective
from tests.kill import killed_after
from tests.runs.test_register_method import fresh_process

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "my_objective.py"
FLAGS = ["--model", "tiny", "--max-train-examples", "8", "--batch-size", "8", "--epochs", "2", "--eval-batch-size", "8",
         "--quiet", "--no-test-eval", "--method-module", "examples/my_objective.py", "--method", "tes",
         "--objective", "sle"]


def test_the_docs_show_the_example_file_whole():
    page = (REPO / "docs" / "methods.md").read_text(encoding="utf-8")
    assert "```python\n" + EXAMPLE.read_text(encoding="utf-8") + "```" in page


def test_an_objective_from_a_file_trains_and_resumes(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # --method-module as the docs type it, relative to the checkout
    out, splits = tmp_path / "runs", ["--data-dir", str(tmp_path / "splits")]
    train.main([*FLAGS, *splits, "--out-dir", str(tmp_path / "straight")])
    with pytest.raises(SystemExit, match="stopped after epoch 1"), killed_after(epochs=1):
        train.main([*FLAGS, *splits, "--out-dir", str(out)])
    [run] = out.iterdir()
    assert "-TES-SLE-" in run.name  # the objective names the row, as IS does TES-IS
    cfg = json.loads((run / "config.json").read_text())
    assert (cfg["method"]["objective"], cfg["method"]["module"], cfg["label"]) == ("sle", str(EXAMPLE), "TES-SLE")
    fresh_process("train.py", "--resume", str(run), cwd=tmp_path)  # finds the objective through config.json
    [straight] = (tmp_path / "straight").iterdir()
    resumed, uninterrupted = (load_file(r / "checkpoints" / "epoch-2" / "adapter.safetensors") for r in (run, straight))
    assert resumed.keys() == uninterrupted.keys() and all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(s["method"] > 0 for s in steps if s.get("kind") == "step")  # the term trained, as sle computes it


def test_an_unknown_objective_is_refused_before_any_run_folder(tmp_path):
    with pytest.raises((SystemExit, ValueError), match="unknown objective 'sle2'"):
        train.main(["--model", "tiny", "--method", "tes", "--objective", "sle2", "--out-dir", str(tmp_path / "runs")])
    assert not (tmp_path / "runs").exists()


def test_a_second_objective_of_a_taken_name_is_refused():
    with pytest.raises(ValueError, match="'is' is registered already"):
        register_objective(Objective("is", itakura_saito))
    with pytest.raises(ValueError, match="identifier"):
        register_objective(Objective("not a name", itakura_saito))
    assert OBJECTIVES["is"].module is None
