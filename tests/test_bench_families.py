"""bench/gpu.py's rows for today's families: the qwen3 and deepseek3 stages at tiny widths on the CPU (the
script itself), and the real widths they time on a GPU against the published parameter counts."""
import pytest
import torch

from bench import common, gpu
from minimoe.core.model import MoEForCausalLM


def test_qwen3_and_deepseek3_stages_time_both_sides_in_smoke_mode(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    rows = gpu.main(["--smoke", "--device", "cpu", "--only", "qwen3,deepseek3", "--out", "families"])
    assert not [r for r in rows if r["metric"].endswith(("failed", "skipped"))], rows
    steps = {(r["model"], r["metric"].split(":")[0]) for r in rows if r["section"] == "lora"}
    assert steps == {(m, side) for m in ("qwen3_moe 2L", "deepseek_v3 2L") for side in ("minimoe", "transformers + peft")}


@pytest.mark.parametrize("family, layers, total, active", [
    ("qwen3_moe", 48, 30.5, 3.3),    # Qwen3-30B-A3B's model card: 30.5B in total, 3.3B activated
    ("deepseek_v3", 27, 16.0, 3.0),  # Moonlight-16B-A3B's: 16B in total, 3B activated
])
def test_the_real_widths_give_the_published_parameter_counts(family, layers, total, active):
    c = gpu.config(family, layers, smoke=False)
    with torch.device("meta"):
        n = sum(p.numel() for p in MoEForCausalLM(c).parameters())
    assert round(n / 1e9, 1) == total
    # the cards' activated count: the active parameters and the embedding (3.35B and 2.92B here)
    assert (gpu.active_params(c) + c.vocab_size * c.hidden_size) / 1e9 == pytest.approx(active, abs=0.1)
    assert gpu.config(family, 8, smoke=False).num_hidden_layers == 8


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_peft_adapts_what_minimoe_adapts(family, tmp_path):
    """The two sides time the same LoRA: as many trainable parameters (not the shared experts, not the dense
    layer, whose module names peft would otherwise also match)."""
    pytest.importorskip("peft")
    from bench.lora_peft import peft_wrap
    from minimoe.core.lora import add_lora
    from minimoe.loading.checkpoint import from_pretrained, save_pretrained
    save_pretrained(gpu.random_model(gpu.config(family, 2, smoke=True), torch.device("cpu")), tmp_path)
    theirs = peft_wrap(common.load_hf(tmp_path, torch.float32), family)
    ours = from_pretrained(tmp_path)
    add_lora(ours, rank=8, alpha=8, dropout=0.0, targets=("q", "k", "v", "experts"))
    trainable = lambda model: sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable(theirs) == trainable(ours) > 0
