"""--quantize nf4 --shard fsdp on the CPU with gloo: two FSDP processes, each holding its bytes of the packed base
(core/adaptation/sharded_nf4.py), equal the one-process quantized run at the same global batch over 4 real updates
at the FSDP tests' tolerance (tests/runs/test_sharding.py), for OLMoE (TES-IS: packed expert banks and attention) and
DeepSeek-V3 (Dual Affinity, --gradient-checkpointing: MLA's projections, a dense layer and shared experts packed); a
sharded quantized run killed after step 2 resumes to the uninterrupted result; the gathered adapter loads onto the
one-process packed base (its base-weights digest, summed over the ranks' samples, is the one-process one). One
torchrun launch (about 25 s of CPU in all).
"""
import json

import pytest
import torch

from minimoe.loading.checkpoint import from_pretrained
from minimoe.runs.adapters import load_adapter
from tests.runs.test_sharding import (FLAGS, LR, STEPS, TRAINING_MARGIN, adapter, clear_of_ties, manifests, steps,
                                      torchrun)

pytest.importorskip("torchao")
# DeepSeek-V3 with --gradient-checkpointing: its layers' forwards run again inside the backward, on the gathered bytes
RUNS = {"olmoe": ["--method", "tes", "--objective", "is"],
        "deepseek_v3": ["--method", "dual", "--gradient-checkpointing"]}
KILLED = "olmoe"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process here, then one torchrun launch of 2 gloo processes: each family under --shard fsdp (saving
    every 2 steps), and KILLED's run killed after step 2 and resumed."""
    root = tmp_path_factory.mktemp("fsdp-nf4")
    common = ["--data", str(manifests(root / "data")), "--dtype", "float32", "--device", "cpu", "--quantize", "nf4",
              *FLAGS]
    flags, margins = {}, {}
    for family, method in RUNS.items():  # a packed base routes otherwise than its dense model: drawn for it
        _, flags[family], margins[family] = clear_of_ties(root, family, family, [*method, *common])
    sharded = {f: ["--out-dir", str(root / "fsdp"), "--shard", "fsdp", "--save-every-steps", "2", *fl]
               for f, fl in flags.items()}
    killed = [*sharded[KILLED], "--run-name", "killed"]
    plan = [*({"flags": [*sharded[f], "--run-name", f]} for f in RUNS),
            {"flags": killed, "kill_after_steps": 2}, {"flags": [*killed, "--resume"]}]
    done = torchrun(root, plan)
    assert done.returncode == 0, done.stderr[-4000:]
    return {"root": root, "flags": flags, "margins": margins, "log": done.stderr}


@pytest.mark.parametrize("family", list(RUNS))
def test_two_sharded_quantized_processes_equal_one_quantized_process(runs, family):
    """The step terms and gradient norm within rtol 1e-5, the adapter's every element within 2 x lr x steps and all
    but 0.1% within 1e-6: test_sharding's tolerance, for the same reason (reduction order; each rank
    dequantises the same bytes the one process packed, bit for bit: tests/runs/test_sharded_load.py)."""
    assert runs["margins"][family] >= TRAINING_MARGIN, f"{family}: routes on near-ties in five models drawn"
    one, two = runs["root"] / "one" / family, runs["root"] / "fsdp" / family
    record = json.loads((two / "config.json").read_text())
    assert record["shard"] == "fsdp" and record["world_size"] == 2 and record["quantize"] == "nf4"
    a, b = steps(one), steps(two)
    assert len(a) == len(b) == STEPS
    for key in ("loss", "task", "method", "grad_norm"):
        torch.testing.assert_close(torch.tensor([r[key] for r in b]), torch.tensor([r[key] for r in a]),
                                   rtol=1e-5, atol=1e-7, msg=key)
    x, y = adapter(one), adapter(two)
    assert x.keys() == y.keys()
    diffs = torch.cat([(y[k].float() - x[k].float()).abs().flatten() for k in x])
    assert diffs.max() <= 2 * LR * STEPS
    assert (diffs > 1e-6).float().mean() <= 0.001
    assert any(diff > 0 for diff in diffs)  # it trained and took another reduction order: not a copy of one


def test_the_sharded_quantized_adapter_loads_onto_the_packed_base(runs):
    """Its base-weights digest (the ranks' digest samples summed) is the one-process packed base's: load_adapter
    takes it there without allow_other_base."""
    for family in RUNS:
        model = runs["flags"][family][1]
        load_adapter(from_pretrained(model, dtype="float32", quantize="nf4"),
                     runs["root"] / "fsdp" / family / "checkpoints" / "epoch-1")


def test_a_killed_sharded_quantized_run_resumes_to_the_uninterrupted_result(runs):
    """Killed after step 2 of 4, resumed: steps 3 and 4 run on the restored AdamW moments and the same packed
    bytes, so the step records and the adapter equal the run never killed, bit for bit."""
    killed, straight = runs["root"] / "fsdp" / "killed", runs["root"] / "fsdp" / KILLED
    assert "stopped after step 2" in runs["log"]
    assert [(r["step"], r["loss"]) for r in steps(killed)] == [(r["step"], r["loss"]) for r in steps(straight)]
    x, y = adapter(straight), adapter(killed)
    assert all(torch.equal(x[k], y[k]) for k in x)
