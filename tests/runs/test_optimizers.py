"""--optim adamw8bit / adamw4bit (torchao.optim's AdamW with its moments in 8 or 4 bits): the state is saved
with each checkpoint and restored bit for bit, it matters to the result, ESFT's masked experts stay at zero
under it, and the learning-rate groups and schedule are AdamW's."""
import json
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from minimoe.cli import sweep, train
from minimoe.making.tiny import tiny_checkpoint
from minimoe.runs import install
from minimoe.runs.config import build_config
from minimoe.runs.training import install_method, make_optimizer
from tests.conftest import tiny_model
from tests.kill import killed_after

pytest.importorskip("torchao")  # the quant extra's
optim = install.optimizer_class
COMPILE = torch.compile  # before the `eager` fixture replaces it


@pytest.fixture(autouse=True)
def eager(monkeypatch):
    """torchao's step compiles its update for each parameter shape (torch.compile): on this CPU a minute or more
    of compiling per test, so the tests run it eagerly, the same ops on the same state tensors (docs/quantization.md)."""
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)


# 8 training examples at 2 a step: 4 steps; a step checkpoint every 2
SMOKE = ["--model", "tiny", "--batch-size", "2", "--epochs", "1", "--no-test-eval", "--quiet", "--method", "tes",
         "--save-every-steps", "2"]


def run_train(tmp_path, data, *flags, name):
    train.main(["--out-dir", str(tmp_path), "--run-name", name, "--data", str(data), *SMOKE, *flags])
    return tmp_path / name


def steps(run):
    return [(r["step"], r["loss"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "step"]


def test_a_killed_low_bit_run_resumes_bitwise_and_needs_its_optimizer_state(tmp_path, data):
    """Killed after step 3 (its step-2 checkpoint holds torchao's 8-bit moments: codes and block scales), resumed:
    the step records and the adapter equal the run never killed, bit for bit. The same checkpoint with its
    optimizer state emptied (fresh moments) resumes to another adapter: the restored state is what made it equal."""
    flags = ["--optim", "adamw8bit"]
    straight = run_train(tmp_path, data, *flags, name="straight")
    assert json.loads((straight / "config.json").read_text())["optim"] == "adamw8bit"
    with pytest.raises(SystemExit, match="stopped after step 3"), killed_after(steps=3):
        run_train(tmp_path, data, *flags, name="killed")
    state_file = tmp_path / "killed" / "checkpoints" / "step-2" / "training_state.pt"
    state = torch.load(state_file, weights_only=True)["optimizer"]  # as the run folder loads it
    kinds = {type(s["exp_avg"]).__name__ for s in state["state"].values()}
    assert kinds == {"OptimState8bit", "Tensor"}  # the expert banks' LoRA in 8 bits; tensors < 4096 values in fp32
    shutil.copytree(tmp_path / "killed", tmp_path / "fresh")
    run_train(tmp_path, data, *flags, "--resume", name="killed")
    assert steps(tmp_path / "killed") == steps(straight)
    want, got = (load_file(r / "checkpoints" / "epoch-1" / "adapter.safetensors") for r in (straight, tmp_path / "killed"))
    assert all(torch.equal(want[k], got[k]) for k in want)

    emptied = torch.load(tmp_path / "fresh" / "checkpoints" / "step-2" / "training_state.pt", weights_only=True)
    emptied["optimizer"]["state"] = {}
    torch.save(emptied, tmp_path / "fresh" / "checkpoints" / "step-2" / "training_state.pt")
    run_train(tmp_path, data, *flags, "--resume", name="fresh")
    fresh = load_file(tmp_path / "fresh" / "checkpoints" / "epoch-1" / "adapter.safetensors")
    assert steps(tmp_path / "fresh")[:2] == steps(straight)[:2] and steps(tmp_path / "fresh")[3] != steps(straight)[3]
    assert any(not torch.equal(want[k], fresh[k]) for k in want)


@pytest.mark.parametrize("name, form", [("adamw4bit", "lora"), ("adamw8bit", "full")])
def test_esft_trains_under_low_bit_moments_as_under_adamw(tmp_path, data, name, form):
    """ESFT's LoRA form zeroes the unchosen experts' gradient (a hook): in low-bit moments a zero must stay an exact
    zero, or B of an unchosen expert would move (a block mixes chosen and unchosen experts' rows). Its full form's
    rows train in their own group at --esft-lr's rate, their moments in low bits."""
    run = run_train(tmp_path, data, "--optim", name, "--method", "esft", "--layers", "all", "--esft-form", form,
                    name="esft")
    adapter = load_file(run / "checkpoints" / "epoch-1" / "adapter.safetensors")
    state = torch.load(run / "checkpoints" / "epoch-1" / "training_state.pt", weights_only=True)["optimizer"]
    if form == "lora":
        for layer in range(4):
            chosen = adapter[f"model.layers.{layer}.mlp.router.chosen"]
            for bank in ("gate_up_proj", "down_proj"):
                b = adapter[f"model.layers.{layer}.mlp.experts.{bank}.lora_B"]
                assert b[~chosen].abs().max() == 0 and b[chosen].abs().max() > 0
    else:
        group, = state["param_groups"]
        assert group["name"] == "esft" and float(group["initial_lr"]) == pytest.approx(1e-5)  # ESFT's default rate
        assert {type(s["exp_avg"]).__name__ for s in state["state"].values()} == {"OptimState8bit"}


@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)` before")  # no step is taken here
@pytest.mark.parametrize("name", ["adamw8bit", "adamw4bit"])
def test_the_groups_keep_their_rates_and_schedule(name):
    """The method's head groups and a tuned gate keep their learning rates and weight decay, and the schedule
    moves them as it moves torch's AdamW's (torchao holds each rate as a tensor, filled in place)."""
    cfg = build_config({"method": "tes", "tune_router": True, "router_lr": 3e-3, "weight_decay": 0.05}, "tiny")
    install_method(model := tiny_model("olmoe"), cfg)
    low, full = make_optimizer(model, replace(cfg, optim=name)), make_optimizer(model, cfg)
    assert type(low) is optim(name) and type(full) is torch.optim.AdamW and len(full.param_groups) == 3
    assert {g["weight_decay"] for g in low.param_groups} == {0.05}  # the run's, not the library's default
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.5 ** s) for o in (low, full)]
    for _ in range(3):
        assert [(g["name"], pytest.approx(float(g["lr"]), rel=1e-7), g["weight_decay"], [p.shape for p in g["params"]])
                for g in low.param_groups] == [(g["name"], g["lr"], g["weight_decay"], [p.shape for p in g["params"]])
                                               for g in full.param_groups]  # fp32 rates there: rounded once
        for s in schedules:
            s.step()


def test_the_sweep_passes_optim_and_tells_runs_apart_by_it(tmp_path, data):
    """--optim after a sweep's `--` reaches every cell's train.py flags; a finished run made with another optimizer
    is a changed cell (its config.json records the optimizer), not a done one."""
    cell, = sweep.main(["--preset", "main", "--models", str(tiny_checkpoint()), "--benchmarks", str(data), "--rows",
                        "CE", "--seeds", "42", "--out-dir", str(tmp_path), "--dry-run", "--", "--optim", "adamw8bit"])
    args = cell.train_args()
    assert args[args.index("--optim") + 1] == "adamw8bit"
    record = {**cell.flags, "recipe": "tiny"}  # as a finished run's config.json records them
    assert cell.changed({**record, "optim": "adamw"}) == ["optim"] and cell.changed(record) == []


def test_low_bit_optimizers_are_refused_without_torchao(tmp_path, monkeypatch):
    """--optim adamw4bit without torchao: refused naming the extra, before any run folder."""
    def missing(name):
        raise ImportError("No module named 'torchao'")
    monkeypatch.setattr(install, "torchao_module", missing)
    with pytest.raises(SystemExit, match=r'--optim adamw4bit needs torchao.*pip install -e "\.\[quant\]"'):
        train.main(["--out-dir", str(tmp_path), "--model", "tiny", "--optim", "adamw4bit", "--quiet"])
    assert not any(tmp_path.iterdir())


def test_the_compiled_8bit_update_is_the_eager_one(monkeypatch):
    """torchao's AdamW8bit compiles its update (torch.compile, inductor: C++ on the CPU) at a run's first step, which
    the other tests here run eagerly. Three steps of one [64, 64] parameter (4096 values: 8-bit moments, 16 blocks of
    256), compiled against eager from the same gradients: the same 8-bit codes, and the block scales and the
    parameter within fp32 rounding (the compiled kernel fuses the update). A fresh compile took ~30 s here."""
    import shutil
    if not shutil.which("c++"):
        pytest.skip("inductor's CPU code needs a C++ compiler")

    def steps_of(compile_fn):
        monkeypatch.setattr(torch, "compile", compile_fn)
        g = torch.Generator().manual_seed(0)
        p = torch.nn.Parameter(torch.randn(64, 64, generator=g))
        optimizer = optim("adamw8bit")([p], lr=1e-2, weight_decay=0.01)
        for _ in range(3):
            p.grad = torch.randn(64, 64, generator=g)
            optimizer.step()
        return p.detach(), optimizer.state[p]
    eager_p, eager_state = steps_of(lambda fn, **options: fn)
    torch._dynamo.reset()
    compiled_p, compiled_state = steps_of(COMPILE)
    for moment in ("exp_avg", "exp_avg_sq"):
        want, got = eager_state[moment], compiled_state[moment]
        assert type(got).__name__ == "OptimState8bit" and torch.equal(got.codes, want.codes), moment
        torch.testing.assert_close(got.scale, want.scale, rtol=1e-6, atol=0, msg=moment)
    torch.testing.assert_close(compiled_p, eager_p, rtol=0, atol=1e-6)
