"""--lora-dtype bfloat16: the adapters (and their gradients) in bf16, trained by torchao's low-bit AdamW with its
update rounded to bf16 stochastically; recorded in config.json, resumed bit for bit, read back with the adapter;
refused with torch's AdamW, which would round small steps away."""
import json

import pytest
import torch
from safetensors.torch import load_file

from minimoe.cli import evaluate, sweep, train
from minimoe.making.tiny import tiny_checkpoint
from minimoe.runs import install
from tests.kill import killed_after

pytest.importorskip("torchao")  # the quant extra's


@pytest.fixture(autouse=True)
def eager(monkeypatch):
    """torchao's update, eagerly (tests/runs/test_optimizers.py says why)."""
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)


SMOKE = ["--model", "tiny", "--batch-size", "2", "--epochs", "1", "--quiet", "--method", "tes",
         "--save-every-steps", "2", "--optim", "adamw8bit", "--lora-dtype", "bfloat16"]


def run_train(tmp_path, data, *flags, name):
    train.main(["--out-dir", str(tmp_path), "--run-name", name, "--data", str(data), *SMOKE, *flags])
    return tmp_path / name


def test_a_bf16_lora_run_is_recorded_resumed_bitwise_and_its_adapter_is_bf16(tmp_path, data):
    """config.json records the dtype; the adapter's LoRA tensors are bf16 (the method's heads fp32) and trained (B
    moved off 0); evaluate.py on the run folder scores the test split as train.py did at its end, to the digit (the
    adapter read back in bf16); a run killed after step 3 resumes from its step-2 checkpoint to the same steps and
    adapter, bit for bit (the stochastic rounding draws from the run's generator, which the checkpoint restores)."""
    straight = run_train(tmp_path, data, name="straight")
    evaluate.main(["--adapter", str(straight), "--eval-dir", str(tmp_path / "evaluated")])
    scored = [json.loads((folder / "metrics.json").read_text()) for folder in (straight / "eval" / "test",
                                                                                tmp_path / "evaluated")]
    assert [m["choice_nll"] for m in scored[:1]] == [m["choice_nll"] for m in scored[1:]]
    assert json.loads((straight / "config.json").read_text())["lora_dtype"] == "bfloat16"
    adapter = load_file(straight / "checkpoints" / "epoch-1" / "adapter.safetensors")
    lora = {k: v for k, v in adapter.items() if "lora_" in k}
    assert lora and {v.dtype for v in lora.values()} == {torch.bfloat16}
    assert {v.dtype for k, v in adapter.items() if k not in lora} <= {torch.float32}
    assert any(v.abs().sum() > 0 for k, v in lora.items() if "lora_B" in k)
    with pytest.raises(SystemExit, match="stopped after step 3"), killed_after(steps=3):
        run_train(tmp_path, data, "--no-test-eval", name="killed")
    run_train(tmp_path, data, "--no-test-eval", "--resume", name="killed")
    steps = [[(r["step"], r["loss"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if r["kind"] == "step"] for run in (straight, tmp_path / "killed")]
    assert steps[0] == steps[1]
    got = load_file(tmp_path / "killed" / "checkpoints" / "epoch-1" / "adapter.safetensors")
    assert all(torch.equal(adapter[k], got[k]) for k in adapter)


def test_the_update_is_rounded_stochastically_so_small_steps_are_kept():
    """A bf16 weight of 1.0 (spacing 2^-7 above it) under steps of ~2^-12 (lr, Adam's normalised step of ~1):
    rounded to nearest, every step is lost; with train.py's options the mean weight moves by the steps' sum."""
    moved = {}
    for options in ({}, install.optimizer_options("adamw8bit")):
        p = torch.nn.Parameter(torch.ones(8192, dtype=torch.bfloat16))
        torch.manual_seed(0)
        optimizer = install.optimizer_class("adamw8bit")([p], lr=2**-12, weight_decay=0.0, **options)
        for _ in range(16):
            p.grad = torch.full_like(p, -1.0)  # a constant gradient: each step adds lr
            optimizer.step()
        moved[bool(options)] = p.float().mean().item() - 1
    assert moved[False] == 0
    assert moved[True] == pytest.approx(16 * 2**-12, rel=0.05)


def test_bf16_lora_with_torchs_adamw_is_refused_before_any_folder(tmp_path):
    with pytest.raises(SystemExit, match="--lora-dtype bfloat16 with --optim adamw"):
        train.main(["--out-dir", str(tmp_path), "--model", "tiny", "--lora-dtype", "bfloat16", "--quiet"])
    assert not any(tmp_path.iterdir())


def test_the_sweep_passes_lora_dtype_and_tells_runs_apart_by_it(tmp_path, data):
    cell, = sweep.main(["--preset", "main", "--models", str(tiny_checkpoint()), "--benchmarks", str(data), "--rows",
                        "CE", "--seeds", "42", "--out-dir", str(tmp_path), "--dry-run", "--", "--optim", "adamw8bit",
                        "--lora-dtype", "bfloat16"])
    args = cell.train_args()
    assert args[args.index("--lora-dtype") + 1] == "bfloat16"
    record = {**cell.flags, "recipe": "tiny"}  # as a finished run's config.json records them
    assert cell.changed({**record, "lora_dtype": "float32"}) == ["lora_dtype"] and cell.changed(record) == []
