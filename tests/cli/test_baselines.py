"""The field's baselines (DenseMixer, router-only tuning, the family's load-balancing loss) through the
same commands as the paper's methods, on the tiny OLMoE: train, kill and resume, evaluate, export; router-only
tuning and --aux-coef family on every family."""
import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from minimoe.core.decoder.family_record import family_of
from minimoe.cli import evaluate, export, train
from minimoe.loading.checkpoint import from_pretrained
from minimoe.making.tiny import FAMILY_SWITCHES, tiny_checkpoint
from minimoe.runs.install import aux_coefficient
from tests.conftest import by_oracle, oracle, tiny_config
from tests.kill import killed_after

SMOKE = ["--model", "tiny", "--batch-size", "4", "--quiet"]


def run_train(tmp_path, data, *flags, name="run"):
    """A run on `data` (conftest: 8 training examples, 4 validation, 4 test): two steps an epoch."""
    train.main(["--out-dir", str(tmp_path), "--run-name", name, "--data", str(data), *SMOKE, *flags])
    return tmp_path / name


def adapter(run, epoch):
    return load_file(run / "checkpoints" / f"epoch-{epoch}" / "adapter.safetensors")


def steps(run):
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "step"]


def test_densemixer_trains_its_gates_evaluates_and_exports(tmp_path, data):
    """DenseMixer on every MoE layer: LoRA and every gate train; a fresh evaluate.py gives the run's own
    test accuracy; it routes natively, so it exports to peft (the gates as modules_to_save)."""
    run = run_train(tmp_path, data, "--method", "densemixer", "--layers", "all", "--epochs", "1")
    tensors = adapter(run, 1)
    assert sum(k.endswith(".mlp.gate.weight") for k in tensors) == 4 and any(".lora_B" in k for k in tensors)
    again = evaluate.main(["--adapter", str(run), "--out-dir", str(tmp_path / "again")])
    assert again["accuracy"] == json.loads((run / "eval" / "test" / "metrics.json").read_text())["accuracy"]
    export.main([str(run), str(tmp_path / "peft")])
    assert len(json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["modules_to_save"]) == 4


def test_esft_chooses_its_experts_once_and_resumes_bitwise(tmp_path, data):
    """ESFT on every MoE layer: the choice is made from the training data before the first step and kept in
    the adapter; only the chosen experts' LoRA moves; killed after epoch 1 and resumed (no new choice), the
    run ends on the uninterrupted run's bits."""
    flags = ["--method", "esft", "--layers", "all", "--epochs", "2", "--no-test-eval"]
    straight = run_train(tmp_path, data, *flags, name="straight")
    with pytest.raises(SystemExit, match="stopped after epoch 1"), killed_after(epochs=1):
        run_train(tmp_path, data, *flags, name="killed")
    resumed = run_train(tmp_path, data, *flags, "--resume", name="killed")
    want, got = adapter(straight, 2), adapter(resumed, 2)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    for layer in range(4):
        prefix = f"model.layers.{layer}."
        chosen = want[prefix + "mlp.router.chosen"]
        assert 0 < chosen.sum() < chosen.numel()
        for bank in ("gate_up_proj", "down_proj"):
            b = want[f"{prefix}mlp.experts.{bank}.lora_B"]
            assert b[~chosen].abs().max() == 0 and b[chosen].abs().max() > 0
        assert not want[prefix + "self_attn.q_proj.lora_B"].any()  # attention's LoRA frozen at zero
    assert not any(k.endswith(".mlp.gate.weight") for k in want)
    export.main([str(straight), str(tmp_path / "peft")])  # the LoRA form exports; the choice is training's own
    assert not any("router" in k for k in load_file(tmp_path / "peft" / "adapter_model.safetensors"))


def test_esft_full_form_trains_only_the_chosen_rows_resumes_bitwise_and_evaluates(tmp_path, data, capsys):
    """ESFT's full form on every MoE layer: the chosen experts' rows train (as router state `rows`, in the
    adapter), no LoRA and no gate does; the optimizer holds state for those rows only; killed after epoch 1
    and resumed, the run ends on the uninterrupted run's bits; evaluate.py gives the run's own accuracy;
    export to peft is refused, naming why (the merged export: tests/integrations/test_hf_export.py)."""
    flags = ["--method", "esft", "--esft-form", "full", "--layers", "all", "--epochs", "2"]
    straight = run_train(tmp_path, data, *flags, name="straight")
    with pytest.raises(SystemExit, match="stopped after epoch 1"), killed_after(epochs=1):
        run_train(tmp_path, data, *flags, "--no-test-eval", name="killed")
    resumed = run_train(tmp_path, data, *flags, "--no-test-eval", "--resume", name="killed")
    want, got = adapter(straight, 2), adapter(resumed, 2)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    base = from_pretrained(tiny_checkpoint()).model.layers
    moving = 0
    for layer in range(4):
        prefix = f"model.layers.{layer}.mlp."
        chosen = want[prefix + "router.chosen"]
        assert 0 < chosen.sum() < chosen.numel()
        for bank in ("gate_up_proj", "down_proj"):
            rows, bank_w = want[f"{prefix}router.rows.{bank}"], getattr(base[layer].mlp.experts, bank).weight
            assert rows.shape == (int(chosen.sum()), *bank_w.shape[1:])
            assert (rows != bank_w[chosen]).any()  # trained away from the chosen experts' base rows
            moving += rows.numel()
    assert not any(k.endswith((".lora_B", ".mlp.gate.weight")) for k in want if want[k].any())  # B still 0
    state = torch.load(straight / "checkpoints" / "epoch-2" / "training_state.pt", weights_only=False)["optimizer"]
    assert sum(s["exp_avg"].numel() for s in state["state"].values()) == moving  # the chosen rows' only
    again = evaluate.main(["--adapter", str(straight), "--out-dir", str(tmp_path / "again")])
    assert again["accuracy"] == json.loads((straight / "eval" / "test" / "metrics.json").read_text())["accuracy"]
    with pytest.raises(SystemExit):
        export.main([str(straight), str(tmp_path / "peft")])
    assert "trains expert weights in full" in capsys.readouterr().err and not (tmp_path / "peft").exists()


def test_router_only_trains_the_gates_and_nothing_else_and_exports(tmp_path, data):
    """Router-only tuning: every gate moves, the LoRA stays at B = 0 (the model is the base's but for its
    gates); the run exports to peft (the gates as modules_to_save) and merged."""
    run = run_train(tmp_path, data, "--method", "router", "--layers", "all", "--epochs", "1", "--no-test-eval")
    tensors = adapter(run, 1)
    assert all(not v.any() for k, v in tensors.items() if k.endswith(".lora_B"))
    base = load_file(tiny_checkpoint() / "model.safetensors")
    gates = [k for k in tensors if k.endswith(".mlp.gate.weight")]
    assert len(gates) == 4 and all(not torch.equal(tensors[k], base[k].float()) for k in gates)
    assert json.loads((run / "config.json").read_text())["method"]["name"] == "router"
    export.main([str(run), str(tmp_path / "peft")])
    saved = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert len(saved["modules_to_save"]) == 4
    export.main([str(run), str(tmp_path / "merged"), "--merged"])
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    assert all(torch.equal(merged[k], tensors[k].to(merged[k].dtype)) for k in gates)


def test_the_familys_load_balancing_loss_weighs_the_step_at_its_coefficient(tmp_path, data):
    """--aux-coef family: the step's loss is task + router_aux_loss_coef * aux, the run named for it."""
    run = run_train(tmp_path, data, "--method", "ce", "--aux-coef", "family", "--epochs", "1", "--no-test-eval")
    coef = json.loads((tiny_checkpoint() / "config.json").read_text()).get("router_aux_loss_coef", 0.01)
    for s in steps(run):
        assert s["aux"] > 0 and s["loss"] == pytest.approx(s["task"] + coef * s["aux"], rel=1e-6)


def transformers_applies_aux_loss(model_type: str) -> bool:
    """Whether transformers' causal-LM class of the family adds router_aux_loss_coef * its load-balancing loss
    (the oracle: its modeling file calls load_balancing_loss_func in that class's forward)."""
    import inspect
    transformers = oracle("transformers")
    names = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # Mistral 4's is not mapped
    name = names.get(model_type) or family_of(model_type).architecture
    return "load_balancing_loss_func(" in inspect.getsource(getattr(transformers, name).forward)


@pytest.mark.parametrize("family", by_oracle(FAMILY_SWITCHES))
def test_aux_coef_family_is_the_checkpoints_coefficient_or_refused(family):
    """Each family's router_aux_loss_coef, as its config.json gives it, where transformers trains with it;
    refused by name where it does not (DeepSeek's and GLM-4.5's configs lack the field, Llama 4's modeling file
    never applies it), and a number still works."""
    config = tiny_config(family, router_aux_loss_coef=0.123)
    cfg = SimpleNamespace(aux_coef="family")
    if transformers_applies_aux_loss(family):
        assert aux_coefficient(cfg, config) == 0.123
    else:
        with pytest.raises(ValueError, match=f"--aux-coef family: .*{family}'s .*router_aux_loss_coef"):
            aux_coefficient(cfg, config)
        assert aux_coefficient(SimpleNamespace(aux_coef=0.01), config) == 0.01


@pytest.mark.parametrize("family", list(FAMILY_SWITCHES))
def test_router_only_tuning_is_defined_on_every_familys_router(family):
    """install_method("router") on each family's tiny model: what trains is exactly every MoE block's native
    gate weight (as every method that tunes the gate: gpt-oss's router bias and DeepSeek's and GLM's score
    correction bias stay frozen); an AdamW step moves each and leaves every other tensor (base, LoRA at B = 0)."""

    from minimoe.core.routing_methods.routing import moe_blocks
    from minimoe.runs.config import build_config
    from minimoe.runs.training import install_method
    from tests.conftest import tiny_model
    cfg = build_config({"method": "router", "layers": "all", "lora_dropout": 0.0, "device": "cpu"}, "tiny")
    model = tiny_model(family).train()
    install_method(model, cfg)
    gates = {id(block.gate.weight) for block in moe_blocks(model).values()}
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert gates and trainable == gates, family
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))).logits.square().mean().backward()
    optimizer.step()
    names = {id(p): n for n, p in model.named_parameters()}
    moved = {n for n, v in model.state_dict().items() if not torch.equal(v, before[n])}
    assert moved == {names[i] for i in gates}, family
