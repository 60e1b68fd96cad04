"""train.py end to end on the tiny checkpoint: every method, resume, 2-process DDP, bad input."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train
from minimoe.tiny import tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]
SMOKE = ["--model", "tiny", "--max-train-examples", "16", "--batch-size", "8", "--epochs", "1", "--no-test-eval", "--quiet"]


def run_train(tmp_path, *flags, name="run"):
    train.main(["--out-dir", str(tmp_path), "--run-name", name, "--data-dir", str(tmp_path / "splits"), *SMOKE, *flags])
    return tmp_path / name


def adapter(run, epoch):
    return load_file(run / "checkpoints" / f"epoch-{epoch}" / "adapter.safetensors")


@pytest.mark.parametrize("flags", [
    ["--method", "ce"],
    ["--method", "ce", "--tune-router"],
    ["--method", "dual"],
    ["--method", "tes", "--objective", "is"],
    ["--method", "tes", "--objective", "enll", "--transform", "log", "--layers", "all"],
    ["--method", "acs", "--objective", "is", "--aux-coef", "0.01"],
    ["--method", "acs", "--objective", "enll", "--tune-router", "--layers", "last:2", "--depth-scaled-lambda"],
])
def test_every_method_trains_and_records_its_run(tmp_path, flags):
    """A few steps of each method: run folder complete, config resolved, heads saved, loss finite."""
    run = run_train(tmp_path, *flags)
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["method"] == flags[1] and cfg["lr"] == 2e-3 and cfg["lora_rank"] == 8  # recipe + flags resolved
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["kind"] for s in steps] == ["step", "step", "epoch"]
    assert all(torch.isfinite(torch.tensor(s["loss"])) for s in steps if s["kind"] == "step")
    assert json.loads((run / "selection.json").read_text())["selected_epoch"] == 1
    tensors = adapter(run, 1)
    assert any(".lora_B" in k for k in tensors)
    heads = {"dual": ".router.affinity.", "tes": ".router.error_head."}.get(flags[1])
    if heads:
        assert any(heads in k for k in tensors)
    if "--tune-router" in flags:
        assert any(k.endswith(".mlp.gate.weight") for k in tensors)
    if flags[1] in ("tes", "acs"):
        assert all(s["method"] > 0 for s in steps if s["kind"] == "step")


def test_same_seed_gives_identical_runs(tmp_path):
    a = run_train(tmp_path, "--method", "tes", name="a")
    b = run_train(tmp_path, "--method", "tes", name="b")
    for key, value in adapter(a, 1).items():
        assert torch.equal(value, adapter(b, 1)[key]), key


def test_resume_after_a_kill_ends_where_the_uninterrupted_run_does(tmp_path):
    """Killed after epoch 1, resumed: epoch-2 adapter, optimizer path and metrics equal the straight run."""
    straight = run_train(tmp_path, "--method", "tes", "--epochs", "2", name="straight")
    with pytest.raises(SystemExit, match="stopped after epoch 1"):
        run_train(tmp_path, "--method", "tes", "--epochs", "2", "--stop-after-epochs", "1", name="killed")
    assert not (tmp_path / "killed" / "checkpoints" / "epoch-2").exists()
    resumed = run_train(tmp_path, "--method", "tes", "--epochs", "2", "--resume", name="killed")
    for key, value in adapter(straight, 2).items():
        assert torch.equal(value, adapter(resumed, 2)[key]), key
    def losses(run):
        records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        return [r["loss"] for r in records if r["kind"] == "step"]
    assert losses(straight) == losses(resumed)


def test_two_process_ddp_equals_one_process(tmp_path):
    """torchrun --nproc_per_node 2 (gloo) with the same global batch gives the one-process adapter."""
    tiny_checkpoint()
    flags = ["--method", "acs", "--lora-dropout", "0", "--data-dir", str(tmp_path / "splits"), *SMOKE]
    run_train(tmp_path, "--method", "acs", "--lora-dropout", "0", name="one")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517",
                    str(REPO / "train.py"), "--out-dir", str(tmp_path), "--run-name", "two", *flags],
                   check=True, cwd=REPO, env=env, capture_output=True, timeout=600)
    assert json.loads((tmp_path / "two" / "config.json").read_text())["world_size"] == 2
    def steps(run, key):
        return torch.tensor([r[key] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                             if r["kind"] == "step"])
    # The step losses and the global gradient norms are what DDP must reproduce: tight.
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(steps(tmp_path / "two", key), steps(tmp_path / "one", key), rtol=1e-5, atol=0)
    # Adam's update is ~lr * sign(g) even for gradients at rounding level, so an element whose gradient
    # is ~0 may step differently (bounded by 2 * lr * steps); every other element must agree to 1e-5.
    one, two = adapter(tmp_path / "one", 1), adapter(tmp_path / "two", 1)
    diffs = torch.cat([(two[k] - one[k]).abs().flatten() for k in one])
    assert diffs.max() <= 2 * 2e-3 * 2
    assert (diffs > 1e-5).float().mean() <= 0.01


def test_unknown_dataset_fails_before_any_run_folder(tmp_path):
    with pytest.raises(ValueError, match="unknown dataset"):
        run_train(tmp_path, "--data", "not_a_benchmark")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("content, message", [("", "empty"), ('{"id": "x"\n', r"train.jsonl:1: invalid JSON")])
def test_bad_manifest_fails_before_any_run_folder(tmp_path, content, message):
    data = tmp_path / "manifests"
    data.mkdir()
    for split in ("train", "val", "test"):
        (data / f"{split}.jsonl").write_text(content)
    with pytest.raises(ValueError, match=message):
        run_train(tmp_path, "--data", str(data))
    assert not (tmp_path / "run").exists()


def test_existing_run_folder_is_not_overwritten(tmp_path):
    run_train(tmp_path, "--method", "ce")
    with pytest.raises(SystemExit, match="exists; pass --resume"):
        run_train(tmp_path, "--method", "ce")
