"""The tests' shared pieces: tiny random models of every family (minimoe/making/tiny.py's builder, which
`--model tiny:<model_type>` uses too), the `family` fixture, `oracle`, the reference packages."""
import importlib
import json
import os
import sys
from dataclasses import asdict, fields, replace
from types import SimpleNamespace

import pytest
import torch

from minimoe.core.decoder import families_2026  # noqa: F401  (every record registered)
from minimoe.core.decoder.family_record import FAMILIES
from minimoe.core.token_mixers.mixers import MIXERS
from minimoe.data.benchmarks import load_examples
from minimoe.making.tiny import tiny_config, tiny_model  # noqa: F401 (the tests import them from here)

# The reference packages the test extra installs (setup.cfg [test]); minimoe never imports them at run time.
ORACLES = ("transformers", "peft", "lm_eval", "wandb", "tensorboard", "datasets", "submitit")


class MissingOracle:
    """An oracle that is not installed: the first use of it skips the test that uses it."""

    def __init__(self, name: str):
        self.name = name

    def __getattr__(self, attr):
        if attr.startswith("_"):  # pytest's look-ups while collecting (fixture markers), not a use: they skipped the
            raise AttributeError(attr)  # whole file that held `transformers = oracle(...)`, on a plain install
        pytest.skip(f"{self.name} is not installed: an oracle of the test extra (pip install -e \".[test]\")")


def oracle(name: str):
    """The oracle package `name` (one of ORACLES) or, on a plain `pip install -e .` without it, a
    MissingOracle: the tests that use it skip, every other test of the file still runs (.ci/run's second
    environment). A minimoe module is never imported this way: a rename there must fail, not skip."""
    if name.split(".")[0] not in ORACLES:
        raise ValueError(f"oracle({name!r}): expected one of the test extra's {ORACLES}")
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is None or not name.startswith(e.name):  # the package is there but broken: fail loudly
            raise
        return MissingOracle(name)


def as_our_mixer_config(reference_config, kind: str):
    """transformers' config of a layer as our mixer `kind` (core/token_mixers/mixers.py) reads one: its shared fields as they
    are, and the mixer's own options, by the same config.json names, in `mixers[kind]` (one no config.json
    names, such as the DeltaNet's linear_in_proj, at its default)."""
    options = MIXERS[kind].config_class
    # an option the reference's config lacks (Nemotron-H's mamba_dt_min, on Granite's) keeps our default
    mine = options(**{f.name: getattr(reference_config, f.name, f.default) for f in fields(options)})
    return SimpleNamespace(**reference_config.to_dict(), mixers={kind: mine})


# MINIMOE_ALL_FAMILIES=1: also the cases CI leaves out of the slowest per-family tests, where one family (or one
# method) exercises the code they share; each such test says why in its docstring (the CI budget: docs/install.md).
ALL_FAMILIES = "MINIMOE_ALL_FAMILIES"


def only_in_the_full_matrix(why: str) -> None:
    if os.environ.get(ALL_FAMILIES) != "1":
        pytest.skip(f"{why}; {ALL_FAMILIES}=1 runs it")


# Routing ties: two implementations that round differently (ours and transformers', one process and two
# ranks) may pick different experts where a token's K-th and (K+1)-th selection scores are closer than their
# rounding, and a parity test then fails at random. Test inputs are drawn until every token's margin clears
# TIE_MARGIN: ~1000x fp32 rounding of a logit of size 1 (ours and transformers' router logits differ by ~1e-6).
TIE_MARGIN = 1e-4


def routing_margin(model, routings, attention_mask=None) -> float:
    """The smallest selection margin in `routings` (a forward's output list of `model`, a MoE model): over
    every real token (`attention_mask` [B, T]: a padded token's choice reaches no real one, and the recurrent
    mixers zero its state, so that its scores tie exactly) and MoE layer, the K-th minus the (K+1)-th score
    the family selects by (the logits where the order is theirs; the scores plus DeepSeek-V3's correction
    bias otherwise), and for group-limited selection also the kept groups' last rank minus the next group's."""
    from minimoe.core.routing_methods.routing import moe_blocks
    blocks, gaps = moe_blocks(model), []
    for i, r in enumerate(routings):
        if r is None:
            continue
        real = slice(None) if attention_mask is None else attention_mask.reshape(-1).bool()
        r = replace(r, logits=r.logits[real])
        scoring, correction = blocks[i].router.scoring, getattr(blocks[i].gate, "e_score_correction_bias", None)
        s = r.logits.detach().float()  # [T, E]; softmax and sigmoid keep the logits' order
        if correction is not None or scoring.method != "greedy":
            s = scoring.scores(s) + (0 if correction is None else correction.detach().float())
        if scoring.method != "greedy":
            T, E = s.shape
            grouped = s.view(T, scoring.n_group, E // scoring.n_group)
            rank = grouped.max(-1).values if scoring.method == "group_limited_greedy" else grouped.topk(2, -1).values.sum(-1)
            top = rank.topk(min(scoring.topk_group + 1, scoring.n_group), -1).values
            if top.shape[-1] > scoring.topk_group:
                gaps.append((top[:, scoring.topk_group - 1] - top[:, scoring.topk_group]).min())
            kept = torch.zeros_like(rank, dtype=torch.bool).scatter_(1, rank.topk(scoring.topk_group, -1).indices, True)
            s = s.masked_fill(~kept.repeat_interleave(E // scoring.n_group, dim=1), float("-inf"))
        top = s.topk(scoring.top_k + 1, dim=-1).values  # [T, K+1]
        gaps.append((top[:, -2] - top[:, -1]).min())
    return min(g.item() for g in gaps)


def indexer_margin(model, ids, mask) -> float:
    """As `routing_margin`, for DeepSeek Sparse Attention's top-k keys (core/token_mixers/dsa_indexer.py): the
    smallest gap, relative to the query's largest score, between the k-th and the (k+1)-th key that an indexer of
    `model` keeps for a real query with more than k keys to choose from, padded (`mask`) or not; inf without DSA."""
    from minimoe.core.token_mixers.dsa_indexer import LightningIndexer
    margins = [float("inf")]
    for m in (mask, None) if any(isinstance(i, LightningIndexer) for i in model.modules()) else ():
        calls = []
        hooks = [idx.register_forward_hook(lambda mod, args, out: calls.append((mod, args)))
                 for idx in model.modules() if isinstance(idx, LightningIndexer)]
        with torch.no_grad():
            model(ids, attention_mask=m)
            for mod, (x, q_latent, cos, sin, allowed, *_) in calls:
                s = mod.scores(x, q_latent, cos, sin, None, 0).masked_fill(~allowed[:, 0], float("-inf"))
                top = s.topk(min(mod.topk + 1, s.shape[-1]), dim=-1).values  # [B, T, k+1]
                chooses = torch.isfinite(top[..., -1]) & (m.bool() if m is not None else True)  # > k keys allowed
                if top.shape[-1] > mod.topk and chooses.any():
                    margins.append(((top[..., -2] - top[..., -1]) / top[..., 0].abs())[chooses].min().item())
        for h in hooks:
            h.remove()
    return min(margins)


def tie_free(draw, margin_of, tries: int = 200):
    """The first of draw(0), draw(1), ... whose margin_of(drawn) clears TIE_MARGIN (`routing_margin`)."""
    for seed in range(tries):
        drawn = draw(seed)
        if margin_of(drawn) >= TIE_MARGIN:
            return drawn
    raise AssertionError(f"no draw of {tries} clears a routing margin of {TIE_MARGIN}: the model routes on ties")


# Families beyond the paper's two (the `family` fixture's params; heavy suites run on the paper's two only).
NEW_FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "granitemoeshared", "flex_olmo"]
# Families whose router is not a softmax top-K (V3-style sigmoid with groups; top-1 sigmoid scaling the input; Gemma 4's
# on its own norm, with a gain per expert): as DeepSeek's, their parity suite is tests/core/decoder/test_families_parity.py;
# the `family` tests that read no router's numerics (padding, packing, loading) name them too.
OTHER_ROUTERS = ["glm4_moe", "llama4_text", "gemma4_text"]


@pytest.fixture(autouse=True)
def no_default_model_download(monkeypatch):
    """A test that runs train.py without --model would fetch SmolLM2 from the registry: fail it instead."""
    from minimoe.cli import train

    def refuse():
        raise AssertionError("a test asked for the default model (a download); pass --model tiny")
    monkeypatch.setattr(train, "smollm_checkpoint", refuse)


def transformers_major() -> int | None:
    """The installed transformers' major version; None where the oracle is not installed."""
    try:
        from importlib.metadata import version
        return int(version("transformers").split(".")[0])
    except Exception:  # PackageNotFoundError, or a version string we cannot read: no oracle
        return None


# The families whose model_type transformers 4.57 lacks: their oracle tests are marked tf5 (transformers 5.23), as
# each record says (Family.since_transformers).
TRANSFORMERS_5_ONLY = {name for name, record in FAMILIES.items() if record.since_transformers == 5}


def by_oracle(cases, model_type=lambda case: case) -> list:
    """`cases` as pytest params, those of a transformers-5-only family marked tf5 (.ci/run's third environment)."""
    return [pytest.param(c, marks=pytest.mark.tf5) if model_type(c) in TRANSFORMERS_5_ONLY else c for c in cases]


@pytest.fixture(autouse=True)
def tf5_only_under_transformers_5(request):
    """A `tf5` test holds minimoe to transformers 5.x (.ci/run's third environment, the test5 extra); where the
    installed transformers is 4.x (the test extra) or none, it skips. No other test runs under transformers 5."""
    if request.node.get_closest_marker("tf5") and transformers_major() != 5:
        pytest.skip("a transformers 5 oracle test: runs in the test5 environment (docs/install.md)")


# MINIMOE_CUDA_TESTS_DEVICE=cpu runs the `cuda` tests' logic on the CPU (tests/test_cuda.py reads it too).
CUDA_TESTS_DEVICE = "MINIMOE_CUDA_TESTS_DEVICE"


@pytest.fixture(autouse=True)
def cpu_unless_marked_cuda(request, monkeypatch):
    """The suite's expectations (float32 by default, bit-identical runs) are the CPU's, so on a machine
    with CUDA a test not marked `cuda` sees none: in this process (`--device auto` picks the CPU) and in
    the train.py, torchrun and sweep processes it starts (CUDA_VISIBLE_DEVICES). A `cuda` test
    (tests/test_cuda.py) runs only where CUDA is present, and is skipped elsewhere.

    MINIMOE_CUDA_TESTS_DEVICE=cpu runs these tests' logic on the CPU, as a check of the tests themselves:
    a `cuda` test then runs instead of being skipped (on a GPU machine too), and sees no CUDA, as every
    other test."""
    if request.node.get_closest_marker("cuda") and os.environ.get(CUDA_TESTS_DEVICE, "cuda") != "cpu":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
        return
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from nothing: dynamo's caches are per code object, shared by every test of the session, and
    the families' layers compiled one test after another exceed its recompile limit (8) for DecoderLayer.forward."""
    yield
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()


@pytest.fixture(autouse=True)
def auto_dtype_is_float32(monkeypatch):
    """$MINIMOE_CPU_DTYPE=float32, so that --dtype auto means float32 (not bf16, as on a native-bf16 CPU)
    in this process and in the train.py, torchrun and sweep processes a test starts (they inherit the variable),
    whatever the developer's shell sets; tests of the bf16 path ask for bfloat16 by name."""
    import minimoe.runs.device
    monkeypatch.setenv(minimoe.runs.device.CPU_DTYPE_VARIABLE, "float32")


def spy_grouped_mm(monkeypatch) -> list:
    """Wrap F.grouped_mm so that every call appends to the returned list (cleared by the caller)."""
    import torch.nn.functional as F
    calls, real = [], F.grouped_mm
    monkeypatch.setattr(F, "grouped_mm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


@pytest.fixture(params=["granitemoe", "olmoe", *NEW_FAMILIES])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The sweep and reliability tests' data: a small manifest folder (train 8, val 4, test 4) from the offline ARC-Challenge copy."""
    folder = tmp_path_factory.mktemp("data") / "arc"
    folder.mkdir()
    examples = load_examples("arc_challenge")
    for split, part in (("train", examples[:8]), ("val", examples[8:12]), ("test", examples[12:16])):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(asdict(e)) + "\n" for e in part))
    return folder
