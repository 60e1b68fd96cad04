"""A run folder written by an older minimoe (main at 3a854cc, before a method's options moved from
TrainConfig's own fields into method_options) still loads: its config.json reads into today's
TrainConfig and method, the sweep calls it done for its cell, and --resume and evaluate.py accept it.
So does the config.json of main at f907bcb, the last with the method's settings at its top level
(today's holds the configured method as one mapping, Method.record).

The fixture is that version's own output, paths scrubbed (tests/fixtures/README.md says how it was
made): `train.py --model tiny --epochs 1 --max-train-examples 16 --batch-size 8 --eval-batch-size 8
--quiet --method tes --gamma 2`, whose config.json holds gamma, tau, transform, mix, error_head_lr and
copied_head_lr at the top level, method_options null, and the stop_after_* keys."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from minimoe.cli import evaluate, sweep, train
from minimoe.making.tiny import tiny_checkpoint, tiny_config
from minimoe.runs.compat import read_settings, settings_of
from minimoe.runs.config import build_config, method_settings
from minimoe.runs.naming import run_name

FIXTURE = Path(__file__).parent / "fixtures" / "run-3a854cc" / "tiny-olmoe-arc_challenge-TES-IS-gamma2-seed42"
FLAT = next((Path(__file__).parent / "fixtures" / "run-f907bcb").iterdir())  # the method's settings at the top level
FLAGS = ["--epochs", "1", "--max-train-examples", "16", "--batch-size", "8", "--eval-batch-size", "8", "--quiet"]
TES_GAMMA_2 = {"gamma": 2.0, "tau": 1.0, "transform": "started-log", "error_head_lr": 1e-5}


def old_record(**facts) -> dict:
    """The fixture's config.json, its model the tiny checkpoint here (the scrubbed path was the old checkout's)."""
    return {**json.loads((FIXTURE / "config.json").read_text()), "model": str(tiny_checkpoint()), **facts}


def test_an_old_config_json_reads_into_todays_settings_and_names_its_own_run():
    record = old_record()
    assert record["gamma"] == 2.0 and record["method_options"] is None  # the old layout, as written
    method = build_config(settings_of(record), record["recipe"]).method
    assert (method.name, method.values, method.row) == ("tes", TES_GAMMA_2, "TES-IS")
    assert run_name(record, method) == FIXTURE.name
    assert read_settings(FIXTURE / "config.json")["method_options"] == {  # --config / --resume read it so
        "gamma": 2.0, "tau": 1.0, "transform": "started-log", "mix": 0.5, "error_head_lr": 1e-5, "copied_head_lr": 1e-3}


def test_the_sweep_calls_an_old_run_done_for_its_cell(tmp_path, capsys):
    flags = ["--models", "tiny", "--benchmarks", "arc_challenge", "--rows", "TES-IS", "--set", "gamma=2",
             "--seeds", "42", "--out-dir", str(tmp_path), "--dry-run", "--", *FLAGS]
    cell, = sweep.main(flags)
    assert cell.run.name == FIXTURE.name  # the cell names the old run's folder
    shutil.copytree(FIXTURE, cell.run)
    (cell.run / "config.json").write_text(json.dumps(old_record()))
    cell, = sweep.main(flags)
    assert cell.state() == "done" and cell.changed() == []
    assert capsys.readouterr().out.endswith("1 runs: 1 done, 0 partial, 0 missing, 0 changed, 0 refused\n")
    other, = sweep.main(["gamma=3" if f == "gamma=2" else f for f in flags])  # the control: another cell
    assert other.run.name != FIXTURE.name and other.changed(old_record()) == ["gamma"]


def test_resume_and_evaluate_accept_an_old_config_json(tmp_path):
    """The same run trained by today's code, its config.json replaced by the old one: --resume reads
    every setting from it, finds none changed and has nothing left to do; --resume with another gamma is
    refused, naming it; evaluate.py scores the run as the old one's settings say.

    Like with like: the run's own test evaluation ran in its dtype, bf16, so evaluate.py scores it in bf16
    too (by default it would score in fp32, where near-tie answers flip between the dtypes); on the CPU
    the same weights in the same dtype give the same scores, bit for bit."""
    train.main(["--model", "tiny", "--method", "tes", "--gamma", "2", "--dtype", "bfloat16", *FLAGS,
                "--out-dir", str(tmp_path), "--data-dir", str(tmp_path / "splits")])
    run = tmp_path / FIXTURE.name
    old = json.dumps(old_record(torch_version=torch.__version__, data_dir=str(tmp_path / "splits")))
    (run / "config.json").write_text(old)
    with pytest.raises(SystemExit, match=r"\['gamma'\] differ"):
        train.main(["--resume", str(run), "--gamma", "3"])
    train.main(["--resume", str(run)])
    assert (run / "config.json").read_text() == old  # a finished run's record stays as it is
    metrics = evaluate.main(["--adapter", str(run), "--eval-dir", str(tmp_path / "again"), "--eval-batch-size", "8",
                             "--dtype", "bfloat16"])
    in_run = json.loads((run / "eval" / "test" / "metrics.json").read_text())
    assert metrics["dtype"] == in_run["dtype"] == "bfloat16"
    assert (metrics["method"], metrics["settings"]) == ("TES-IS", {"gamma": 2.0})
    assert metrics["accuracy"] == in_run["accuracy"]


def test_a_config_json_with_the_methods_settings_at_its_top_level_reads_into_the_one_method():
    """f907bcb's config.json (method, objective, lambda_, layers, tune_router, method_options beside the other
    settings) builds the configured method that its flags build today, and names its own run; today's
    record of that method, one mapping, reads back into the same settings, and --config reads either."""
    record = {**json.loads((FLAT / "config.json").read_text()), "model": str(tiny_checkpoint())}
    assert record["method"] == "tes" and record["objective"] == "enll"  # the old layout, as written
    old = build_config(settings_of(record), record["recipe"])
    flags = ["--model", "tiny", "--method", "tes", "--gamma", "2", "--objective", "enll", "--lambda", "0.01",
             "--layers", "1,3", "--tune-router"]
    today = train.resolve_config(train.parse_args(flags), tiny_config("olmoe"))
    assert method_settings(old.method) == method_settings(today.method) == {
        "method": "tes", "method_module": None, "objective": "enll", "lambda_": 0.01, "layers": [1, 3],
        "tune_router": True, "method_options": {"gamma": 2.0, "tau": 1.0, "transform": "started-log",
                                                "error_head_lr": 1e-5}}
    assert old.method.row == record["label"] and run_name(record, old.method) == FLAT.name
    new = {**record, "method": old.method.record()}
    for key in ("method_module", "method_options", "objective", "lambda_", "layers", "tune_router"):
        del new[key]  # today's config.json holds them in "method" alone
    assert method_settings(build_config(settings_of(new), new["recipe"]).method) == method_settings(old.method)
    assert read_settings(FLAT / "config.json")["lambda_"] == 0.01
