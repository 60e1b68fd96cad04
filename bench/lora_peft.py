"""The LoRA step of both sides, each in its own child process so that its peak memory is its own.

minimoe: `add_lora(model, rank=8, alpha=8, dropout=0.05, targets=("q", "k", "v", "experts"))`.
transformers + peft, same adapters: q/k/v by `target_modules`; experts by `target_modules` where they
are modules (OLMoE's per-expert gate_proj/up_proj/down_proj) and by `target_parameters` where they
are 3-D parameters (Granite's input_linear.weight/output_linear.weight). peft adapters are fp32 by
default (`autocast_adapter_dtype`), as are minimoe's.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common  # noqa: E402

RANK, ALPHA = 8, 8
# peft's target_parameters (Granite's 3-D expert weights) refuses lora_dropout != 0, so Granite runs
# with dropout 0 on both sides; OLMoE with the requested 0.05 on both.
DROPOUT = {"olmoe": 0.05, "granitemoe": 0.0, "qwen3_moe": 0.0, "deepseek_v3": 0.0, "granitemoehybrid": 0.0,
           "qwen3_next": 0.0, "qwen3_5_moe": 0.0, "deepseek_v32": 0.0, "gemma4_text": 0.0}
# Today's families in transformers 4.57 hold per-expert modules: q/k/v (MLA's q_proj or q_b_proj, and kv_b_proj
# for k and v, as core/adaptation/lora.py adapts them) and the routed experts only (not the shared experts, not the dense
# layers' MLP, whose names are the same), as one regex peft matches against the full module name.
PEFT_TARGETS = {
    "qwen3_moe": r".*\.(self_attn\.(q|k|v)_proj|mlp\.experts\.\d+\.(gate|up|down)_proj)",
    "deepseek_v3": r".*\.(self_attn\.(q_proj|q_b_proj|kv_b_proj)|mlp\.experts\.\d+\.(gate|up|down)_proj)",
    "qwen3_next": r".*\.(self_attn\.(q|k|v)_proj|mlp\.experts\.\d+\.(gate|up|down)_proj)",  # not linear_attn's
}


# The 2026 families in transformers 5 hold their routed experts fused, as parameters: peft adapts those
# (target_parameters), beside the attention projections ours adapts (MLA's q_b_proj and kv_b_proj).
FUSED_TARGETS = {"qwen3_5_moe": (["q_proj", "k_proj", "v_proj"], "mlp.experts"),
                 "deepseek_v32": (["q_b_proj", "kv_b_proj"], "mlp.experts"),
                 "gemma4_text": (["q_proj", "k_proj", "v_proj"], "experts")}


def peft_wrap(hf_model, family: str):
    from peft import LoraConfig, get_peft_model
    qkv = ["q_proj", "k_proj", "v_proj"]
    if family in FUSED_TARGETS:
        modules, experts = FUSED_TARGETS[family]
        cfg = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=DROPOUT[family], target_modules=modules,
                         target_parameters=[f"{experts}.gate_up_proj", f"{experts}.down_proj"])
    elif family in PEFT_TARGETS:
        cfg = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=DROPOUT[family], target_modules=PEFT_TARGETS[family])
    elif family == "olmoe":
        cfg = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=DROPOUT[family],
                         target_modules=qkv + ["gate_proj", "up_proj", "down_proj"])
    else:
        cfg = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=DROPOUT[family], target_modules=qkv,
                         target_parameters=["block_sparse_moe.input_linear.weight",
                                            "block_sparse_moe.output_linear.weight"])
    return get_peft_model(hf_model, cfg)


def child(side: str, folder: str, dtype_name: str, B: int, T: int, rounds: int, warmup: int) -> dict:
    import torch
    import torch.nn.functional as F
    from bench.load import RSSSampler
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    family = json.loads((Path(folder) / "config.json").read_text())["model_type"]
    if side == "minimoe":
        from minimoe.core.adaptation.lora import add_lora
        model = common.load_ours(Path(folder), dtype)
        add_lora(model, rank=RANK, alpha=ALPHA, dropout=DROPOUT[family], targets=("q", "k", "v", "experts"))
        kw = {}
    else:
        model = peft_wrap(common.load_hf(Path(folder), dtype, "eager"), family)
        kw = {"use_cache": False}
    model.train()
    ids = torch.randint(2, 40000, (B, T), generator=torch.Generator().manual_seed(5))

    def step():
        logits = model(input_ids=ids, **kw).logits
        F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
        model.zero_grad(set_to_none=False)  # keep the adapter grads allocated, as a training loop would

    with torch.no_grad():  # touch every weight once, so lazily mapped weights count as loaded on both sides
        for p in model.parameters():
            p.max()
    times = []
    with RSSSampler() as s:  # weights loaded and touched: from here on only steps allocate
        before = s.peak
        for _ in range(warmup):  # allocates the adapter grads, and the heap stops growing
            step()
        for _ in range(rounds):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    return {"times": times, "peak_bytes": s.peak - before, "rss_before": before,
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}


def measure_in_child(side, folder, dtype_name, B, T, rounds, warmup, keep: bool) -> dict:
    """keep: the child calls process_memory.keep_freed_memory() first, as train.py does."""
    cmd = [sys.executable, __file__, side, str(folder), dtype_name, str(B), str(T), str(rounds), str(warmup),
           str(int(keep))]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"LoRA child {side} failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    side, folder, dtype_name, B, T, rounds, warmup, keep = sys.argv[1:]
    if keep == "1":
        from minimoe.process_memory import keep_freed_memory
        keep_freed_memory()
    print(json.dumps(child(side, folder, dtype_name, int(B), int(T), int(rounds), int(warmup))))
