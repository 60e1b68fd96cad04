"""Shared pieces of the benchmark: model shapes, identical-weight model pairs, paired timing, tables.

The machine is shared and noisy (other jobs run on the same 2 cores), so every comparison is timed
*interleaved*: round r runs each candidate once, in an order that rotates between rounds, and the
ratio is taken per round before the median. A slow spell then hits both sides of a ratio alike.
"""
from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minimoe.core.decoder.model import MoEConfig, MoEForCausalLM, init_weights
from minimoe.loading.checkpoint import from_pretrained, save_pretrained

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"  # git-ignored
CHECKPOINTS = BENCH / "checkpoints"  # git-ignored: random checkpoints, tens of GB

# The official shapes (the config.json of ibm-granite/granite-3.1-3b-a800m-base and allenai/OLMoE-1B-7B-0924);
# `shape(family, layers)` cuts the depth only.
OFFICIAL = {
    "olmoe": dict(model_type="olmoe", vocab_size=50304, hidden_size=2048, intermediate_size=1024,
                  num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16, num_experts=64,
                  num_experts_per_tok=8, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=4096,
                  tie_word_embeddings=False, norm_topk_prob=False, pad_token_id=1, eos_token_id=50279),
    "granitemoe": dict(model_type="granitemoe", vocab_size=49152, hidden_size=1536, intermediate_size=512,
                       num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8, num_experts=40,
                       num_experts_per_tok=8, rms_norm_eps=1e-6, rope_theta=1e7, max_position_embeddings=131072,
                       tie_word_embeddings=True, embedding_multiplier=12.0, attention_multiplier=0.015625,
                       residual_multiplier=0.22, logits_scaling=6.0, pad_token_id=0, bos_token_id=0, eos_token_id=0),
}
# Today's families at their published widths, as config.json writes them (read through the family's record);
# docs/families.md cites them and says which were verified. Timing only: random weights.
OFFICIAL_NEW = {
    # Qwen/Qwen3-30B-A3B: 48 layers, 128 experts of width 768, top-8 renormalised, head_dim 128 apart from hidden/heads.
    "qwen3_moe": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                      moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                      head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, rms_norm_eps=1e-6,
                      rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=False, pad_token_id=None,
                      eos_token_id=151645),
    # moonshotai/Moonlight-16B-A3B (DeepSeek-V3's architecture): MLA without a q low rank, 64 routed experts + 2
    # shared of width 1408, top-6 by sigmoid scores with the correction bias, one dense first layer.
    "deepseek_v3": dict(model_type="deepseek_v3", vocab_size=163840, hidden_size=2048, intermediate_size=11264,
                        moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
                        num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2,
                        num_experts_per_tok=6, first_k_dense_replace=1, n_group=1, topk_group=1,
                        routed_scaling_factor=2.446, norm_topk_prob=True, rms_norm_eps=1e-5, rope_theta=50000.0,
                        max_position_embeddings=8192, tie_word_embeddings=False, pad_token_id=None,
                        eos_token_id=163585),
    # ibm-granite/granite-4.0-h-tiny's config.json (transformers' GraniteMoeHybridConfig defaults are not a released
    # model's): 40 layers, 4 of them NoPE attention (5, 15, 25, 35), the rest Mamba-2 (48 heads of 64, state 128, one
    # group); 64 experts of width 512, top-6, a shared expert of 1024; tied embeddings.
    "granitemoehybrid": dict(model_type="granitemoehybrid", vocab_size=100352, hidden_size=1536, intermediate_size=512,
                             shared_intermediate_size=1024, num_hidden_layers=40, num_attention_heads=12,
                             num_key_value_heads=4, num_local_experts=64, num_experts_per_tok=6,
                             position_embedding_type="nope", mamba_n_heads=48, mamba_d_head=64, mamba_d_state=128,
                             mamba_n_groups=1, mamba_expand=2, mamba_d_conv=4, mamba_chunk_size=256,
                             layer_types=(["mamba"] * 5 + ["attention"] + ["mamba"] * 9 + ["attention"]
                                          + ["mamba"] * 9 + ["attention"] + ["mamba"] * 9 + ["attention"] + ["mamba"] * 4),
                             rms_norm_eps=1e-5, tie_word_embeddings=True, pad_token_id=None, eos_token_id=100257),
    # Qwen/Qwen3-Next-80B-A3B: transformers' Qwen3NextConfig defaults (its docstring: "similar configuration to that of
    # Qwen3-Next-80B-A3B-Instruct"): 48 layers, every 4th gated full attention (16 heads of 256, 2 kv, a quarter
    # rotary), the rest Gated DeltaNet (16 key and 32 value heads of 128); 512 experts of width 512, top-10
    # renormalised, a gated shared expert of 512. The layers' kinds come from the record's interval rule.
    "qwen3_next": dict(model_type="qwen3_next", vocab_size=151936, hidden_size=2048, intermediate_size=5632,
                       moe_intermediate_size=512, shared_expert_intermediate_size=512, num_hidden_layers=48,
                       num_attention_heads=16, num_key_value_heads=2, head_dim=256, partial_rotary_factor=0.25,
                       linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                       linear_num_key_heads=16, linear_num_value_heads=32, num_experts=512, num_experts_per_tok=10,
                       norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768,
                       tie_word_embeddings=False, pad_token_id=None, eos_token_id=151645),
    # The 2026 families (transformers 5 only; their reference side needs transformers 5.23, the test5 extra).
    # Qwen/Qwen3.5-35B-A3B's text model (its config.json's text_config): 40 layers, every 4th gated full attention
    # (16 heads of 256, 2 kv, a quarter rotary), the rest Gated DeltaNet with the projections split; 256 experts of
    # 512, top-8, a gated shared expert of 512.
    "qwen3_5_moe": dict(model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048, num_hidden_layers=40,
                        num_attention_heads=16, num_key_value_heads=2, head_dim=256, moe_intermediate_size=512,
                        shared_expert_intermediate_size=512, num_experts=256, num_experts_per_tok=8,
                        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                        linear_value_head_dim=128, linear_conv_kernel_dim=4, tie_word_embeddings=False,
                        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(40)],
                        rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                         "mrope_section": [11, 11, 10], "mrope_interleaved": True}),
    # deepseek-ai/DeepSeek-V3.2's widths (DeepseekV32Config's defaults, V3's): MLA with q LoRA 1536 and the DSA
    # indexer (64 heads of 128, top-2048 keys), 256 experts of 2048, top-8, 3 dense layers of 18432 first.
    "deepseek_v32": dict(model_type="deepseek_v32", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                         moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                         n_routed_experts=256, num_experts_per_tok=8, tie_word_embeddings=False),
    # google/gemma-4-26B-A4B's text model: 30 layers, 5 sliding (16 heads of 256, 8 kv) to 1 global (512 wide,
    # 2 kv, keys = values), 128 experts of 704, top-8, and a dense MLP of 2112 beside them in every layer.
    "gemma4_text": dict(model_type="gemma4_text", vocab_size=262144, hidden_size=2816, intermediate_size=2112,
                        moe_intermediate_size=704, num_hidden_layers=30, num_attention_heads=16, num_key_value_heads=8,
                        head_dim=256, global_head_dim=512, num_global_key_value_heads=2, attention_k_eq_v=True,
                        num_experts=128, top_k_experts=8, sliding_window=1024, final_logit_softcapping=30.0,
                        hidden_size_per_layer_input=0, enable_moe_block=True, tie_word_embeddings=True),
}


class BankCopies(TorchDispatchMode):
    """Bytes written by copying ops (cat, copy_, clone, a dtype or device copy, ...) whose output is shaped
    like one of `banks` (frozen expert banks [E, out, in]), by op name, while active; `shapes` names each
    copy counted (op and shape). A LoRA step on the GPU path should write none (tests/test_gpu_path.py;
    bench/gpu.py's `copies` stage).

    Shaped like a bank: the bank's leading dims [E], then two dims that cover the bank's last two in
    either order ([out, in], its transpose, or [W | s B]'s [out, in + k]). Matching by element count
    alone counted the logits' casts ([B, T, V] at Granite's real widths: 302 MB a step) as bank copies."""
    COPIES = {"cat", "copy_", "clone", "_to_copy", "contiguous", "index_select", "stack"}

    def __init__(self, banks):
        super().__init__()
        self.banks = {tuple(b.shape) for b in banks}  # tensors (or anything with .shape) [E, out, in]
        self.bytes, self.shapes = {}, []

    def bank_shaped(self, shape) -> bool:
        for bank in self.banks:
            lead, last = bank[:-2], sorted(bank[-2:])
            if tuple(shape[:-2]) == lead and len(shape) == len(bank) and all(
                    s >= b for s, b in zip(sorted(shape[-2:]), last)):
                return True
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        if name in self.COPIES and isinstance(out, torch.Tensor) and self.bank_shaped(out.shape):
            self.bytes[name] = self.bytes.get(name, 0) + out.numel() * out.element_size()
            self.shapes.append(f"{name} {list(out.shape)} {str(out.dtype).removeprefix('torch.')}")
        return out


class HostSyncs(TorchDispatchMode):
    """Counts the ops that make the host wait for the device, by name (`counts`), while active.

    Visible on any device, so a CPU test can hold the CUDA path to it: reading a value back
    (`_local_scalar_dense`: .item(), bool(), int()), ops whose output size depends on the data
    (nonzero, masked_select, bincount, unique, repeat_interleave by a tensor) and indexing by a
    boolean mask (it runs nonzero). Copies to the host (.cpu(), .tolist()) are syncs on CUDA too, but
    on the CPU they are no op at all; torch.cuda.set_sync_debug_mode counts those on a GPU (bench/gpu.py).
    device: count only ops on tensors of this device type ("cuda": a CPU tensor's .item(), such as
    AdamW's step counter, waits for nothing); None: every op, what a CPU test holds the code to.
    """
    SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "bincount", "_unique2", "unique_dim",
               "unique_consecutive", "repeat_interleave"}
    INDEXING = {"index", "index_put", "index_put_", "_index_put_impl_"}

    def __init__(self, device: str | None = None):
        super().__init__()
        self.device, self.counts = device, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        syncs = name in self.SYNCING and not (name == "repeat_interleave" and func._overloadname == "self_int")
        if name in self.INDEXING and len(args) > 1:
            syncs = any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])
        if syncs and self.device is not None:
            syncs = any(isinstance(a, torch.Tensor) and a.device.type == self.device for a in args)
        if syncs:
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def shape(family: str, layers: int | None = None) -> MoEConfig:
    d = dict(OFFICIAL[family])
    if layers is not None:
        d["num_hidden_layers"] = layers
    return MoEConfig(**d)


def random_checkpoint(family: str, layers: int, folder: Path | None = None, seed: int = 0) -> Path:
    """A random minimoe model of this shape saved in the official layout (bf16, so that fp32 and bf16
    loads of it hold the same values); reused when already there."""
    folder = folder or CHECKPOINTS / f"{family}-{layers}L"
    if not (folder / "config.json").is_file():
        model = MoEForCausalLM(shape(family, layers)).to(torch.bfloat16)
        init_weights(model, generator=torch.Generator().manual_seed(seed))
        save_pretrained(model, folder)
        del model
        gc.collect()
    return folder


def load_ours(folder: Path, dtype):
    return from_pretrained(folder, dtype=dtype)


def load_hf(folder: Path, dtype, attn: str = "eager"):
    import transformers
    transformers.logging.set_verbosity_error()
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn).eval()


def set_attn(hf_model, attn: str):
    """Switch a loaded transformers model between "eager" and "sdpa" without reloading its weights."""
    hf_model.set_attn_implementation(attn)
    return hf_model


# ----------------------------------------------------------------------------- timing

@dataclass
class Timing:
    times: dict  # candidate -> [seconds per round]

    def median(self, name: str) -> float:
        return statistics.median(self.times[name])

    def ratio(self, slow: str, fast: str) -> tuple[float, float, float]:
        """Per-round time(slow) / time(fast): (median, min, max). > 1 means `fast` is faster."""
        r = [a / b for a, b in zip(self.times[slow], self.times[fast])]
        return statistics.median(r), min(r), max(r)

    def best_ratio(self, slow: str, fast: str) -> float:
        """min time(slow) / min time(fast): each side at its least disturbed round."""
        return min(self.times[slow]) / min(self.times[fast])

    def spread(self, name: str) -> float:
        """(max - min) / median of one candidate's round times: how noisy the machine was."""
        t = self.times[name]
        return (max(t) - min(t)) / statistics.median(t)


def interleaved(candidates: dict, rounds: int, warmup: int = 1) -> Timing:
    """Run each callable `warmup` times, then `rounds` rounds of each once, rotating the order."""
    names = list(candidates)
    for _ in range(warmup):
        for n in names:
            candidates[n]()
    times = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            gc.collect()
            t0 = time.perf_counter()
            candidates[n]()
            times[n].append(time.perf_counter() - t0)
    return Timing(times)


# ----------------------------------------------------------------------------- results

@dataclass
class Row:
    item: str  # which benchmark (forward, train, lora, decode, moe-roofline, load, full-size)
    model: str  # olmoe-2L, granitemoe-2L, ...
    dtype: str
    metric: str  # what the two values measure, with units
    ours: float
    baseline: float | None  # transformers' figure (or the dense matmul for the roofline)
    baseline_name: str  # which baseline: "hf eager", "hf sdpa", "hf+peft", "dense matmul", ...
    ratio: float | None  # ours vs baseline, > 1 = ours better (speed) or smaller (memory)
    ratio_range: tuple | None = None  # min, max over rounds
    note: str = ""  # what bounded the figure, parity, spread
    extra: dict = field(default_factory=dict)


def fmt(x, digits=3):
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1e5 else f"{x:.3e}"
    return str(x)


def markdown(rows: list[Row]) -> str:
    head = "| item | model | dtype | metric | minimoe | baseline | baseline is | ratio (median [min-max]) | note |"
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        rng = f" [{r.ratio_range[0]:.2f}-{r.ratio_range[1]:.2f}]" if r.ratio_range else ""
        ratio = f"{r.ratio:.2f}x{rng}" if r.ratio is not None else "-"
        lines.append(f"| {r.item} | {r.model} | {r.dtype} | {r.metric} | {fmt(r.ours)} | {fmt(r.baseline)} | "
                     f"{r.baseline_name} | {ratio} | {r.note} |")
    return "\n".join(lines)


def machine() -> str:
    import transformers
    try:
        import peft
        peft_v = peft.__version__
    except ImportError:
        peft_v = "absent"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{os.cpu_count()}-core {cpu}, {mem:.0f} GiB RAM, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), transformers {transformers.__version__}, peft {peft_v}, "
            f"Python {platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M %Z')}")


def write_report(text: str, name: str) -> Path:
    """Print a benchmark's markdown and keep it as results/<name>.md."""
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.md").write_text(text + "\n")
    return RESULTS / f"{name}.md"


def save(rows: list[Row], name: str, header: str = "") -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    md = (header + "\n\n" if header else "") + markdown(rows) + "\n"
    (RESULTS / f"{name}.md").write_text(md)
    (RESULTS / f"{name}.json").write_text(json.dumps([asdict(r) for r in rows], indent=1, default=str))
    return RESULTS / f"{name}.md"
