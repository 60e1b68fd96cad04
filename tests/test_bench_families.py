"""bench/gpu.py's rows for today's families: the qwen3 and deepseek3 stages at tiny widths on the CPU (the
script itself), and the real widths they time on a GPU against the published parameter counts."""
import pytest
import torch

from bench import common, gpu
from bench.gpu_common import active_params, config, random_model
from bench.gpu_lora import CPU_CUTS, CPU_VOCAB, adopt_equal, cpu_config
from tests.conftest import transformers_major
from minimoe.core.decoder.model import MoEForCausalLM


@pytest.mark.parametrize("stages, models", [
    ("qwen3,deepseek3", ("qwen3_moe 2L", "deepseek_v3 2L")),
    ("granite4h,qwen3next", ("granitemoehybrid 2L", "qwen3_next 2L")),  # the hybrids
])
def test_todays_family_stages_time_both_sides_in_smoke_mode(stages, models, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    rows = gpu.main(["--smoke", "--device", "cpu", "--only", stages, "--out", "families"])
    assert not [r for r in rows if r["metric"].endswith(("failed", "skipped"))], rows
    steps = {(r["model"], r["metric"].split(":")[0]) for r in rows if r["section"] == "lora"}
    assert steps == {(m, side) for m in models for side in ("minimoe", "transformers + peft")}
    assert not set(stages.split(",")) & set(gpu.DEFAULT_STAGES)  # run only when named


@pytest.mark.parametrize("family, real, smoke", [
    # granite-4.0-h-tiny's first 8 layers: Mamba-2 but the sixth, NoPE attention
    ("granitemoehybrid", ["mamba2"] * 5 + ["attention"] + ["mamba2"] * 2, ["mamba2", "attention"]),
    # Qwen3-Next's: every 4th full attention, the rest Gated DeltaNet
    ("qwen3_next", (["gated_deltanet"] * 3 + ["attention"]) * 2, ["gated_deltanet", "attention"]),
])
def test_the_hybrid_stages_time_both_mixers(family, real, smoke):
    """8 real-width layers hold both of the hybrid's mixers, and so do the smoke mode's 2 layers."""
    assert config(family, 8, smoke=False).mixer_types == real
    assert config(family, 2, smoke=True).mixer_types == smoke


def test_qwen3_next_widths_are_transformers_config_defaults():
    """The qwen3next stage's widths are Qwen3NextConfig's defaults (Qwen3-Next-80B-A3B's, its docstring says)."""
    transformers = pytest.importorskip("transformers")
    theirs = transformers.Qwen3NextConfig()
    ours = common.OFFICIAL_NEW["qwen3_next"]
    assert {k: getattr(theirs, k) for k in ours if k != "eos_token_id"} == {k: v for k, v in ours.items() if k != "eos_token_id"}


@pytest.mark.parametrize("family, layers, total, active", [
    ("qwen3_moe", 48, 30.5, 3.3),    # Qwen3-30B-A3B's model card: 30.5B in total, 3.3B activated
    ("deepseek_v3", 27, 16.0, 3.0),  # Moonlight-16B-A3B's: 16B in total, 3B activated
])
def test_the_real_widths_give_the_published_parameter_counts(family, layers, total, active):
    c = config(family, layers, smoke=False)
    with torch.device("meta"):
        n = sum(p.numel() for p in MoEForCausalLM(c).parameters())
    assert round(n / 1e9, 1) == total
    # the cards' activated count: the active parameters and the embedding (3.35B and 2.92B here)
    assert (active_params(c) + c.vocab_size * c.hidden_size) / 1e9 == pytest.approx(active, abs=0.1)
    assert config(family, 8, smoke=False).num_hidden_layers == 8


@pytest.mark.parametrize("family, layers, billions", [
    ("granitemoehybrid", 40, 7),  # granite-4.0-h-tiny's model card: 7B in total
    ("qwen3_next", 48, 80),       # Qwen3-Next-80B-A3B's: 80B in total
])
def test_the_hybrids_real_widths_give_the_published_totals(family, layers, billions):
    """Only the totals: the cards round the activated count (1B, 3B) and do not say what it counts."""
    with torch.device("meta"):
        n = sum(p.numel() for p in MoEForCausalLM(config(family, layers, smoke=False)).parameters())
    assert round(n / 1e9) == billions


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "granitemoehybrid", "qwen3_next"])
def test_peft_adapts_what_minimoe_adapts(family, tmp_path):
    """The two sides time the same LoRA: as many trainable parameters (not the shared experts, not the dense
    layer, whose module names peft would otherwise also match)."""
    pytest.importorskip("peft")
    from bench.lora_peft import peft_wrap
    from minimoe.core.adaptation.lora import add_lora
    from minimoe.loading.checkpoint import from_pretrained, save_pretrained
    save_pretrained(random_model(config(family, 2, smoke=True), torch.device("cpu")), tmp_path)
    theirs = peft_wrap(common.load_hf(tmp_path, torch.float32), family)
    ours = from_pretrained(tmp_path)
    add_lora(ours, rank=8, alpha=8, dropout=0.0, targets=("q", "k", "v", "experts"))
    trainable = lambda model: sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable(theirs) == trainable(ours) > 0


STAGES_2026 = {"qwen35": "qwen3_5_moe 2L", "deepseek32": "deepseek_v32 4L", "gemma4": "gemma4_text 2L"}


def run_2026_stages(tmp_path, monkeypatch) -> list[dict]:
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    rows = gpu.main(["--smoke", "--device", "cpu", "--only", ",".join(STAGES_2026), "--out", "families2026"])
    assert not [r for r in rows if r["metric"].endswith("failed")], rows
    return rows


def test_the_2026_family_stages_time_minimoe_and_say_why_not_transformers_4(tmp_path, monkeypatch):
    """Qwen3.5-MoE, DeepSeek-V3.2 and Gemma 4 at the stages' tiny widths (DeepSeek-V3.2's 4 layers: its 3 dense and
    one MoE): ours timed; where transformers 4.57 is the oracle installed, the reference side is a skipped row that
    names what it needs, never a failure."""
    if transformers_major() == 5:
        pytest.skip("transformers 5 holds these families: the tf5 case below times both sides")
    rows = run_2026_stages(tmp_path, monkeypatch)
    steps = {(r["model"], r["metric"].split(":")[0]) for r in rows if r["section"] == "lora" and "step s" in r["metric"]}
    assert steps == {(model, "minimoe") for model in STAGES_2026.values()}
    skipped = [r for r in rows if r["metric"] == "transformers + peft: skipped"]
    assert len(skipped) == 3 and all("transformers 5" in r["note"] for r in skipped)
    assert not set(STAGES_2026) & set(gpu.DEFAULT_STAGES)  # run only when named


@pytest.mark.tf5
def test_the_2026_family_stages_time_both_sides_under_transformers_5(tmp_path, monkeypatch):
    """The same stages with transformers 5.23 and peft (the test5 extra): transformers + peft's LoRA on the same
    projections and on the fused experts' parameters, timed beside ours."""
    pytest.importorskip("peft")
    rows = run_2026_stages(tmp_path, monkeypatch)
    steps = {(r["model"], r["metric"].split(":")[0]) for r in rows if r["section"] == "lora" and "step s" in r["metric"]}
    assert steps == {(m, side) for m in STAGES_2026.values() for side in ("minimoe", "transformers + peft")}
    ours = [r for r in rows if r["section"] == "lora" and r["metric"].startswith("minimoe: step s")]
    assert len(ours) == 3 and all("interleaved" in r["note"] for r in ours), ours  # the CPU's path: one process


@pytest.mark.parametrize("family", sorted(CPU_CUTS))
def test_the_cpu_rows_keep_the_published_widths(family):
    """The 2026 stages' CPU widths: hidden, expert and attention widths and top-k as published; each attention kind
    once (Qwen3.5's DeltaNet and gated attention, Gemma 4's sliding and global layers), fewer experts, no dense
    layer (DeepSeek-V3.2's one layer is its MoE)."""
    cut, full = cpu_config(family), config(family, 8, smoke=False)
    same = ("hidden_size", "intermediate_size", "num_experts_per_tok", "num_attention_heads", "head_dim")
    assert {k: getattr(cut, k) for k in same} == {k: getattr(full, k) for k in same}
    assert cut.num_experts < full.num_experts and cut.vocab_size == CPU_VOCAB and cut.num_hidden_layers <= 2
    kinds = lambda c: set(c.mixer_types or c.flat().get("layer_types") or ["one"])  # noqa: E731
    assert kinds(cut) == kinds(full) and cut.flat()["mlp_only_layers"] == []


def test_adopt_equal_shares_the_storage_of_equal_frozen_weights_only():
    """The CPU rows hold both sides at once: transformers' side adopts minimoe's equal frozen weights (one copy in
    memory), never a weight whose values differ, nor a trained one."""
    torch.manual_seed(0)
    donor, model = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    donor.requires_grad_(False)
    model.weight.data.copy_(donor.weight)
    assert adopt_equal(model, donor) == 64  # the weight, not the bias (different values)
    assert model.weight.data_ptr() == donor.weight.data_ptr() and model.bias.data_ptr() != donor.bias.data_ptr()
    donor.bias.requires_grad_(True)
    model.bias.data.copy_(donor.bias)
    assert adopt_equal(model, donor) == 64  # a trained bias is not shared
