"""--shard fsdp (minimoe/runs/sharding.py) on the CPU with gloo: for eleven families (`SHARDED`: the first
eight, both hybrids, Llama 4), a tiny checkpoint that transformers saved, two FSDP processes (and two DDP
processes) equal one process at the same global batch over 4 real updates, and so do the baselines with a
distributed path of their own (`BASELINES`: DenseMixer; ESFT, both forms, under DDP: FSDP refuses it), on
models drawn to route clear of ties (`TRAINING_MARGIN`); a sharded run killed after
step 2 resumes to the uninterrupted result; refusals before any run folder exists. The sharded load
itself, every family at 2 and 3 ranks and odd widths, is tests/runs/test_sharded_load.py (in this
process, no torchrun).

One method per family, each method at least once: the sharded path sees a method only through the
parameters it adds or unfreezes (LoRA, TES's error head, Dual Affinity's copy of the gate, the gate
itself under --tune-router), all built, sharded, gathered and restored by the same code; what differs
between families is the base (its entries on disk, shapes, biases, buffers). The methods' own equations
are held against one process and the paper in tests/core.

Every sharded and DDP run of the module is one torchrun launch (tests/fsdp_worker.py): starting gloo
processes and importing torch dominate a tiny run, and inside it a family's run takes a second or two.
DDP is there per family at that price: its reducer stops at a trainable parameter that no loss reaches,
and which parameters train depends on the family (dense layers, shared experts, biases); it also tells a
sharding error from a data-parallel one.
"""
import json
import os
import socket
import shlex
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file

from minimoe.cli import train
from minimoe.core.task import step
from minimoe.core.token_mixers import compressed_attention
from minimoe.core.token_mixers.compressed_attention import CompressedIndexer
from minimoe.core.token_mixers.dsa_indexer import LightningIndexer
from minimoe.core.adaptation.lora import add_lora, merge_lora
from minimoe.data.benchmarks import load_examples
from minimoe.evaluation.folders import METRICS, eval_dir
from minimoe.loading.checkpoint import from_pretrained, save_pretrained
from minimoe.loading.config_json import read_config
from minimoe.making.tiny import tiny_checkpoint
from minimoe.runs.adapters import load_adapter
from minimoe.runs.config import build_config
from minimoe.runs.run_folder import run_lock
from minimoe.runs.sharding import ShardingRefused, check_sharding, shard
from tests.conftest import oracle, routing_margin, tiny_model
from tests.runs.test_sharded_load import with_biases

REPO = Path(__file__).resolve().parents[2]
LR = 2e-3  # the tiny recipe's
STEPS = 4  # optimizer steps of 8 examples (4 a rank), every one at a learning rate above 0 (--warmup 0, linear)
FLAGS = ["--max-train-examples", str(8 * STEPS), "--batch-size", "8", "--epochs", "1", "--warmup", "0",
         "--lora-dropout", "0", "--recipe", "tiny", "--no-test-eval", "--quiet"]
METHOD = {"granitemoe": ["--method", "acs", "--objective", "is", "--tune-router"],
          "olmoe": ["--method", "ce"],
          "qwen3_moe": ["--method", "tes", "--objective", "is"],
          "qwen2_moe": ["--method", "dual"],
          "mixtral": ["--method", "tes", "--objective", "enll"],
          "deepseek_v2": ["--method", "acs", "--objective", "enll"],
          "deepseek_v3": ["--method", "dual"],
          "gpt_oss": ["--method", "acs", "--objective", "enll", "--tune-router"],  # the gate and its bias trained
          "granitemoehybrid": ["--method", "tes", "--objective", "enll"],  # Mamba-2 mixers
          "qwen3_next": ["--method", "acs", "--objective", "is"],  # Gated DeltaNet mixers
          "llama4_text": ["--method", "dual"]}  # top-1 input-scaled router, a dense layer
SHARDED = list(METHOD)  # the families held equal under --shard fsdp (docs/distributed.md)
# The baselines whose distributed path is their own: ESFT's choice of experts from every rank's usage (an
# all-reduce in its preparation; both forms: LoRA on the chosen experts, or their rows in full) and
# DenseMixer's dense router gradient. Run name -> (family, flags).
BASELINES = {"esft": ("mixtral", ["--method", "esft", "--esft-p", "0.5"]),
             "esft-full": ("olmoe", ["--method", "esft", "--esft-form", "full"]),
             "densemixer": ("mixtral", ["--method", "densemixer"])}
RUNS = {**{f: (f, METHOD[f]) for f in SHARDED}, **BASELINES}  # run name -> (family, method flags)
UNSHARDED = {"esft", "esft-full"}  # refused under --shard fsdp (sharding.check_sharding): DDP only
# Routing ties: one process and two ranks round differently, and a token whose K-th and (K+1)-th router
# logits sit closer than that picks other experts on one side (seen: 1.2e-7 apart at step 6; the loss then
# 4.5e-4 off). Every one-process run's forwards are checked to route clear of ties by TRAINING_MARGIN, 10x
# the spread of the two sides' step terms (1e-6); a model that does not is drawn again (`transformers_saved`'s seed).
TRAINING_MARGIN = 1e-5
# Elements of the adapter allowed beyond 1e-6 of one process's (test_two_processes_equal_one_process). Qwen3-Next:
# its DeltaNet's rounding (each rank pads its 4 examples, not the 8) puts step 1's loss 8e-7 relative off one
# process's, and AdamW carries one near-zero gradient element's flip along that LoRA rank of one expert: 0.39%
# of the elements beyond 1e-6, the largest 3.3e-3; FSDP and DDP bit for bit alike, so none of it is sharding's.
SPREAD = {"qwen3_next": 0.005}
KILLED = "gpt_oss"  # killed after step 2 of 4 and resumed: its AdamW moments, the gate's included, then matter
WIDTHS = {"gpt_oss": dict(max_position_embeddings=256)}  # room for a benchmark question


def transformers_saved(family: str, folder: Path, seed: int = 0) -> Path:
    """Tiny `family` (conftest's switches, weights of `seed`; every bias random) at the tiny tokenizer's
    vocabulary, read by transformers and written by its own save_pretrained, beside that tokenizer."""
    transformers = oracle("transformers")
    tokenizer = tiny_checkpoint()
    ids = read_config(tokenizer)
    model = tiny_model(family, seed=seed, vocab_size=ids.vocab_size, pad_token_id=ids.pad_token_id,
                       eos_token_id=ids.eos_token_id, **WIDTHS.get(family, {}))
    save_pretrained(with_biases(model), folder / "ours")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder / "ours", dtype=torch.float32)
    theirs.save_pretrained(folder / "saved")
    shutil.copy(tokenizer / "tokenizer.json", folder / "saved" / "tokenizer.json")
    return folder / "saved"


def manifests(folder: Path) -> Path:
    """ARC-Challenge cut to the runs' needs: 32 training questions, 4 to validate, 4 to test."""
    pool = load_examples("arc_challenge")
    folder.mkdir()
    for split, part in (("train", pool[:8 * STEPS]), ("val", pool[40:44]), ("test", pool[44:48])):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(asdict(e)) + "\n" for e in part))
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """For each family: one process here, then in one torchrun launch of 2 gloo processes: --shard fsdp, DDP,
    and for KILLED a sharded run killed after step 2 and resumed. The sharded runs save every 2 steps, so
    that the killed run's uninterrupted twin is the family's own sharded run."""
    root = tmp_path_factory.mktemp("fsdp")
    # float32 on the CPU by name: a module fixture runs before conftest's per-test settings of them
    common = ["--data", str(manifests(root / "data")), "--dtype", "float32", "--device", "cpu", *FLAGS]
    models, flags, margins = {}, {}, {}
    for name, (family, method) in RUNS.items():
        models[name], flags[name], margins[name] = clear_of_ties(root, name, family, [*method, *common])
    sharded = {f: ["--out-dir", str(root / "fsdp"), "--shard", "fsdp", "--save-every-steps", "2", *fl]
               for f, fl in flags.items()}
    plan = [{"flags": [*sharded[f], "--run-name", f]} for f in RUNS if f not in UNSHARDED]
    plan += [{"flags": ["--out-dir", str(root / "ddp"), "--run-name", f, *fl]} for f, fl in flags.items()]
    killed = [*sharded[KILLED], "--run-name", "killed"]
    plan += [{"flags": killed, "kill_after_steps": 2}, {"flags": [*killed, "--resume"]}]
    # Refused by rank 0 alone, and so by every rank: a --resume of a DDP run with --shard fsdp (after the
    # sharded build), and a run folder whose lock this process holds.
    plan += [{"flags": ["--out-dir", str(root / "ddp"), "--run-name", "olmoe", *flags["olmoe"], "--shard", "fsdp",
                        "--resume"], "refused": True},
             {"flags": ["--out-dir", str(root / "one"), "--run-name", "olmoe", *flags["olmoe"], "--resume"],
              "refused": True}]
    with run_lock(root / "one" / "olmoe"):
        done = torchrun(root, plan)
    assert done.returncode == 0, done.stderr[-4000:]
    return {"root": root, "models": models, "log": done.stderr, "margins": margins}


def free_port() -> int:
    """A TCP port free on this machine now: the launch's rendezvous, so that launches running at once (two test
    sessions on one machine) do not meet on a fixed port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(root: Path, plan: list) -> subprocess.CompletedProcess:
    """`plan`'s runs (tests/fsdp_worker.py) in one torchrun launch of 2 gloo processes, its plan.json in `root`."""
    (root / "plan.json").write_text(json.dumps({"runs": plan}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), "-m", "tests.fsdp_worker", str(root / "plan.json")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def clear_of_ties(root: Path, name: str, family: str, flags: list,
                  saved=transformers_saved) -> tuple[Path, list, float]:
    """The first of five models of `family` (seeds 0-4, each written by `saved`) whose one-process run
    (root/one/name, with `flags`) routes clear of ties: (the model, its flags, the run's routing margin)."""
    for seed in range(5):
        model = saved(family, root / "models" / f"{name}-{seed}", seed)
        shutil.rmtree(root / "one" / name, ignore_errors=True)
        margin = one_process(["--out-dir", str(root / "one"), "--run-name", name, "--model", str(model), *flags])
        if margin >= TRAINING_MARGIN:
            break
    return model, ["--model", str(model), *flags], margin


def one_process(flags: list) -> float:
    """train.main(flags) here; returns the smallest selection margin of its training forwards, every step's: the
    routers' (conftest.routing_margin) and a DSA or CSA indexer's top-k (`indexer_margin`)."""
    margins, forward, select = [], step.forward_tokens, LightningIndexer.forward
    scores = []  # (masked scores [B, T, S], k, its real queries [B, T] or None: the batch's) of each indexer call
    piece_rows = []  # DeepSeek-V4's packed rows as pieces: their real positions [N, L] (compressed_attention.pieces)

    def recorded(model, batch, chunk=None):
        out, logp = forward(model, batch, chunk)
        margins.append(routing_margin(model, out.routings, batch.attention_mask))
        margins.extend(indexer_margin(s, k, batch.attention_mask if real is None else real) for s, k, real in scores)
        scores.clear()
        piece_rows.clear()
        return out, logp

    @torch.no_grad()
    def indexer(self, x, q_latent, cos, sin, allowed, cache=None, start=0):
        scores.append((self.scores(x, q_latent, cos, sin, cache, start).masked_fill(~allowed[:, 0], float("-inf")),
                       self.topk, None))
        return select(self, x, q_latent, cos, sin, allowed, cache, start)

    def compressed(self, x, q_latent, rope, cos, sin, visible, *rest):  # DeepSeek-V4's CSA indexer: its scores as computed
        raw = []

        def recording(*args):  # the scores the indexer computes, kept
            raw.append(weigh(*args))
            return raw[-1]

        with mock.patch.object(compressed_attention, "head_weighted_scores", recording):
            kept = pick(self, x, q_latent, rope, cos, sin, visible, *rest)
        # packed rows run as their pieces (each prompt + one candidate): the pieces' real queries, not the batch's (a
        # padding query's picks reach no output)
        scores.append((raw[0].masked_fill(~visible, float("-inf")), self.topk, piece_rows[0] if piece_rows else None))
        return kept

    def cut(segment_ids, attention_mask=None):
        found = split(segment_ids, attention_mask)
        piece_rows.append(found[2])
        return found

    weigh, pick = compressed_attention.head_weighted_scores, CompressedIndexer.forward
    split = compressed_attention.pieces
    with (mock.patch.object(step, "forward_tokens", recorded), mock.patch.object(LightningIndexer, "forward", indexer),
          mock.patch.object(CompressedIndexer, "forward", compressed),
          mock.patch.object(compressed_attention, "pieces", cut)):
        train.main(flags)
    return min(margins)


def indexer_margin(scores, k: int, attention_mask) -> float:
    """conftest.indexer_margin's measure (the k-th minus the (k+1)-th score, relative to the query's largest, over the
    real queries that allow more than k keys) of one indexer call of a training forward (scores [B, T, S], -inf where
    the mask forbids), packed candidates' segments included, which conftest's forward of `ids` alone has not."""
    if scores.shape[-1] <= k:  # every key kept
        return float("inf")
    top = scores.topk(k + 1, dim=-1).values  # [B, T, k+1]
    chosen = torch.isfinite(top[..., k]) & attention_mask.bool()
    return ((top[..., k - 1] - top[..., k]) / top[..., 0].abs())[chosen].min().item() if chosen.any() else float("inf")


def steps(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "step"]


def adapter(run: Path) -> dict:
    return load_file(run / "checkpoints" / "epoch-1" / "adapter.safetensors")


@pytest.mark.parametrize("family,mode", [(name, mode) for name in RUNS for mode in ("fsdp", "ddp")
                                         if not (mode == "fsdp" and name in UNSHARDED)])
def test_two_processes_equal_one_process(runs, family, mode):
    """The adapter after 4 real updates, each step's loss terms and the routing statistics of the whole batch.

    Why they differ at all: reduction order. Each rank's gradient is a sum over its 4 examples, and FSDP's
    reduce-scatter (DDP's all-reduce) adds the two halves; one process adds the 8 examples' terms in
    another order, so each step's gradient differs from one process's at float32 rounding, and each
    update carries that difference on. The step terms and gradient norm agree within rtol 1e-5 (measured:
    5.1e-7 at most; Qwen3-Next 5.9e-6 at steps 3 and 4: `SPREAD`). AdamW divides by the square root of its
    second moment, so an element whose gradient is at rounding level can step by up to lr the other way:
    every element is within 2 * lr * steps, and all
    but 0.1% within 1e-6 (measured: at most 0.04% of a family's elements beyond 1e-6, the largest 2.7e-5,
    DeepSeek-V3; FSDP and DDP alike; Qwen3-Next more: `SPREAD`). `family` is a run name: a family, or one of
    `BASELINES` (ESFT's choice is the same experts on every rank and in one process: `chosen` is in the adapter).

    The one-process run routes clear of ties (`TRAINING_MARGIN`): the comparison does not hang on where they fall."""
    assert runs["margins"][family] >= TRAINING_MARGIN, f"{family}: routes on near-ties in five models drawn"
    one, two = runs["root"] / "one" / family, runs["root"] / mode / family
    record = json.loads((two / "config.json").read_text())
    assert record["shard"] == mode and record["world_size"] == 2  # the run folder says which mode ran
    a, b = runs_agree(one, two, spread=SPREAD.get(family, 0.001))
    # each record's lr is the next step's: steps 1-4 ran at lr x 1, 3/4, 1/2, 1/4
    rate = 1e-5 if family == "esft-full" else LR  # the full form's rows: esft_lr's default, its only group
    assert [r["lr"] for r in a] == pytest.approx([rate * (1 - s / STEPS) for s in range(1, STEPS + 1)])
    if RUNS[family][1][1] in ("tes", "acs"):  # the supervision term is there to compare
        assert all(r["method"] > 0 for r in b)


def runs_agree(one: Path, two: Path, *, grad_rtol: float = 1e-5, spread: float = 0.001) -> tuple[list, list]:
    """test_two_processes_equal_one_process's comparison of run `two` with run `one` (its docstring: why these
    bounds): the step terms within rtol 1e-5 (the gradient norm within `grad_rtol`), the routing statistics, the
    adapter's every element within 2 x lr x steps and all but `spread` of them within 1e-6. Returns their steps."""
    a, b = steps(one), steps(two)
    assert len(a) == len(b) == STEPS
    for key in ("loss", "task", "method", "grad_norm"):  # the method term: summed over ranks, as one batch's
        torch.testing.assert_close(torch.tensor([r[key] for r in b]), torch.tensor([r[key] for r in a]),
                                   rtol=grad_rtol if key == "grad_norm" else 1e-5, atol=1e-7, msg=key)
    for ra, rb in zip(a, b):  # routing statistics: every rank's micro-batches, not rank 0's half
        assert ra["routing"].keys() == rb["routing"].keys()
        for layer, stats in ra["routing"].items():
            for name, value in stats.items():
                torch.testing.assert_close(torch.tensor(rb["routing"][layer][name]), torch.tensor(value),
                                           rtol=1e-5, atol=2e-6, msg=f"{layer} {name}")
    x, y = adapter(one), adapter(two)
    assert x.keys() == y.keys()
    diffs = torch.cat([(y[k].float() - x[k].float()).abs().flatten() for k in x])  # float: ESFT's bool `chosen`
    assert diffs.max() <= 2 * LR * STEPS
    assert (diffs > 1e-6).float().mean() <= spread
    return a, b


@pytest.mark.parametrize("family", [name for name in RUNS if name not in UNSHARDED])
def test_fsdp_equals_ddp(runs, family):
    """The same two ranks' batches, FSDP against DDP: what is left is the order of the gradient's reduction
    (reduce-scatter against all-reduce), not one process's batch of 8, so the adapters agree closely for every
    family, Qwen3-Next's included: every element within 1e-5, all but 0.1% within 1e-6 (measured: the largest
    2.1e-6, DeepSeek-V3; 0.006% of its elements beyond 1e-6; Qwen3-Next, Granite 4.0-H, GraniteMoE and
    Qwen3-MoE bit for bit)."""
    x, y = adapter(runs["root"] / "ddp" / family), adapter(runs["root"] / "fsdp" / family)
    assert x.keys() == y.keys()
    diffs = torch.cat([(y[k].float() - x[k].float()).abs().flatten() for k in x])
    assert diffs.max() <= 1e-5
    assert (diffs > 1e-6).float().mean() <= 0.001


def test_a_sharded_adapter_loads_as_a_one_process_adapter(runs):
    """The gathered files are today's: load_adapter (evaluate.py, export.py) takes them on the unsharded
    base, its base-weights digest (computed from the gathered shards) included."""
    for family, model in runs["models"].items():
        if family in UNSHARDED:
            continue
        base = from_pretrained(model)
        load_adapter(base, runs["root"] / "fsdp" / family / "checkpoints" / "epoch-1")
        saved = adapter(runs["root"] / "fsdp" / family)
        state = base.state_dict()
        assert all(torch.equal(state[k], v) for k, v in saved.items())


def test_a_sharded_run_exports_as_a_one_process_run(runs, tmp_path):
    """export.py on the sharded run folder: a peft adapter (CE), and merged into its base (ACS + affinity
    tuning); the merged weights equal the one-process run's merge within the adapters' difference."""
    from minimoe.cli import export
    export.main([str(runs["root"] / "fsdp" / "olmoe"), str(tmp_path / "peft")])
    assert (tmp_path / "peft" / "adapter_model.safetensors").is_file()
    for name in ("one", "fsdp"):
        export.main([str(runs["root"] / name / "granitemoe"), str(tmp_path / f"merged-{name}"), "--merged"])
    one, sharded = (load_file(tmp_path / f"merged-{name}" / "model.safetensors") for name in ("one", "fsdp"))
    assert one.keys() == sharded.keys()
    for key in one:
        torch.testing.assert_close(sharded[key], one[key], rtol=0, atol=1e-5, msg=key)


def test_a_killed_sharded_run_resumes_to_the_uninterrupted_result(runs):
    """Killed after step 2 of 4 (its step checkpoint written: adapter + gathered AdamW state), resumed with
    --resume: steps 3 and 4 run on the restored moments (fresh ones would change the step 4 loss and the
    adapter), so the step records and the adapter equal the run never killed, bit for bit."""
    killed, straight = runs["root"] / "fsdp" / "killed", runs["root"] / "fsdp" / KILLED
    assert "stopped after step 2" in runs["log"]
    assert [(r["step"], r["loss"]) for r in steps(killed)] == [(r["step"], r["loss"]) for r in steps(straight)]
    x, y = adapter(straight), adapter(killed)
    assert all(torch.equal(x[k], y[k]) for k in x)
    state = torch.load(killed / "checkpoints" / "epoch-1" / "training_state.pt", weights_only=True)
    assert all(isinstance(k, str) for k in state["optimizer"]["state"])  # gathered, keyed by parameter name


def test_the_evaluate_commands_a_sharded_run_prints_score_it(runs):
    """A sharded run leaves its test score to evaluate.py and prints the commands (train.evaluate_commands):
    they run as printed, each into the folder train.py itself would have written."""
    from minimoe.cli import evaluate
    run = runs["root"] / "fsdp" / "olmoe"
    cfg = build_config({"test_checkpoint": "both"}, "tiny")
    commands = train.evaluate_commands(run, cfg)
    assert len(commands) == 2
    for command, checkpoint in zip(commands, ("last", "selected")):
        assert command.startswith("python evaluate.py ")
        evaluate.main(shlex.split(command)[2:])
        assert json.loads((eval_dir(run, "test", checkpoint) / METRICS).read_text())["n_examples"] == 4


def test_what_rank_0_refuses_every_rank_refuses(runs):
    """A --resume with another --shard, and a run folder another process holds: rank 0 finds it, every rank
    then exits with status 1 and rank 0 alone prints the line, rather than rank 1 going on into the
    collectives (a gloo error) or into the run's DDP optimizer state."""
    log = runs["log"]
    assert "rank 0: exit 1: train.py: error: --resume with a different config: ['shard'] differ" in log
    assert f"rank 0: exit 1: train.py: error: {runs['root'] / 'one' / 'olmoe'}: in use by process {os.getpid()}" in log
    assert log.count("rank 1: exit 1: 1\n") == 2
    assert log.count("--resume with a different config") == log.count(": in use by process") == 1
    assert "Traceback" not in log


def test_fsdp_is_refused_before_any_run_folder(tmp_path, monkeypatch):
    """Outside torchrun, at world size 1, with --zero-shot (the base scored whole on rank 0): a named
    error, and no run folder."""
    flags = ["--out-dir", str(tmp_path), "--run-name", "run", "--data-dir", str(tmp_path / "splits"), "--model",
             "tiny", *FLAGS, "--shard", "fsdp"]
    with pytest.raises(ShardingRefused, match="not launched by torchrun"):
        train.main(flags)
    monkeypatch.setenv("LOCAL_RANK", "0")  # as torchrun --nproc_per_node 1 sets it
    with pytest.raises(ShardingRefused, match="world size is 1"):
        train.main(flags)
    assert not (tmp_path / "run").exists()
    cfg = build_config({"model": "tiny", "zero_shot": True, "shard": "fsdp"}, "tiny")
    with pytest.raises(ShardingRefused, match="--zero-shot"):
        check_sharding(cfg, 2)
    for form in ("lora", "full"):
        cfg = build_config({"model": "tiny", "shard": "fsdp", "method": "esft", "method_options": {"esft_form": form}},
                           "tiny")
        with pytest.raises(ShardingRefused, match="--method esft"):
            check_sharding(cfg, 2)


def test_a_merged_lora_is_refused():
    model = add_lora(tiny_model("olmoe"))
    merge_lora(model)
    with pytest.raises(ShardingRefused, match="LoRA is merged"):
        shard(model, torch.device("cpu"))
