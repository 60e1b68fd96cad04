"""Tiny random models of both families, shared by the tests; `oracle`, the reference packages.

Dimensions are multiples of 8 so that the grouped_mm path applies in fp32 and bf16; weights are
scaled up from the default init (std 0.2) so that numerical differences show in the logits.
"""
import importlib
import json
import os
from dataclasses import asdict

import pytest
import torch

from minimoe.core.model import MoEConfig, MoEForCausalLM, init_weights
from minimoe.data.benchmarks import load_examples

# The reference packages the test extra installs (setup.cfg [test]); minimoe never imports them at run time.
ORACLES = ("transformers", "peft", "lm_eval", "wandb", "tensorboard", "datasets", "submitit")


class MissingOracle:
    """An oracle that is not installed: the first use of it skips the test that uses it."""

    def __init__(self, name: str):
        self.name = name

    def __getattr__(self, attr):
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


FAMILY_SWITCHES = {
    # Granite: every multiplier away from 1, tied head, GQA.
    "granitemoe": dict(tie_word_embeddings=True, embedding_multiplier=12.0, residual_multiplier=0.22,
                       logits_scaling=6.0, attention_multiplier=0.1, pad_token_id=0, eos_token_id=0),
    # OLMoE: q/k norms (always), clip_qkv low enough to bite, renormalised top-K, GQA.
    "olmoe": dict(clip_qkv=0.5, norm_topk_prob=True, pad_token_id=1, eos_token_id=2),
    # Qwen3-MoE: per-head q/k norms (always), head_dim apart from hidden/heads, biases, a dense layer between
    # MoE layers, renormalised top-K, a sliding window short enough to bite.
    "qwen3_moe": dict(head_dim=24, attention_bias=True, num_hidden_layers=3, mlp_only_layers=[1],
                      dense_intermediate_size=48, norm_topk_prob=True, use_sliding_window=True, sliding_window=5,
                      pad_token_id=0, eos_token_id=1),
    # Qwen2-MoE: a gated shared expert, q/k/v biases, top-K not renormalised (decoder_sparse_step: test_model).
    "qwen2_moe": dict(qkv_bias=True, shared_expert_intermediate_size=40, norm_topk_prob=False, pad_token_id=0,
                      eos_token_id=1),
    # Mixtral: per-expert w1/w2/w3, renormalised top-2 (always), a sliding window.
    "mixtral": dict(sliding_window=6, head_dim=12, pad_token_id=0, eos_token_id=1),
    # gpt-oss: sinks, biases and top-K on logits (fixed by the family), a sliding layer then a full one,
    # YaRN, the clamped experts.
    "gpt_oss": dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"], swiglu_limit=7.0,
                    rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                  "truncate": False, "original_max_position_embeddings": 16},
                    max_position_embeddings=64, pad_token_id=0, eos_token_id=1),
    # DeepSeek: MLA (low-rank q, rope and no-rope parts, v narrower), a dense first layer, shared experts,
    # group-limited top-K scaled (V2); sigmoid scores, correction bias, noaux_tc, renormalised (V3).
    "deepseek_v2": dict(kv_lora_rank=24, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                        num_key_value_heads=4, num_hidden_layers=3, first_k_dense_replace=1, dense_intermediate_size=96,
                        n_shared_experts=2, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                        routed_scaling_factor=2.0, pad_token_id=0, eos_token_id=1),
    "deepseek_v3": dict(kv_lora_rank=24, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                        num_key_value_heads=4, num_hidden_layers=3, first_k_dense_replace=1, dense_intermediate_size=96,
                        n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                        pad_token_id=0, eos_token_id=1),
    # The hybrids (their parity: tests/core/test_families_parity.py): a Mamba-2 layer and a NoPE attention
    # layer, a fused shared expert (Granite 4.0-H); a Gated DeltaNet layer and a gated attention layer with
    # partial rotary and zero-centred norms, a gated shared expert (Qwen3-Next).
    "granitemoehybrid": dict(mixer_types=["mamba2", "attention"], shared_expert_intermediate_size=40,
                             position_embedding_type="nope", mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16,
                             mamba_chunk_size=8, embedding_multiplier=12.0, residual_multiplier=0.22,
                             logits_scaling=6.0, attention_multiplier=0.1, pad_token_id=0, eos_token_id=1),
    "qwen3_next": dict(mixer_types=["gated_deltanet", "attention"], head_dim=16, partial_rotary_factor=0.25,
                       shared_expert_intermediate_size=40, norm_topk_prob=True, linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                       pad_token_id=0, eos_token_id=1),
    # Granite with a shared expert (fused gate and up rows), every multiplier away from 1.
    "granitemoeshared": dict(tie_word_embeddings=True, embedding_multiplier=12.0, residual_multiplier=0.22,
                             logits_scaling=6.0, attention_multiplier=0.1, shared_expert_intermediate_size=40,
                             pad_token_id=0, eos_token_id=0),
    # FlexOlmo: norms after each branch (in fp32 with their weight), q/k norms over the projection width.
    "flex_olmo": dict(norm_topk_prob=True, pad_token_id=1, eos_token_id=2),
    # GLM-4.5: partial rotary, per-head q/k norms, q/k/v biases, V3's router with groups, a dense first layer.
    "glm4_moe": dict(head_dim=24, partial_rotary_factor=0.5, use_qk_norm=True, qkv_bias=True, num_hidden_layers=3,
                     first_k_dense_replace=1, dense_intermediate_size=96, n_shared_experts=1, n_group=4, topk_group=2,
                     routed_scaling_factor=2.5, norm_topk_prob=True, pad_token_id=0, eos_token_id=1),
    # Llama 4: top-1 sigmoid scaling the input, a shared expert, a dense layer first, a NoPE layer with temperature
    # tuning that bites, chunked attention on the rope layers, L2 q/k norm, interleaved rope pairs.
    "llama4_text": dict(num_hidden_layers=3, num_experts_per_tok=1, head_dim=16, decoder_sparse_step=2,
                        dense_intermediate_size=48, no_rope_layers=[1, 0, 1], attention_chunk_size=4,
                        attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5, pad_token_id=0, eos_token_id=1),
}
# Families beyond the paper's two (the `family` fixture's params; heavy suites run on the paper's two only).
NEW_FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "granitemoeshared", "flex_olmo"]
# Families whose router is not a softmax top-K (V3-style sigmoid with groups; top-1 sigmoid scaling the input): as
# DeepSeek's, their parity suite is tests/core/test_families_parity.py; the `family` tests that read no router's
# numerics (padding, packing, loading) name them too.
OTHER_ROUTERS = ["glm4_moe", "llama4_text"]


def tiny_config(family: str, **overrides) -> MoEConfig:
    kw = dict(model_type=family, vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
              rms_norm_eps=1e-6, rope_theta=10000.0)
    kw.update(FAMILY_SWITCHES[family])
    kw.update(overrides)
    return MoEConfig(**kw)


def tiny_model(family: str, seed: int = 0, std: float = 0.2, **overrides) -> MoEForCausalLM:
    g = torch.Generator().manual_seed(seed)
    model = init_weights(MoEForCausalLM(tiny_config(family, **overrides)), std=std, generator=g)
    with torch.no_grad():  # norm weights away from 1, so a misplaced norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


@pytest.fixture(autouse=True)
def no_default_model_download(monkeypatch):
    """A test that runs train.py without --model would fetch SmolLM2 from the registry: fail it instead."""
    from minimoe.cli import train

    def refuse():
        raise AssertionError("a test asked for the default model (a download); pass --model tiny")
    monkeypatch.setattr(train, "smollm_checkpoint", refuse)


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
