"""A configured method is one object (methods.Method, `configure`d): train.py's flags resolve to it once,
the run's TrainConfig holds it (and none of its settings beside it), config.json records it as one
mapping, and the model routes with that same object; evaluate.py and export.py --merged resolve a run's
method once and hand it on (folder.AdapterSource.method -> load_adapter), never by its name again."""
import json

import pytest

from minimoe import from_pretrained
from minimoe.cli import evaluate, export, train
from minimoe.core.routing_methods.methods import Method
from minimoe.making.tiny import tiny_checkpoint, tiny_config
from minimoe.runs.compat import settings_of
from minimoe.runs.config import METHOD_FIELDS, build_config, method_for, method_settings
from minimoe.runs.training import install_method


def test_the_flags_resolve_to_one_object_that_the_router_holds():
    args = train.parse_args(["--model", "tiny", "--method", "tes", "--objective", "enll", "--lambda", "0.01",
                             "--layers", "all", "--tune-router", "--gamma", "2"])
    model = from_pretrained(tiny_checkpoint())
    cfg = train.resolve_config(args, model.config)
    method = cfg.method
    assert not METHOD_FIELDS.keys() - {"method"} & vars(cfg).keys()  # held once: no copy of its settings beside it
    assert (method.name, method.objective, method.lambda_, method.layers, method.tune_router, method.values["gamma"]) == (
        "tes", "enll", 0.01, "all", True, 2.0)  # name, objective, lambda, scope, gate, options: on the one object
    install_method(model, cfg)
    assert model.router_method is method  # not a copy: what training and saving read is what the flags made
    assert model.router_spec == method.record(list(range(model.config.num_hidden_layers)))


def test_config_json_records_the_method_once_and_reads_back_into_it():
    """run_record writes the configured method as one mapping and none of its settings at the top level;
    that record builds the same configured method again (as --resume, evaluate.py and the sweep build it)."""
    flags = ["--model", "tiny", "--method", "dual", "--mix", "0.25", "--layers", "first:2", "--tune-router",
             "--lambda", "0.5"]
    cfg = train.resolve_config(train.parse_args(flags), tiny_config("olmoe"))
    record = json.loads(json.dumps(train.run_record(cfg, tiny_config("olmoe"), {}, {}), default=str))
    assert record["method"] == cfg.method.record() and not METHOD_FIELDS.keys() - {"method"} & record.keys()
    again = build_config(settings_of(record), record["recipe"]).method
    assert method_settings(again) == method_settings(cfg.method) == {
        "method": "dual", "method_module": None, "objective": "is", "lambda_": 0.5, "layers": "first:2",
        "tune_router": True, "method_options": {"mix": 0.25, "copied_head_lr": 1e-3}}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    train.main(["--model", "tiny", "--method", "acs", "--max-train-examples", "8", "--batch-size", "8", "--epochs", "1",
                "--quiet", "--no-test-eval", "--out-dir", str(out), "--data-dir", str(out / "splits")])
    return next(p for p in out.iterdir() if p.name != "splits")


@pytest.fixture
def configured(monkeypatch):
    """Counts every Method.configure: each resolution of a method, from config.json or a router spec, ends in one."""
    calls = []
    original = Method.configure
    monkeypatch.setattr(Method, "configure", lambda self, *a, **k: calls.append(self.name) or original(self, *a, **k))
    return calls


def test_evaluate_resolves_the_method_once(run, tmp_path, configured):
    evaluate.main(["--adapter", str(run), "--eval-dir", str(tmp_path / "eval"), "--max-examples", "4", "--quiet",
                   "--data-dir", str(run.parent / "splits")])
    assert configured == ["acs"]


def test_a_merged_export_resolves_the_method_once(run, tmp_path, configured):
    export.main([str(run), str(tmp_path / "merged"), "--merged"])
    assert configured == ["acs"]


def test_the_method_is_checked_in_one_place_whatever_built_its_settings():
    """MethodSettings.configured checks every value of the method's settings as a flag's is checked, so a
    mapping from Python (a bench script, a run's config.json read by evaluate.py) is refused or read alike."""
    with pytest.raises(ValueError, match="lambda_: -1: expected a number >= 0"):
        method_for({"method": "tes", "lambda_": -1})
    with pytest.raises(ValueError, match="method_options: gamma: -2: expected a number >= 0"):
        method_for({"method": "tes", "method_options": {"gamma": -2}})
    assert method_for({"method": "tes", "layers": "0,3"}).layers == [0, 3]  # read as --layers 0,3 reads it
