"""--shard fsdp (minimoe/runs/sharding.py) on the CPU with gloo: two FSDP2 processes equal one process
at the same global batch, for CE, TES and ACS on tiny Granite and OLMoE; resume after a kill; loading
reads each rank's rows only; refusals before any run folder exists.

Every sharded run of the module is one torchrun launch (tests/fsdp_worker.py): gloo's start is the slow part.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from minimoe.cli import train
from minimoe.core.lora import add_lora, merge_lora
from minimoe.loading.checkpoint import checkpoint_layout, from_pretrained, save_pretrained
from minimoe.loading.tiny import tiny_checkpoint
from minimoe.core.model import MoEForCausalLM
from minimoe.runs import memory
from minimoe.runs.adapters import load_adapter
from minimoe.runs.config import build_config
from minimoe.runs.sharding import ShardingRefused, check_sharding, shard
from tests.conftest import tiny_model

REPO = Path(__file__).resolve().parents[2]
LR = 2e-3  # the tiny recipe's
STEPS = ["--max-train-examples", "16", "--batch-size", "8", "--epochs", "1", "--lora-dropout", "0", "--recipe", "tiny",
         "--no-test-eval", "--quiet"]  # 2 optimizer steps of 8 examples: 4 a rank under FSDP
METHODS = {"ce": ["--method", "ce"], "tes": ["--method", "tes", "--objective", "is"],
           "acs": ["--method", "acs", "--objective", "enll", "--tune-router"]}


def granite_checkpoint(folder: Path) -> Path:
    """Tiny Granite (tied head, every multiplier, GQA) with the tiny OLMoE's tokenizer and special ids."""
    olmoe = tiny_checkpoint()
    ids = json.loads((olmoe / "config.json").read_text())
    save_pretrained(tiny_model("granitemoe", vocab_size=ids["vocab_size"], pad_token_id=ids["pad_token_id"],
                               eos_token_id=ids["eos_token_id"]), folder)
    (folder / "tokenizer.json").write_bytes((olmoe / "tokenizer.json").read_bytes())
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process and two FSDP processes, the same flags, for each family and method; a sharded run
    killed after step 1 and resumed; each rank's load of both checkpoints."""
    root = tmp_path_factory.mktemp("fsdp")
    models = {"olmoe": tiny_checkpoint(), "granitemoe": granite_checkpoint(root / "granite")}
    # float32 on the CPU by name: a module fixture runs before conftest's per-test settings of them
    common = ["--data-dir", str(root / "splits"), "--dtype", "float32", "--device", "cpu", *STEPS]
    flags = {(f, m): ["--model", str(models[f]), *METHODS[m], *common] for f in models for m in METHODS}
    flags["olmoe", "tes"] += ["--save-every-steps", "1"]  # the uninterrupted twin of the killed run
    for (f, m), fl in flags.items():
        train.main(["--out-dir", str(root / "one"), "--run-name", f"{f}-{m}", *fl])
    plan = {"runs": [{"flags": ["--out-dir", str(root / "two"), "--run-name", f"{f}-{m}", "--shard", "fsdp", *fl]}
                     for (f, m), fl in flags.items()]}
    killed = ["--out-dir", str(root / "two"), "--run-name", "killed", "--shard", "fsdp", *flags["olmoe", "tes"]]
    plan["runs"] += [{"flags": killed, "kill_after_steps": 1}, {"flags": [*killed, "--resume"]}]
    plan["loads"] = [{"model": str(models[f]), "out": str(root / f"load-{f}")} for f in models]
    (root / "plan.json").write_text(json.dumps(plan))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           "29523", "-m", "tests.fsdp_worker", str(root / "plan.json")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return {"root": root, "models": models, "killed_log": done.stderr}


def steps(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "step"]


def adapter(run: Path) -> dict:
    return load_file(run / "checkpoints" / "epoch-1" / "adapter.safetensors")


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("family", ["granitemoe", "olmoe"])
def test_two_fsdp_processes_equal_one_process(runs, family, method):
    """The adapter after 2 steps, the step's loss terms and the routing statistics of the whole batch.

    Why they differ at all: reduction order. Each rank's gradient is a sum over its 4 examples, and FSDP's
    reduce-scatter adds the two halves; one process adds the 8 examples' terms in another order. The
    step terms and gradient norm agree to float32 rounding (rtol 1e-5; measured 2e-7). AdamW's first
    update is ~lr * sign(g), so an element whose gradient is at rounding level may step the other way:
    every element is within 2 * lr * steps, and all but 0.1% agree to 1e-6 (measured: all, to 1e-7)."""
    one, two = runs["root"] / "one" / f"{family}-{method}", runs["root"] / "two" / f"{family}-{method}"
    record = json.loads((two / "config.json").read_text())
    assert record["shard"] == "fsdp" and record["world_size"] == 2  # the run folder says which mode ran
    a, b = steps(one), steps(two)
    assert len(a) == len(b) == 2
    for key in ("loss", "task", "method", "grad_norm"):  # the method term: summed over ranks, as one batch's
        torch.testing.assert_close(torch.tensor([r[key] for r in b]), torch.tensor([r[key] for r in a]),
                                   rtol=1e-5, atol=1e-7, msg=key)
    if method != "ce":
        assert all(r["method"] > 0 for r in b)
    for ra, rb in zip(a, b):  # routing statistics: every rank's micro-batches, not rank 0's half
        assert ra["routing"].keys() == rb["routing"].keys()
        for layer, stats in ra["routing"].items():
            for name, value in stats.items():
                torch.testing.assert_close(torch.tensor(rb["routing"][layer][name]), torch.tensor(value),
                                           rtol=1e-5, atol=2e-6, msg=f"{layer} {name}")
    x, y = adapter(one), adapter(two)
    assert x.keys() == y.keys()
    diffs = torch.cat([(y[k] - x[k]).abs().flatten() for k in x])
    assert diffs.max() <= 2 * LR * len(a)
    assert (diffs > 1e-6).float().mean() <= 0.001  # measured: every element within 1e-7


def test_a_sharded_adapter_loads_as_a_one_process_adapter(runs):
    """The gathered files are today's: load_adapter (evaluate.py, export.py) takes them on the unsharded
    base, its base-weights digest (computed from the gathered shards) included."""
    for family, model in runs["models"].items():
        for method in METHODS:
            base = from_pretrained(model)
            load_adapter(base, runs["root"] / "two" / f"{family}-{method}" / "checkpoints" / "epoch-1")
            saved = adapter(runs["root"] / "two" / f"{family}-{method}")
            state = base.state_dict()
            assert all(torch.equal(state[k], v) for k, v in saved.items())


def test_a_sharded_run_exports_as_a_one_process_run(runs, tmp_path):
    """export.py on the sharded run folder: a peft adapter (CE), and merged into its base (ACS + affinity
    tuning); the merged weights equal the one-process run's merge within the adapters' difference."""
    from minimoe.cli import export
    two = runs["root"] / "two"
    export.main([str(two / "olmoe-ce"), str(tmp_path / "peft")])
    assert (tmp_path / "peft" / "adapter_model.safetensors").is_file()
    for name in ("one", "two"):
        export.main([str(runs["root"] / name / "granitemoe-acs"), str(tmp_path / f"merged-{name}"), "--merged"])
    one, sharded = (load_file(tmp_path / f"merged-{name}" / "model.safetensors") for name in ("one", "two"))
    assert one.keys() == sharded.keys()
    for key in one:
        torch.testing.assert_close(sharded[key], one[key], rtol=0, atol=1e-6, msg=key)


def test_a_killed_sharded_run_resumes_to_the_uninterrupted_result(runs):
    """Killed after step 1 (its step checkpoint written: adapter + gathered AdamW state), resumed with
    --resume: the same step records and the same adapter, bit for bit, as the run never killed."""
    killed, straight = runs["root"] / "two" / "killed", runs["root"] / "two" / "olmoe-tes"
    assert "stopped after step 1" in runs["killed_log"]
    assert [(r["step"], r["loss"]) for r in steps(killed)] == [(r["step"], r["loss"]) for r in steps(straight)]
    x, y = adapter(straight), adapter(killed)
    assert all(torch.equal(x[k], y[k]) for k in x)
    state = torch.load(killed / "checkpoints" / "epoch-1" / "training_state.pt", weights_only=True)
    assert all(isinstance(k, str) for k in state["optimizer"]["state"])  # gathered, keyed by parameter name


@pytest.mark.parametrize("family", ["granitemoe", "olmoe"])
def test_each_rank_reads_only_its_rows(runs, family):
    """The sharded load gives the checkpoint's weights (gathered back whole: equal to from_pretrained's),
    and each rank reads its rows alone: the two ranks' reads add up to every tensor byte once, plus the
    native gates, which every rank reads whole (E x D a layer: install copies or trains them)."""
    model = runs["models"][family]
    reference = from_pretrained(model)
    out = runs["root"] / f"load-{family}"
    gathered = load_file(f"{out}.rank0.safetensors")
    for name in checkpoint_layout(reference.config):
        assert torch.equal(gathered[name], reference.get_parameter(name)), name
    read = []
    for rank in (0, 1):
        with safe_open(f"{out}.rank{rank}.safetensors", "pt") as f:
            read.append(int(f.metadata()["bytes_read"]))
    layout = checkpoint_layout(reference.config)
    gate_keys = {layout[name] for name in layout if name.endswith(".mlp.gate.weight")}  # their names on disk
    total = gates = 0
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        for key in f.keys():
            nbytes = f.get_tensor(key).nbytes
            total += nbytes
            gates += nbytes if key in gate_keys else 0
    assert gates > 0
    assert sum(read) == total + 2 * gates
    assert max(read) < 0.6 * total
    with torch.device("meta"):  # the memory estimate's weights per GPU are the rows rank 0 read (runs/memory.py)
        meta = MoEForCausalLM(reference.config)
    assert memory.shard_bytes(list(meta.parameters()), 2) + gates == read[0]


def test_fsdp_is_refused_before_any_run_folder(tmp_path, monkeypatch):
    """Outside torchrun, at world size 1, with --zero-shot (the base scored whole on rank 0): a named
    error, and no run folder."""
    flags = ["--out-dir", str(tmp_path), "--run-name", "run", "--data-dir", str(tmp_path / "splits"), "--model",
             "tiny", *STEPS, "--shard", "fsdp"]
    with pytest.raises(ShardingRefused, match="not launched by torchrun"):
        train.main(flags)
    monkeypatch.setenv("LOCAL_RANK", "0")  # as torchrun --nproc_per_node 1 sets it
    with pytest.raises(ShardingRefused, match="world size is 1"):
        train.main(flags)
    assert not (tmp_path / "run").exists()
    cfg, _ = build_config({"model": "tiny", "zero_shot": True, "shard": "fsdp"}, "tiny")
    with pytest.raises(ShardingRefused, match="--zero-shot"):
        check_sharding(cfg, 2)


def test_a_merged_lora_is_refused():
    model = add_lora(tiny_model("olmoe"))
    merge_lora(model)
    with pytest.raises(ShardingRefused, match="LoRA is merged"):
        shard(model, torch.device("cpu"))
