"""One method record (Method.record / Method.from_record): every method survives the JSON round trip with
every setting off its default; an adapter holds the same record as config.json; load_adapter checks the
whole record, naming the field that differs; an adapter_config.json of the older layout still loads."""
import json

import pytest
import torch

from minimoe.core.adaptation.lora import add_lora
from minimoe.core.routing_methods.methods import METHODS, Method, set_router
from minimoe.runs.adapters import load_adapter, save_adapter
from minimoe.runs.config import method_for
from minimoe.runs.user_methods import method_of
from tests.conftest import tiny_model


def off_default(name: str, option):
    """A value of `option` other than its default that its own check accepts: another choice, or half the
    default number (every built-in bound admits it: rates > 0, gamma >= 0, p in (0, 1], mix in [0, 1])."""
    if option.choices:
        return next(c for c in option.choices if c != option.default)
    value = option.parse(name, option.default / 2)
    assert value != option.default, name
    return value


@pytest.mark.parametrize("name", list(METHODS))
def test_a_configured_method_survives_its_record_as_json(name):
    method = METHODS[name]
    options = {k: off_default(k, o) for k, o in method.declared.items()}
    configured = method.configure("enll", True, options, lambda_=0.02, layers=[0, 2])
    record = json.loads(json.dumps(configured.record()))
    assert record == {"name": name, "module": method.module, "objective": "enll", "lambda_": 0.02, "layers": [0, 2],
                      "tune_router": True, "options": options}
    for again in (Method.from_record(record), method_of(record)):  # core's reader, and the one outside core
        assert again.record() == configured.record() and again.policy is configured.policy
        assert (again.row, again.policy_options) == (configured.row, configured.policy_options)
    assert method_for({"method": name, "method_options": options, "objective": "enll", "lambda_": 0.02,
                       "layers": [0, 2], "tune_router": True}).record() == record  # the settings' builder too


def test_a_record_with_a_key_it_does_not_know_is_refused():
    with pytest.raises(ValueError, match=r"\['gama'\] not understood; expected the keys"):
        Method.from_record({"name": "tes", "gama": 2})


def trained_adapter(path):
    """A tiny model with TES (every setting off its default) and LoRA, saved to `path` -> (model, method)."""
    method = method_for({"method": "tes", "objective": "enll", "lambda_": 0.02, "method_options": {"gamma": 2.0}})
    model = add_lora(set_router(tiny_model("olmoe"), method), rank=4)
    save_adapter(model, path, base_model="tiny-base")
    return model, method


def test_an_adapter_holds_the_runs_record_and_load_adapter_checks_every_field(tmp_path):
    model, method = trained_adapter(tmp_path / "adapter")
    file = tmp_path / "adapter" / "adapter_config.json"
    saved = json.loads(file.read_text())["router"]
    assert saved == {**method.record(), "layers": model.router_layers}  # config.json's record, on its layers
    fresh = load_adapter(tiny_model("olmoe"), tmp_path / "adapter")  # its own record
    assert fresh.router_spec == saved
    assert load_adapter(tiny_model("olmoe"), tmp_path / "adapter", method=method).router_spec == saved  # a run's
    for other, field in ((method_for({"method": "tes", "objective": "is", "lambda_": 0.02,
                                      "method_options": {"gamma": 2.0}}), "objective = 'enll'"),
                         (method_for({"method": "tes", "objective": "enll", "lambda_": 0.02}), "options.gamma = 2.0"),
                         (method_for({"method": "tes", "objective": "enll", "lambda_": 0.01,
                                      "method_options": {"gamma": 2.0}}), "lambda_ = 0.02")):
        with pytest.raises(ValueError, match=f"its method record has {field}; the method given"):
            load_adapter(tiny_model("olmoe"), tmp_path / "adapter", method=other)


def test_an_adapter_config_of_the_older_layout_still_loads(tmp_path):
    """Before the one record, an adapter's "router" held the policy's options at its top level beside
    "method", "layers" and "tune_router", and no objective nor lambda."""
    model, _ = trained_adapter(tmp_path / "adapter")
    with torch.no_grad():  # B off zero: the loaded LoRA then shows in the logits
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(generator=torch.Generator().manual_seed(1))
    save_adapter(model, tmp_path / "adapter", base_model="tiny-base")
    file = tmp_path / "adapter" / "adapter_config.json"
    config = json.loads(file.read_text())
    old = {"method": "tes", "layers": model.router_layers, "tune_router": False, "gamma": 2.0, "tau": 1.0,
           "transform": "started-log"}
    file.write_text(json.dumps(config | {"router": old}))
    fresh = load_adapter(tiny_model("olmoe"), tmp_path / "adapter")
    assert fresh.router_method.name == "tes" and fresh.router_method.policy_options == model.router_method.policy_options
    ids = torch.randint(3, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    assert torch.equal(fresh(ids).logits, model(ids).logits)
    file.write_text(json.dumps(config | {"router": old | {"gamma": 3.0}}))  # the old layout is checked as well
    with pytest.raises(ValueError, match="its method record has options.gamma = 3.0; the method given"):
        load_adapter(tiny_model("olmoe"), tmp_path / "adapter", method=model.router_method)
