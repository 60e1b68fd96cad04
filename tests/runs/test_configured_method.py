"""A configured method is one object (methods.Method, `configure`d): train.py's flags resolve to it once,
and the model routes with that same object; evaluate.py and export.py --merged resolve a run's method
once and hand it on (folder.AdapterSource.method -> load_adapter), never by its name again."""
import pytest

from minimoe import from_pretrained
from minimoe.cli import evaluate, export, train
from minimoe.core.methods import Method
from minimoe.making.tiny import tiny_checkpoint
from minimoe.runs.training import install_method


def test_the_flags_resolve_to_one_object_that_the_router_holds():
    args = train.parse_args(["--model", "tiny", "--method", "tes", "--objective", "enll", "--lambda", "0.01",
                             "--layers", "all", "--tune-router", "--gamma", "2"])
    model = from_pretrained(tiny_checkpoint())
    cfg, method = train.resolve_config(args, model.config)
    assert (method.name, method.objective, method.lambda_, method.layers, method.tune_router, method.values["gamma"]) == (
        "tes", "enll", 0.01, "all", True, 2.0)  # name, objective, lambda, scope, gate, options: on the one object
    install_method(model, cfg, method)
    assert model.router_method is method  # not a copy: what training and saving read is what the flags made
    assert model.router_spec == method.spec(list(range(model.config.num_hidden_layers)))


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
