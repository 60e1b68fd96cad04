"""--shard fsdp on the 2026 families, on the CPU with gloo: two FSDP processes equal one process at the same global
batch over 4 real updates, at tests/runs/test_sharding.py's tolerance and by its pattern (one torchrun launch, models
drawn to route, and to pick DSA's and CSA's keys, clear of ties), for all thirteen: DeepSeek-V3.2 and GLM-5 (MLA
with the DSA indexer: its top-k picks each query's keys, its parameters frozen but sharded with the layer),
Qwen3.5-MoE (Gated DeltaNet's split projections, gated attention), Kimi-Linear (Kimi Delta Attention among NoPE MLA
layers), LFM2-MoE (gated short convolutions), DeepSeek-V4 (hyper-connections' streams, compressed sparse attention
with its CSA indexer, hash-routed layers whose integer tid2eid every rank reads whole), Gemma 4 (the dense MLP
beside the MoE block, the scaled router), Nemotron-H (Mamba-2, attention and MoE as single-block layers,
squared-ReLU experts), MiMo-V2-Flash (sliding layers with their own KV heads and sinks, a value head dim apart),
MiniMax-M2, GLM-4.7-Flash, Mistral 4 and Granite-Swash; FSDP equals DDP on the first four; and --quantize nf4
--shard fsdp on DeepSeek-V3.2 (MLA and the dense layer packed, the indexer dense).

transformers 4.57 holds none of them, so the models are ours, written by our save_pretrained at the tiny
tokenizer's vocabulary (their loading is held exact against transformers 5.23 by the tf5 parity tests); no oracle is
needed here: what is compared is one process against two, on the same checkpoint.
"""
import json
import shutil
from pathlib import Path

import pytest
import torch

from minimoe.loading.checkpoint import save_pretrained
from minimoe.loading.config_json import read_config
from minimoe.making.tiny import tiny_checkpoint
from tests.conftest import tiny_model
from tests.runs.test_sharded_load import with_biases
from tests.runs.test_sharding import (FLAGS, TRAINING_MARGIN, adapter, clear_of_ties, manifests, runs_agree, steps,
                                     torchrun)

METHOD = {"deepseek_v32": ["--method", "dual"],
          "qwen3_5_moe": ["--method", "acs", "--objective", "is"],
          "kimi_linear": ["--method", "tes", "--objective", "enll"],
          "lfm2_moe": ["--method", "ce"],
          "deepseek_v4": ["--method", "dual"],
          "gemma4_text": ["--method", "acs", "--objective", "is"],
          "nemotron_h": ["--method", "tes", "--objective", "enll"],
          "mimo_v2_flash": ["--method", "ce"],
          "minimax_m2": ["--method", "tes", "--objective", "is"],
          "glm4_moe_lite": ["--method", "dual"],
          "mistral4": ["--method", "acs", "--objective", "enll"],
          "granitemoe_swa": ["--method", "ce"],
          "glm_moe_dsa": ["--method", "tes", "--objective", "enll"]}
# Also run under DDP (test_fsdp_equals_ddp): the first four, the families of each kind of mixer then held; the nine
# added since under FSDP alone, against one process (the nine cost the module 14-26 s on 2 cores; their DDP runs
# would add a tenth more)
DDP = ["deepseek_v32", "qwen3_5_moe", "kimi_linear", "lfm2_moe"]
# run name -> (family, flags): each family as above; DeepSeek-V3.2 once more on a packed base
RUNS = {**{f: (f, m) for f, m in METHOD.items()},
        "deepseek_v32-nf4": ("deepseek_v32", ["--method", "tes", "--objective", "is", "--quantize", "nf4"])}
# The DSA indexer at 16 heads, not the tiny 4: a key whose relu is 0 in every head scores exactly 0, and at 4 heads
# such ties sit at the k-th place in many rows, and the row length decides which key topk returns (one process's
# 8 rows against the same rows as two batches of 4: answer log-probabilities 1.1 apart)
# (GLM-5: the same indexer). DeepSeek-V4's CSA indexer the same, 16 heads, not the tiny 8: at 8, its top-k tied
# exactly (margin 0) in the first two models drawn, and the third routed 1.2e-5 clear and left 0.37% of the adapter
# beyond 1e-6 of one process's
WIDTHS = {"deepseek_v32": dict(index_n_heads=16), "glm_moe_dsa": dict(index_n_heads=16),
          "deepseek_v4": dict(compressed_index_n_heads=16)}
# The recurrent mixers against one process (not against DDP, which FSDP equals closely: test_fsdp_equals_ddp): each
# rank pads its 4 examples to their own longest, and Gated DeltaNet's and KDA's chunked recurrences round otherwise
# at another row length; one process alone, the 8 examples' gradient against its two halves' sum differs by up to
# 1.2e-2 in an element (Qwen3.5-MoE, norm 1.5e4; 3e-5 for LFM2-MoE and DeepSeek-V3.2). Measured against one
# process: the gradient norm 1.8e-5 relative (Kimi-Linear, step 1) and 1.0e-5 (Qwen3.5-MoE, step 4); 0.50% of
# Kimi-Linear's adapter elements beyond 1e-6, the largest 1.2e-5. Bounds: GRAD_RTOL, and SPREAD as test_sharding's.
GRAD_RTOL = {"kimi_linear": 5e-5, "qwen3_5_moe": 5e-5}
SPREAD = {"kimi_linear": 0.01}


def ours_saved(family: str, folder: Path, seed: int = 0) -> Path:
    """Tiny `family` (conftest's switches, weights of `seed`; every bias random) at the tiny tokenizer's
    vocabulary, written by our save_pretrained beside that tokenizer."""
    tokenizer = tiny_checkpoint()
    ids = read_config(tokenizer)
    model = tiny_model(family, seed=seed, vocab_size=ids.vocab_size, pad_token_id=ids.pad_token_id,
                       eos_token_id=ids.eos_token_id, **WIDTHS.get(family, {}))
    save_pretrained(with_biases(model), folder)
    shutil.copy(tokenizer / "tokenizer.json", folder / "tokenizer.json")
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each run in one process here, then all of them under --shard fsdp in one torchrun launch of 2 gloo processes."""
    root = tmp_path_factory.mktemp("fsdp2026")
    common = ["--data", str(manifests(root / "data")), "--dtype", "float32", "--device", "cpu", *FLAGS]
    flags, margins = {}, {}
    for name, (family, method) in RUNS.items():
        _, flags[name], margins[name] = clear_of_ties(root, name, family, [*method, *common], saved=ours_saved)
    plan = [{"flags": ["--out-dir", str(root / "fsdp"), "--shard", "fsdp", "--run-name", name, *fl]}
            for name, fl in flags.items()]
    plan += [{"flags": ["--out-dir", str(root / "ddp"), "--run-name", name, *flags[name]]} for name in DDP]
    done = torchrun(root, plan)
    assert done.returncode == 0, done.stderr[-4000:]
    return {"root": root, "margins": margins}


@pytest.mark.parametrize("name", list(RUNS))
def test_two_sharded_processes_equal_one_process(runs, name):
    """test_sharding's comparison and tolerance (test_sharding.runs_agree), for the same reason: each rank's gradient
    sums its 4 examples, the reduce-scatter adds the halves, float32 rounding in another order that AdamW carries
    on; for the recurrent mixers, their padding besides (`GRAD_RTOL`, `SPREAD`)."""
    assert runs["margins"][name] >= TRAINING_MARGIN, f"{name}: routes on near-ties in five models drawn"
    one, two = runs["root"] / "one" / name, runs["root"] / "fsdp" / name
    record = json.loads((two / "config.json").read_text())
    assert record["shard"] == "fsdp" and record["world_size"] == 2
    assert record["quantize"] == ("nf4" if name.endswith("-nf4") else None)
    runs_agree(one, two, grad_rtol=GRAD_RTOL.get(name, 1e-5), spread=SPREAD.get(name, 0.001))
    x, y = adapter(one), adapter(two)
    assert any(not torch.equal(x[k], y[k]) for k in x)  # it trained, in another reduction order: not a copy of one


@pytest.mark.parametrize("name", DDP)
def test_fsdp_equals_ddp(runs, name):
    """The same two ranks' batches, FSDP against DDP (test_sharding's test of the name): what is left is the order of
    the gradient's reduction, so the step terms agree within rtol 1e-5 and the adapters' every element within 1e-5,
    all but 0.1% within 1e-6, the recurrent mixers' included (measured: the gradient norm 1.7e-6 relative at most,
    an adapter element 4.3e-7, Qwen3.5-MoE; Kimi-Linear within 1.5e-8; DeepSeek-V3.2 and LFM2-MoE bit for bit)."""
    a, b = steps(runs["root"] / "ddp" / name), steps(runs["root"] / "fsdp" / name)
    for key in ("loss", "task", "method", "grad_norm"):
        torch.testing.assert_close(torch.tensor([r[key] for r in b]), torch.tensor([r[key] for r in a]),
                                   rtol=1e-5, atol=1e-7, msg=key)
    x, y = adapter(runs["root"] / "ddp" / name), adapter(runs["root"] / "fsdp" / name)
    assert x.keys() == y.keys()
    diffs = torch.cat([(y[k].float() - x[k].float()).abs().flatten() for k in x])
    assert diffs.max() <= 1e-5
    assert (diffs > 1e-6).float().mean() <= 0.001
