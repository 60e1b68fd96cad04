"""A routing method from the user's own file (docs/methods.md "Adding a routing method", examples/my_method.py),
registered exactly as the docs show: it trains and resumes, its adapter loads and evaluates in a
fresh process, and it reaches the report, as a built-in method does. Bad input names what was expected."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from minimoe.cli import train
from minimoe.cli import evaluate
from minimoe.core.routing_methods.methods import Method
from minimoe.core.routing_methods.routing import NativeRouter
from minimoe.runs.user_methods import register_method, resolve_method
from tests.kill import killed_after

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "my_method.py"
FLAGS = ["--model", "tiny", "--max-train-examples", "16", "--batch-size", "8", "--epochs", "2", "--eval-batch-size", "8",
         "--quiet", "--method-module", "examples/my_method.py", "--method", "biased", "--method-option", "temperature=2"]


def fresh_process(script: str, *flags, cwd):
    """A script in a new Python process, run from `cwd` (not the checkout: recorded paths must be absolute)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(REPO / script), *flags], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done


def test_the_docs_show_the_example_file_whole():
    page = (REPO / "docs" / "methods.md").read_text(encoding="utf-8")
    assert "```python\n" + EXAMPLE.read_text(encoding="utf-8") + "```" in page
    assert len(EXAMPLE.read_text().splitlines()) <= 40


def test_a_method_from_a_file_trains_resumes_loads_evaluates_and_reports(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # --method-module as the docs type it, relative to the checkout
    out, splits = tmp_path / "runs", ["--data-dir", str(tmp_path / "splits")]
    train.main([*FLAGS, *splits, "--out-dir", str(tmp_path / "straight"), "--no-test-eval"])
    with pytest.raises(SystemExit, match="stopped after epoch 1"), killed_after(epochs=1):
        train.main([*FLAGS, *splits, "--out-dir", str(out)])
    [run] = out.iterdir()
    assert run.name.endswith("-Biased-temperature2-seed42")  # label and the option off its default name the run
    cfg = json.loads((run / "config.json").read_text())
    method = cfg["method"]  # the configured method, one mapping (Method.record)
    assert (method["name"], method["module"], method["options"], cfg["label"]) == (
        "biased", str(EXAMPLE), {"temperature": 2, "bias_lr": 1e-3}, "Biased")  # every option, the record's defaults too

    fresh_process("train.py", "--resume", str(run), cwd=tmp_path)  # finds the method through config.json
    [straight] = (tmp_path / "straight").iterdir()
    resumed, uninterrupted = (load_file(r / "checkpoints" / "epoch-2" / "adapter.safetensors") for r in (run, straight))
    assert resumed.keys() == uninterrupted.keys() and all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)
    bias = [k for k in resumed if k.endswith(".mlp.router.bias")]
    assert bias == ["model.layers.3.mlp.router.bias"] and resumed[bias[0]].abs().max() > 0  # the head trained
    spec = json.loads((run / "checkpoints" / "epoch-2" / "adapter_config.json").read_text())["router"]
    assert spec == {**method, "layers": [3]}  # the same record as config.json's, on the layers it trained

    # evaluate.py in a fresh process loads the adapter through its router spec's module and scores as
    # train.py's own test evaluation of the same epoch did
    fresh_process("evaluate.py", "--adapter", str(run), "--out-dir", str(tmp_path / "eval"), "--eval-batch-size", "8",
                  cwd=tmp_path)
    again, in_run = (json.loads((d / "metrics.json").read_text()) for d in (tmp_path / "eval", run / "eval" / "test"))
    assert again["method"] == in_run["method"] == "Biased"
    assert again["accuracy"] == in_run["accuracy"] and again["choice_nll"] == pytest.approx(in_run["choice_nll"], rel=1e-6)
    predictions = [(d / "predictions.jsonl").read_text().splitlines() for d in (tmp_path / "eval", run / "eval" / "test")]
    assert [json.loads(r)["prediction"] for r in predictions[0]] == [json.loads(r)["prediction"] for r in predictions[1]]
    table = evaluate.main(["report", str(out)])
    assert f"| tiny-olmoe | Biased [temperature=2] | {100 * in_run['accuracy']:.2f} (n=1) |" in table  # its row


def test_unknown_method_and_missing_module_say_what_was_expected(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    base = ["--model", "tiny", "--out-dir", str(tmp_path), "--data-dir", str(tmp_path / "splits")]
    with pytest.raises(ValueError, match=r"unknown method 'nosuch'; expected one of the registered \['native', "
                                         r"'dual', 'tes', 'acs'.*--method-module"):
        train.main([*base, "--method", "nosuch"])
    with pytest.raises(FileNotFoundError, match="nowhere.py: no such file; expected a Python file that calls "
                                                "minimoe.register_method"):
        train.main([*base, "--method", "biased", "--method-module", "examples/nowhere.py"])
    with pytest.raises(ModuleNotFoundError, match="'no_such_pkg.routers': no such module; expected an importable"):
        train.main([*base, "--method", "biased", "--method-module", "no_such_pkg.routers"])
    with pytest.raises(ValueError, match="registers no method 'other'"):
        resolve_method("other", str(EXAMPLE))
    with pytest.raises(ValueError, match=r"--method-option bogus: method 'biased' has no such option; it takes "
                                         r"\['bias_lr', 'temperature'\]"):
        train.main([*base, *FLAGS[-6:], "--method-option", "bogus=1"])
    assert not any(tmp_path.glob("*/config.json"))  # refused before any run folder was written


def test_an_unknown_option_is_named_for_the_api_in_core_and_for_the_flag_in_a_run():
    """Method.configure (core) names the option as a keyword; only a run's settings say --method-option."""
    from minimoe.core.routing_methods.methods import UnknownOption, get_method
    from minimoe.runs.config import method_for
    with pytest.raises(UnknownOption, match=r"^bogus: method 'tes' has no such option; it takes \['error_head_lr', "):
        get_method("tes").configure(options={"bogus": 1})
    with pytest.raises(ValueError, match=r"^--method-option bogus: method 'tes' has no such option"):
        method_for({"method": "tes", "method_options": {"bogus": 1}})
    assert get_method("native").configure(options={"gamma": 2}).values == {}  # another method's option: left out


def test_register_method_refuses_a_taken_name_and_a_bad_record():
    with pytest.raises(ValueError, match="'tes' is registered already \\(built in\\)"):
        register_method(Method("tes", NativeRouter, label="Mine"))
    with pytest.raises(ValueError, match="must end in '_lr'"):
        register_method(Method("mine", NativeRouter, label="Mine", heads={"head": ("head_rate", 1e-3)}))
    with pytest.raises(ValueError, match="from_gate"):
        register_method(Method("mine", torch.nn.Linear, label="Mine"))
