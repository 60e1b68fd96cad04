"""train.py end to end on the tiny checkpoint: every method, resume, 2-process DDP, bad input."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from minimoe.cli import train
from minimoe.core.routing_methods.methods import ALIASES
from minimoe.making.tiny import tiny_checkpoint
from tests.kill import killed_after

REPO = Path(__file__).resolve().parents[2]
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
    assert cfg["method"]["name"] == ALIASES.get(flags[1], flags[1])  # ce = native
    assert cfg["lr"] == 2e-3 and cfg["lora_rank"] == 8  # recipe + flags resolved
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


def test_the_method_is_resolved_once_per_run(tmp_path, monkeypatch):
    """train.py turns --method into its Method once; installing the router, the optimizer, every step
    and the run's name and label use that object. Every name-to-record look-up ends in methods.get_method
    (Method.from_record's, which every builder ends in): counted over a whole two-step run."""
    from minimoe.core.routing_methods import methods
    from minimoe.runs import user_methods
    original, calls = methods.get_method, []

    def counted(name):
        calls.append(name)
        return original(name)
    monkeypatch.setattr(user_methods, "get_method", counted)
    monkeypatch.setattr(methods, "get_method", counted)
    run_train(tmp_path, "--method", "tes", "--batch-size", "4", "--grad-accum", "2")
    assert calls == ["tes"]


def test_the_command_line_is_parsed_once_per_launch(tmp_path, monkeypatch):
    """One argparse pass over a whole run, with a --config file: flags typed win over the file (one typed at
    its default value too, which only knowing what was typed tells apart), a typed option joins the file's
    options, and the file fills what was not typed; main's warning reads the flags typed off their defaults."""
    import argparse
    original, parses = argparse.ArgumentParser.parse_args, []

    def counted(self, *a, **k):
        parses.append(a)
        return original(self, *a, **k)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", counted)
    settings = tmp_path / "settings.json"
    settings.write_text(json.dumps({"method": "dual", "lambda_": 0.5, "method_options": {"mix": 0.25}, "epochs": 2}))
    args = train.parse_args(["--config", str(settings), "--method", "tes", "--gamma", "2", "--epochs", "1"])
    assert (args.method, args.lambda_, args.method_options, args.epochs) == ("tes", 0.5, {"mix": 0.25, "gamma": 2.0}, 1)
    assert args.typed == {"method_options": {"gamma": 2.0}, "epochs": 1}  # not --method tes: its default
    assert len(parses) == 1
    run_train(tmp_path, "--config", str(settings), "--method", "tes", "--epochs", "1")
    assert len(parses) == 2  # the run: one more
    assert json.loads((tmp_path / "run" / "config.json").read_text())["method"]["lambda_"] == 0.5


def test_the_device_and_dtype_are_resolved_once_per_run(tmp_path, monkeypatch):
    """train.py picks the run's device and dtype once (resolve_config); the model is loaded in that dtype,
    not in one picked again beside it (a bf16 pick on a CPU without bf16 instructions warned twice)."""
    calls = []

    def counted(pick):
        def wrapper(*args, **kwargs):
            calls.append(pick.__name__)
            return pick(*args, **kwargs)
        return wrapper
    monkeypatch.setattr(train, "pick_device", counted(train.pick_device))
    monkeypatch.setattr(train, "pick_dtype", counted(train.pick_dtype))
    run = run_train(tmp_path, "--method", "ce")
    assert sorted(calls) == ["pick_device", "pick_dtype"]
    assert json.loads((run / "config.json").read_text())["dtype"] == "float32"


def test_same_seed_gives_identical_runs(tmp_path):
    a = run_train(tmp_path, "--method", "tes", name="a")
    b = run_train(tmp_path, "--method", "tes", name="b")
    for key, value in adapter(a, 1).items():
        assert torch.equal(value, adapter(b, 1)[key]), key


def test_resume_after_a_kill_ends_where_the_uninterrupted_run_does(tmp_path):
    """Killed after epoch 1, resumed: epoch-2 adapter, optimizer path and metrics equal the straight run."""
    straight = run_train(tmp_path, "--method", "tes", "--epochs", "2", name="straight")
    with pytest.raises(SystemExit, match="stopped after epoch 1"), killed_after(epochs=1):
        run_train(tmp_path, "--method", "tes", "--epochs", "2", name="killed")
    assert not (tmp_path / "killed" / "checkpoints" / "epoch-2").exists()
    resumed = run_train(tmp_path, "--method", "tes", "--epochs", "2", "--resume", name="killed")
    for key, value in adapter(straight, 2).items():
        assert torch.equal(value, adapter(resumed, 2)[key]), key
    def losses(run):
        records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        return [r["loss"] for r in records if r["kind"] == "step"]
    assert losses(straight) == losses(resumed)


MID_EPOCH = ["--method", "tes", "--epochs", "2", "--max-train-examples", "24", "--batch-size", "4"]  # 6 steps an epoch


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """The uninterrupted MID_EPOCH run with extra flags, trained once per module."""
    runs = {}

    def get(*flags):
        if flags not in runs:
            runs[flags] = run_train(tmp_path_factory.mktemp("straight"), *MID_EPOCH, *flags, name="straight")
        return runs[flags]
    return get


@pytest.mark.parametrize("flags, save, kill, left, resume", [
    # killed in epoch 2, one step after its step checkpoint; resumed without --save-every-steps
    ([], ["--save-every-steps", "2"], 9, ["epoch-1", "step-8"], []),
    # 2 micro-batches a step, killed in epoch 1; resumed saving at other steps
    (["--batch-size", "2", "--grad-accum", "2"], ["--save-every-steps", "2"], 5, ["step-4"], ["--save-every-steps", "4"]),
])
def test_resume_from_a_mid_epoch_checkpoint_ends_where_the_uninterrupted_run_does(tmp_path, straight_run, flags, save,
                                                                                  kill, left, resume):
    """Killed after a step checkpoint (only the latest kept), with a torn log line: the resumed run starts at
    the checkpoint (the log's records up to it stay as written), skips the epoch's steps already done, and
    ends on the straight run's adapter and log; the step checkpoint goes once the epoch's is written."""
    straight = straight_run(*flags)
    with pytest.raises(SystemExit, match=f"stopped after step {kill}"), killed_after(steps=kill):
        run_train(tmp_path, *MID_EPOCH, *flags, *save, name="killed")
    run = tmp_path / "killed"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == left
    before = [r for r in records(run) if r["step"] <= int(left[-1].split("-")[1])]
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"kind": "step", "epoch": 2, "st')
    run_train(tmp_path, *MID_EPOCH, *flags, *resume, "--resume", name="killed")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["epoch-1", "epoch-2"]
    assert records(run)[:len(before)] == before  # timings included: these steps were not run again
    assert [{k: v for k, v in r.items() if k not in TIMINGS} for r in records(run)] == [
        {k: v for k, v in r.items() if k not in TIMINGS} for r in records(straight)]
    for key, value in adapter(straight, 2).items():
        assert torch.equal(value, adapter(run, 2)[key]), key


def test_corrupt_step_checkpoint_falls_back_to_the_epoch_before(tmp_path, straight_run, caplog):
    straight = straight_run()
    with pytest.raises(SystemExit, match="stopped after step 10"), killed_after(steps=10):
        run_train(tmp_path, *MID_EPOCH, "--save-every-steps", "4", name="killed")
    run = tmp_path / "killed"
    state = run / "checkpoints" / "step-8" / "training_state.pt"
    state.write_bytes(state.read_bytes()[:1000])
    run_train(tmp_path, *MID_EPOCH, "--resume", name="killed")
    assert "step-8/training_state.pt: unreadable" in caplog.text and "resuming from epoch 1 instead" in caplog.text
    assert [r["step"] for r in records(run)] == [r["step"] for r in records(straight)]
    for key, value in adapter(straight, 2).items():
        assert torch.equal(value, adapter(run, 2)[key]), key


def test_two_process_ddp_equals_one_process(tmp_path):
    """torchrun --nproc_per_node 2 (gloo) with the same global batch gives the one-process adapter.
    17 examples at 8 a step: the last step has one example, so rank 1 runs a placeholder (micro_batches)."""
    tiny_checkpoint()
    odd = ["--max-train-examples", "17"]
    flags = ["--method", "acs", "--lora-dropout", "0", "--data-dir", str(tmp_path / "splits"), *SMOKE, *odd]
    run_train(tmp_path, "--method", "acs", "--lora-dropout", "0", *odd, name="one")
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
    assert diffs.max() <= 2 * 2e-3 * len(steps(tmp_path / "one", "loss"))
    assert (diffs > 1e-5).float().mean() <= 0.01


def test_two_process_ddp_gives_the_aux_term_of_one_batch(tmp_path):
    """The load-balancing term under torchrun --nproc_per_node 2 (gloo) equals the one-process batch's,
    not twice it. The Switch loss is a product of means over a batch's tokens, so ranks agree with one
    batch exactly only where each holds the batch's mix: here 8 copies of one example (any shuffle)."""
    tiny_checkpoint()
    from dataclasses import replace
    data = manifests(tmp_path, train=lambda pool: [replace(pool[0], id=f"copy-{i}") for i in range(8)],
                     val=lambda pool: pool[20:22], test=lambda pool: pool[22:24])
    flags = ["--method", "ce", "--aux-coef", "0.5", "--lora-dropout", "0", "--data", str(data), "--data-dir",
             str(tmp_path / "splits"), *SMOKE]
    train.main(["--out-dir", str(tmp_path), "--run-name", "one", *flags])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29518",
                    str(REPO / "train.py"), "--out-dir", str(tmp_path), "--run-name", "two", *flags],
                   check=True, cwd=REPO, env=env, capture_output=True, timeout=600)
    one, two = ([r for r in records(tmp_path / name) if r["kind"] == "step"] for name in ("one", "two"))
    assert len(one) == len(two) == 1 and one[0]["aux"] > 0
    for key in ("aux", "loss", "grad_norm"):
        assert two[0][key] == pytest.approx(one[0][key], rel=1e-5), key


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


# ---- reliability: refused before anything is written, resume that survives kills, one writer --------

def train_cli(*flags, timeout=300):
    """train.py as a user runs it: exit status and stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(REPO / "train.py"), *flags], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("flag, value", [
    ("--lr", "-1"), ("--lr", "0"), ("--lr", "nan"), ("--lambda", "-1"), ("--batch-size", "-2"), ("--batch-size", "0"),
    ("--max-train-examples", "0"), ("--max-train-examples", "-5"), ("--epochs", "0"), ("--epochs", "-1"),
    ("--grad-accum", "0"), ("--max-length", "0"), ("--eval-batch-size", "0"), ("--warmup", "1.5"),
    ("--lora-dropout", "1"), ("--lora-rank", "0"), ("--clip", "-1"), ("--mix", "2"), ("--seed", "-1"),
    ("--tau", "0"), ("--is-eps", "0"), ("--weight-decay", "-0.1"), ("--error-head-lr", "inf"),
    ("--layers", "0,x"), ("--layers", "-1"), ("--layers", "last:0"), ("--save-every-steps", "0"),
    ("--save-every-steps", "1.5"),
])
def test_bad_number_is_refused_before_any_folder(tmp_path, capsys, flag, value):
    """argparse's own error (exit 2, naming the flag and what it expects); nothing is created."""
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--out-dir", str(tmp_path / "runs"), "--data-dir", str(tmp_path / "splits"), flag, value])
    assert exit_info.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("given", ["flag", "file"])
def test_an_objective_outside_the_registered_ones_is_refused_before_any_folder(tmp_path, given):
    """--objective mse (or a --config file's): an error naming the registered objectives, once --method-module
    (which may register more) is imported, not a failure at the first supervised step inside a run folder
    already written."""
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({"method": "tes", "objective": "mse"}))
    flags = ["--method", "tes", "--objective", "mse"] if given == "flag" else ["--config", str(path)]
    with pytest.raises(ValueError, match=r"unknown objective 'mse'; expected one of the registered \['is', 'enll'"):
        train.main(["--out-dir", str(tmp_path / "runs"), "--data-dir", str(tmp_path / "splits"), *SMOKE, *flags])
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("settings, message", [
    ({"lambda_": -1}, r"lambda_: -1: expected a number >= 0"),
    ({"objective": "a b"}, r"objective: 'a b': expected an objective's name"),
    ({"lr": 0}, r"lr: 0: expected a number > 0"), ({"gamma": -2}, r"method_options: gamma: -2: expected a number >= 0"),
    ({"method_options": {"transform": "cube"}}, r"method_options: transform: 'cube'; expected one of"),
])
def test_a_settings_file_value_gets_the_flags_check_before_any_folder(tmp_path, settings, message):
    """A --config file's values are read by the same checks as the flags (config.check_value), and a bad
    one is refused, naming the file and the setting, before the run folder exists."""
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({"method": "tes", **settings}))
    with pytest.raises(ValueError, match=rf"settings.json: {message}"):
        train.main(["--config", str(path), "--out-dir", str(tmp_path / "runs"), "--data-dir", str(tmp_path / "splits"),
                    *SMOKE])
    assert not (tmp_path / "runs").exists()


def test_single_layer_index_is_a_scope(tmp_path):
    run = run_train(tmp_path, "--method", "tes", "--layers", "3")
    assert json.loads((run / "config.json").read_text())["method"]["layers"] == [3]
    assert json.loads((run / "checkpoints" / "epoch-1" / "adapter_config.json").read_text())["router"]["layers"] == [3]


def manifests(tmp_path, **splits) -> Path:
    """A manifest folder from slices of the registered ARC-Challenge train split."""
    from dataclasses import asdict
    from minimoe.data.benchmarks import load_split
    pool = load_split("arc_challenge", "train", data_dir=tmp_path / "splits")
    folder = tmp_path / "manifests"
    folder.mkdir()
    for split, rows in splits.items():
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(asdict(ex)) + "\n" for ex in rows(pool)))
    return folder


@pytest.mark.parametrize("test_rows, message", [
    (lambda pool: pool[:20], "train and test share id"),  # test.jsonl == train.jsonl
    (lambda pool: [ex.__class__(**{**ex.__dict__, "id": ex.id + "-copy"}) for ex in pool[5:8]],
     "train and test share question and choices"),
])
def test_overlapping_splits_are_refused_before_any_run_folder(tmp_path, test_rows, message):
    data = manifests(tmp_path, train=lambda pool: pool[:20], val=lambda pool: pool[20:24], test=test_rows)
    with pytest.raises(ValueError, match=message):
        run_train(tmp_path, "--data", str(data))
    assert not (tmp_path / "run").exists()


def killed_after_epoch_1(tmp_path, name="killed"):
    with pytest.raises(SystemExit, match="stopped after epoch 1"), killed_after(epochs=1):
        run_train(tmp_path, "--method", "tes", "--epochs", "2", name=name)
    return tmp_path / name


TIMINGS = ("tokens_per_s", "seconds", "val_seconds")  # wall-clock fields: never equal between two runs


def records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_resume_does_not_score_the_base_model_again(tmp_path, monkeypatch):
    """--zero-shot scores the base model before training; a run killed after that, resumed, keeps
    eval/test-base as it is and does not run it again (it is the same number, at the cost of a test pass)."""
    from minimoe.runs import eval_run
    data = manifests(tmp_path, train=lambda pool: pool[:16], val=lambda pool: pool[16:20], test=lambda pool: pool[20:26])
    flags = ["--data", str(data), "--method", "ce", "--epochs", "2", "--zero-shot"]
    with pytest.raises(SystemExit, match="stopped after epoch 1"), killed_after(epochs=1):
        run_train(tmp_path, *flags, name="killed")
    base = tmp_path / "killed" / "eval" / "test-base" / "metrics.json"
    written = base.stat().st_mtime_ns
    config = json.loads((tmp_path / "killed" / "config.json").read_text())  # the zero-shot row names its process
    assert json.loads(base.read_text())["provenance"] == config["provenance"] is not None

    def again(*args, **kwargs):
        raise AssertionError("the base model was scored again on resume")
    monkeypatch.setattr(eval_run, "evaluate_zero_shot", again)
    run_train(tmp_path, *flags, "--resume", name="killed")
    assert base.stat().st_mtime_ns == written
    assert json.loads((tmp_path / "killed" / "selection.json").read_text())["last_epoch"] == 2


def test_resume_after_a_kill_between_the_test_evaluations_runs_only_the_missing_one(tmp_path, monkeypatch):
    """--test-checkpoint both, killed while scoring the selected epoch: the resumed run scores that one
    and leaves the last epoch's finished evaluation as it is."""
    from minimoe.runs import eval_run
    data = manifests(tmp_path, train=lambda pool: pool[:8], val=lambda pool: pool[16:20], test=lambda pool: pool[20:26])
    flags = ["--out-dir", str(tmp_path), "--run-name", "run", "--model", "tiny", "--data", str(data), "--method", "ce",
             "--batch-size", "8", "--epochs", "1", "--quiet", "--test-checkpoint", "both"]
    calls, real = [], eval_run.evaluate_run

    def evaluate_run(run, split="test", *, checkpoint=None, **kw):
        calls.append(checkpoint)
        if checkpoint == "selected" and len(calls) == 2:
            raise SystemExit("killed while scoring the selected epoch")
        return real(run, split, checkpoint=checkpoint, **kw)
    monkeypatch.setattr(eval_run, "evaluate_run", evaluate_run)
    with pytest.raises(SystemExit, match="killed while scoring"):
        train.main(flags)
    eval_dir = tmp_path / "run" / "eval"
    assert calls == [None, "selected"] and {p.name for p in eval_dir.iterdir()} == {"test"}
    written = (eval_dir / "test" / "metrics.json").stat().st_mtime_ns
    train.main([*flags, "--resume"])
    assert calls == [None, "selected", "selected"]
    assert (eval_dir / "test" / "metrics.json").stat().st_mtime_ns == written
    assert (eval_dir / "test-selected" / "metrics.json").is_file()


def test_pickled_payload_in_training_state_is_not_run(tmp_path):
    """training_state.pt loads with weights_only=True: a file whose unpickling would make a folder is refused."""
    run = killed_after_epoch_1(tmp_path)
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return os.mkdir, (str(marker),)
    torch.save({"optimizer": Payload(), "epoch": 1, "step": 2}, run / "checkpoints" / "epoch-1" / "training_state.pt")
    with pytest.raises(ValueError, match="training_state.pt: holds objects that only a full unpickle"):
        run_train(tmp_path, "--method", "tes", "--epochs", "2", "--resume", name="killed")
    assert not marker.exists()


def test_torn_log_line_and_orphans_are_dropped_on_resume(tmp_path):
    """A full disk or a kill mid-write: a torn last line of metrics.jsonl and .tmp-* leftovers; resume
    ends with the straight run's log and adapter."""
    straight = run_train(tmp_path, "--method", "tes", "--epochs", "2", name="straight")
    run = killed_after_epoch_1(tmp_path)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"kind": "step", "epoch": 2, "st')
    orphans = [run / "checkpoints" / ".epoch-2.tmp-abc123",
               run / "checkpoints" / "epoch-1" / ".training_state.pt.tmp-99"]
    orphans[0].mkdir()
    orphans[1].write_bytes(b"half")
    run_train(tmp_path, "--method", "tes", "--epochs", "2", "--resume", name="killed")
    assert not any(p.exists() for p in orphans)
    assert [{k: v for k, v in r.items() if k not in TIMINGS} for r in records(run)] == [
        {k: v for k, v in r.items() if k not in TIMINGS} for r in records(straight)]
    for key, value in adapter(straight, 2).items():
        assert torch.equal(value, adapter(run, 2)[key]), key


def test_kill_before_the_first_checkpoint_leaves_no_duplicate_records(tmp_path):
    run = killed_after_epoch_1(tmp_path)
    import shutil
    shutil.rmtree(run / "checkpoints")  # as if killed while epoch 1 was saving: its step records were logged
    run_train(tmp_path, "--method", "tes", "--epochs", "2", "--resume", name="killed")
    expected = [("step", 1), ("step", 1), ("epoch", 1), ("step", 2), ("step", 2), ("epoch", 2)]
    assert [(r["kind"], r["epoch"]) for r in records(run)] == expected


def test_corrupt_last_checkpoint_falls_back_to_the_epoch_before(tmp_path, caplog):
    """Epoch 2 saved, then its training_state.pt truncated: resume says so, redoes epoch 2 from epoch 1,
    and ends where the straight run does."""
    straight = run_train(tmp_path, "--method", "tes", "--epochs", "2", name="straight")
    run = run_train(tmp_path, "--method", "tes", "--epochs", "2", name="broken")
    state = run / "checkpoints" / "epoch-2" / "training_state.pt"
    state.write_bytes(state.read_bytes()[:1000])
    (run / "selection.json").unlink()
    run_train(tmp_path, "--method", "tes", "--epochs", "2", "--resume", name="broken")
    assert "training_state.pt: unreadable" in caplog.text and "resuming from epoch 1 instead" in caplog.text
    for key, value in adapter(straight, 2).items():
        assert torch.equal(value, adapter(run, 2)[key]), key


def test_corrupt_files_give_a_one_line_error_naming_them(tmp_path):
    """train.py as a command: no traceback, exit 1, the file named."""
    run = killed_after_epoch_1(tmp_path)
    (run / "config.json").write_text('{"model": "tiny-ol')
    out = train_cli("--out-dir", str(tmp_path), "--run-name", "killed", "--data-dir", str(tmp_path / "splits"),
                    *SMOKE, "--method", "tes", "--epochs", "2", "--resume")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(f"train.py: error: {run / 'config.json'}: not valid JSON")


def test_second_process_on_a_locked_run_folder_fails_fast(tmp_path):
    run = killed_after_epoch_1(tmp_path)
    before = (run / "metrics.jsonl").read_bytes()
    # The holder: any process with an exclusive flock on RUN/train.lock and its pid written there.
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\nf = open(sys.argv[1], 'w')\n"
                               "fcntl.flock(f, fcntl.LOCK_EX)\nf.write(f'{os.getpid()}\\n')\nf.flush()\n"
                               "print('locked', flush=True)\ntime.sleep(120)", str(run / "train.lock")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(OSError, match=f"in use by process {holder.pid}"):
            run_train(tmp_path, "--method", "tes", "--epochs", "2", "--resume", name="killed")
    finally:
        holder.kill()
        holder.wait()
    assert (run / "metrics.jsonl").read_bytes() == before
    run_train(tmp_path, "--method", "tes", "--epochs", "2", "--resume", name="killed")  # the lock died with it


def test_resume_accepts_what_does_not_change_the_result(tmp_path):
    """A moved run folder, an explicit --run-name equal to the default, --eval-batch-size, test evaluation on."""
    flags = ["--model", "tiny", "--data-dir", str(tmp_path / "splits"), "--max-train-examples", "16",
             "--batch-size", "8", "--quiet", "--method", "tes", "--epochs", "2"]
    with pytest.raises(SystemExit, match="stopped after epoch 1"), killed_after(epochs=1):
        train.main(["--out-dir", str(tmp_path / "a"), *flags, "--no-test-eval"])
    [run] = (tmp_path / "a").iterdir()
    (tmp_path / "b").mkdir()
    moved = run.rename(tmp_path / "b" / run.name)
    train.main(["--out-dir", str(tmp_path / "b"), "--run-name", run.name, *flags, "--eval-batch-size", "4", "--resume"])
    assert json.loads((moved / "selection.json").read_text())["last_epoch"] == 2
    assert (moved / "eval" / "test" / "metrics.json").is_file()


def test_training_state_round_trips_with_weights_only_and_a_full_disk_names_the_file(tmp_path, monkeypatch):
    """The RNG states (torch, python, numpy) come back exactly through torch.load(weights_only=True);
    torch.save's full-disk RuntimeError becomes an OSError naming training_state.pt, leaving nothing."""
    import random

    import numpy as np

    from minimoe.runs import run_folder as runs
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    path = tmp_path / "training_state.pt"
    runs.save_state(path, optimizer, scheduler, epoch=1, step=2)
    draws = (torch.rand(2).tolist(), random.random(), np.random.rand())
    state = torch.load(path, weights_only=True)
    runs.set_rng_state(state["rng"])
    assert (torch.rand(2).tolist(), random.random(), np.random.rand()) == draws and state["step"] == 2

    def full(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file")
    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OSError, match=f"{tmp_path / 'again.pt'}: could not write it.*inline_container"):
        runs.save_state(tmp_path / "again.pt", optimizer, scheduler, epoch=1, step=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["training_state.pt"]


def small_manifests(tmp_path, n=(16, 4, 6)):
    """The first n examples of each registered arc_challenge split, as a manifest folder (fast test eval)."""
    run_train(tmp_path, "--method", "ce", name="build")  # builds the registered manifests under splits/
    folder = tmp_path / "small"
    folder.mkdir()
    for split, count in zip(("train", "val", "test"), n):
        lines = (tmp_path / "splits" / "arc_challenge" / f"{split}.jsonl").read_text().splitlines()[:count]
        (folder / f"{split}.jsonl").write_text("".join(line + "\n" for line in lines))
    return folder


@pytest.mark.parametrize("flags,expected", [
    (["--recipe", "olmoe", "--tune-router"], "selected"),  # the paper's OLMoE affinity-tuned group
    (["--recipe", "olmoe"], "last"),
    (["--recipe", "granite", "--tune-router"], "last"),
    (["--recipe", "olmoe", "--tune-router", "--test-checkpoint", "both"], "both"),
])
def test_test_checkpoint_defaults_to_what_the_paper_reports(flags, expected):
    from tests.conftest import tiny_config
    cfg = train.resolve_config(train.parse_args(flags), tiny_config("olmoe"))
    assert cfg.test_checkpoint == expected


@pytest.mark.parametrize("flags,folders", [(["--recipe", "olmoe", "--tune-router"], {"test-selected"}),
                                           (["--test-checkpoint", "both"], {"test", "test-selected"})])
def test_train_evaluates_the_selected_checkpoint(tmp_path, flags, folders):
    data = small_manifests(tmp_path)
    train.main(["--out-dir", str(tmp_path), "--run-name", "run", "--model", "tiny", "--data", str(data), "--method", "ce",
                "--batch-size", "8", "--epochs", "1", "--quiet", *flags])
    run = tmp_path / "run"
    assert {p.name for p in (run / "eval").iterdir()} == folders
    selected = json.loads((run / "eval" / "test-selected" / "metrics.json").read_text())
    assert selected["checkpoint"] == "selected"
    assert selected["epoch"] == json.loads((run / "selection.json").read_text())["selected_epoch"]


def option_help(parser) -> dict:
    """--help's text per option, keyed by its first flag, whitespace collapsed."""
    entries, current = {}, None
    for line in parser.format_help().splitlines():
        if line.startswith("  -"):
            current = line.split()[0].rstrip(",")
            entries[current] = line
        elif current and line.startswith("    "):
            entries[current] += " " + line
        else:
            current = None
    return {flag: " ".join(text.split()) for flag, text in entries.items()}


def test_flags_are_train_config_fields_and_help_shows_their_true_defaults():
    """One configuration: every flag is a setting and back (a TrainConfig field, or for its one configured
    method a MethodSettings field; but what resolve_config derives); a flag's default is its field's, and
    --help shows it; a recipe field's flag defaults to None and --help names every recipe's value
    (RECIPES, read here on its own)."""
    from dataclasses import MISSING, fields

    from minimoe.runs.config import MethodSettings, TrainConfig
    from minimoe.runs.recipes import RECIPES
    parser = train.parser()
    defaults, helps = vars(parser.parse_args([])), option_help(parser)
    config = {f.name: f.default for f in (*fields(TrainConfig), *fields(MethodSettings))}
    assert set(defaults) - set(train.NOT_SETTINGS) == set(config) - {"pad_token_id", "train_examples"}
    for name, value in defaults.items():
        if name not in config:
            continue
        text = helps.get("--lambda" if name == "lambda_" else "--" + name.replace("_", "-"), "")  # "": hidden
        if config[name] is not MISSING:
            assert value == config[name], name
            if value is not None and not isinstance(value, bool):
                assert f"default: {value})" in text, (name, text)
        else:
            assert value is None, name
            shown = {r: ",".join(recipe[name]) if isinstance(recipe[name], list) else str(recipe[name])
                     for r, recipe in RECIPES.items()}
            expected = ([f"default: {shown['tiny']}"] if len(set(shown.values())) == 1
                        else [f"{v} {r}" for r, v in shown.items()])
            assert all(e in text for e in expected), (name, text)


def test_lora_targets_help_lists_the_lora_names_not_the_method_aliases():
    """--lora-targets' help names every target and alias lora.py takes (experts among them), and no method
    alias (ce): the two ALIASES tables, lora's and methods', are different things."""
    from minimoe.core.adaptation import lora
    from minimoe.core.routing_methods import methods
    text = option_help(train.parser())["--lora-targets"]
    assert "comma list of " + ", ".join([*lora.TARGETS, *lora.ALIASES]) + " (" in text
    assert not any(f" {alias}," in text or f", {alias} " in text for alias in methods.ALIASES)


def test_resume_compares_settings_not_how_config_json_spells_them(tmp_path):
    """--resume refuses a changed setting, naming it; a config.json without the keys of flags not given
    (as written before TrainConfig, where they are now null) resumes."""
    run = killed_after_epoch_1(tmp_path)
    with pytest.raises(SystemExit, match=r"\['lr'\] differ"):
        run_train(tmp_path, "--method", "tes", "--epochs", "2", "--lr", "1e-3", "--resume", name="killed")
    config = json.loads((run / "config.json").read_text())
    assert config["data_revision"] is None and config["lr"] == 2e-3 and config["label"] == "TES-IS"
    (run / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    run_train(tmp_path, "--method", "tes", "--epochs", "2", "--resume", name="killed")
    assert json.loads((run / "selection.json").read_text())["last_epoch"] == 2


# ---- relaunch and resume from what a run wrote --------------------------------------------------------

def test_resume_with_nothing_but_the_run_folder_ends_where_the_uninterrupted_run_does(tmp_path):
    """`--resume RUN` alone reads every setting from RUN/config.json; the result is bit-identical."""
    straight = run_train(tmp_path, "--method", "tes", "--epochs", "2", "--lora-rank", "4", name="straight")
    with pytest.raises(SystemExit, match="stopped after epoch 1"), killed_after(epochs=1):
        run_train(tmp_path, "--method", "tes", "--epochs", "2", "--lora-rank", "4", name="killed")
    run = tmp_path / "killed"
    train.main(["--resume", str(run)])
    for key, value in adapter(straight, 2).items():
        assert torch.equal(value, adapter(run, 2)[key]), key
    assert json.loads((run / "config.json").read_text())["lora_rank"] == 4


def test_a_config_json_that_records_the_retired_kill_switch_still_resumes_and_relaunches(tmp_path):
    """Before tests/kill.py, hidden --stop-after-epochs/--stop-after-steps flags killed runs, and
    config.json recorded them (a killed run: its value). Such a file resumes (--resume compares it with
    the settings) and, as a --config settings file, relaunches: read_run_config drops the two keys."""
    from dataclasses import fields

    from minimoe.runs.config import TrainConfig
    run = killed_after_epoch_1(tmp_path)
    old = {**json.loads((run / "config.json").read_text()), "stop_after_epochs": 1, "stop_after_steps": None}
    (run / "config.json").write_text(json.dumps(old, indent=2))
    settings = {f.name: old[f.name] for f in fields(TrainConfig)} | {"stop_after_epochs": 1}  # no run record
    (tmp_path / "settings.json").write_text(json.dumps(settings))
    run_train(tmp_path, "--method", "tes", "--epochs", "2", "--resume", name="killed")
    assert json.loads((run / "selection.json").read_text())["last_epoch"] == 2
    train.main(["--config", str(tmp_path / "settings.json"), "--out-dir", str(tmp_path / "again"), "--epochs", "1"])
    assert json.loads((tmp_path / "again" / "killed" / "selection.json").read_text())["last_epoch"] == 1


def test_relaunch_from_config_json_repeats_the_run_and_flags_beside_it_override(tmp_path):
    first = run_train(tmp_path, "--method", "acs", "--lambda", "0.01", "--layers", "0,1", "--per-candidate-rows",
                      name="first")
    train.main(["--config", str(first / "config.json"), "--out-dir", str(tmp_path / "again")])
    again = tmp_path / "again" / "first"  # the recorded --run-name, under another parent
    for key, value in adapter(first, 1).items():
        assert torch.equal(value, adapter(again, 1)[key]), key
    settings = lambda run: {k: v for k, v in json.loads((run / "config.json").read_text()).items() if k != "out_dir"}
    assert settings(again) == settings(first)
    train.main(["--config", str(first / "config.json"), "--run-name", "changed", "--lr", "1e-3", "--no-test-eval"])
    changed = settings(tmp_path / "changed")
    assert changed["lr"] == 1e-3 and {k: v for k, v in changed.items() if k not in ("lr", "run_name")} == {
        k: v for k, v in settings(first).items() if k not in ("lr", "run_name")}


@pytest.mark.plain
def test_yaml_settings_file_starts_a_run_and_unknown_keys_are_named(tmp_path):
    (tmp_path / "mine.yaml").write_text("model: tiny\nmethod: ce\nlora_targets: [q, v]\nmax_train_examples: 8\n"
                                        "batch_size: 8\nepochs: 1\nno_test_eval: true\nquiet: true\n")
    train.main(["--config", str(tmp_path / "mine.yaml"), "--out-dir", str(tmp_path), "--run-name", "y",
                "--data-dir", str(tmp_path / "splits")])
    cfg = json.loads((tmp_path / "y" / "config.json").read_text())
    assert (cfg["method"]["name"], cfg["lora_targets"], cfg["max_train_examples"]) == ("native", ["q", "v"], 8)  # ce = native
    (tmp_path / "bad.json").write_text(json.dumps({"model": "tiny", "learning_rate": 1e-3}))
    with pytest.raises(ValueError, match="'learning_rate' is not a setting"):
        train.main(["--config", str(tmp_path / "bad.json"), "--out-dir", str(tmp_path), "--run-name", "bad"])
    with pytest.raises(FileNotFoundError, match="no config.json"):
        train.main(["--resume", str(tmp_path / "nothing-here")])
    assert not (tmp_path / "bad").exists()


def test_an_existing_run_folder_is_an_error_and_a_no_op_resume_leaves_config_json_alone(tmp_path):
    """The refusal has the error: prefix the other errors have; --resume of a finished run trains nothing
    and keeps its config.json byte for byte (its provenance is that of the launch that trained it)."""
    run = run_train(tmp_path)
    with pytest.raises(SystemExit, match=r"^train.py: error: run folder .* exists; pass --resume"):
        run_train(tmp_path)
    before = (run / "config.json").read_bytes()
    run_train(tmp_path, "--resume")
    assert (run / "config.json").read_bytes() == before


def test_the_train_size_message_comes_only_when_a_request_cannot_be_met(tmp_path, capsys, caplog):
    """ARC-Challenge's offline train split has 921 examples, under the 2000 its splits are built to hold:
    said once a run asks for more than 921, never when it asks for 64 (nor when the split is built)."""
    from dataclasses import replace
    from minimoe.runs.config import TrainConfig
    from minimoe.runs.recipes import RECIPES
    cfg = TrainConfig(**RECIPES["tiny"], recipe="tiny", data="arc_challenge", data_dir=str(tmp_path))
    data, _ = train.load_data(replace(cfg, max_train_examples=64))
    assert len(data["train"]) == 64 and "requested" not in caplog.text and "warning" not in capsys.readouterr().err
    data, _ = train.load_data(replace(cfg, max_train_examples=5000))
    assert f"train has {len(data['train'])} examples, fewer than the 5000 asked for" in capsys.readouterr().err


@pytest.mark.parametrize("model_type", ["deepseek_v3", "gpt_oss"])
def test_tiny_model_type_trains_and_evaluates_from_the_command_line(tmp_path, model_type, capsys, monkeypatch):
    """--model tiny:<model_type>: the family's tiny checkpoint (MLA, shared experts and the correction bias;
    sinks, YaRN and clamped experts), the smoke recipe, the run named after it; evaluate.py and sweep.py take
    the same name, and an unknown family is one line naming those there are, before any folder is made."""
    from minimoe.cli import evaluate, sweep
    flags = ["--model", f"tiny:{model_type}", *SMOKE[2:], "--max-train-examples", "8"]
    train.main(["--out-dir", str(tmp_path), "--data-dir", str(tmp_path / "splits"), *flags])
    run, = tmp_path.glob(f"tiny-{model_type}-*")
    config = json.loads((run / "config.json").read_text())
    assert config["recipe"] == "tiny" and config["model"] == str(tiny_checkpoint(model_type))
    metrics = evaluate.main(["--model", f"tiny:{model_type}", "--data", "arc_challenge", "--split", "val",
                             "--max-examples", "4", "--eval-dir", str(tmp_path / "eval")])
    assert 0 <= metrics["accuracy"] <= 1
    assert sweep.model_specs([f"tiny:{model_type}"]) == ([str(tiny_checkpoint(model_type))],
                                                         {str(tiny_checkpoint(model_type)): "tiny"})
    capsys.readouterr()
    for command, flag in ((train, "--out-dir"), (evaluate, "--eval-dir")):
        monkeypatch.setattr(sys, "argv", ["x", "--model", "tiny:xyz", "--data", "arc_challenge", flag, str(tmp_path / "no")])
        with pytest.raises(SystemExit):
            command.command()
        assert "--model tiny:xyz: no family 'xyz'; expected tiny or tiny:<model_type>, one of tiny:granitemoe" \
            in capsys.readouterr().err
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("model,flags,message", [
    ("tiny:deepseek_v2", ["--aux-coef", "family"], "deepseek_v2's config.json has no router_aux_loss_coef"),
    ("tiny:llama4_text", ["--aux-coef", "family"], "never applies llama4_text's router_aux_loss_coef"),
    ("tiny:qwen3_moe", ["--quantize", "mxfp4"], "this model is qwen3_moe; use --quantize nf4"),
    ("tiny:qwen3_moe", ["--quantize", "nf4"], "needs torchao, which is not installed"),
    ("tiny:mixtral", ["--layers", "first:8"], "first:8"),
])
def test_a_refusal_builds_no_tiny_model(tmp_path, monkeypatch, model, flags, message):
    """Refusals of a setting come before the tiny checkpoint is built (train.preflight, against the config
    it will have): nothing is written, weights/tiny-<model_type> included."""
    monkeypatch.setenv("MINIMOE_WEIGHTS", str(tmp_path / "weights"))
    monkeypatch.setitem(sys.modules, "torchao", None)  # the quant extra missing (asked by the nf4 case only)
    with pytest.raises((SystemExit, ValueError), match=message):
        train.main(["--model", model, "--out-dir", str(tmp_path / "runs"), "--run-name", "r", *flags])
    assert not (tmp_path / "weights").exists() and not (tmp_path / "runs").exists()
