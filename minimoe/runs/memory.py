"""What fits where: the bytes per GPU of a LoRA run, under DDP (every rank holds the whole model) or
FSDP (`--shard fsdp`, minimoe/runs/sharding.py), before any GPU is rented.

    python -m minimoe.runs.memory allenai/OLMoE-1B-7B-0924 --gpus 2 --gpu-memory 80
    python -m minimoe.runs.memory weights/tiny-olmoe --gpus 2 --gpu-memory 16 --shard fsdp --batch-size 8

For a model id, config.json and model.safetensors.index.json are read (downloaded alone, no weights);
for a folder, its safetensors headers; for a folder with config.json alone, the parameters it makes. Per GPU, in bytes:
- weights: the base in the run's dtype (from the files' tensor shapes; a hub id's index gives the total
  stored bytes only). FSDP: this rank's rows of every parameter (dim 0, ceil(n / GPUs) rows, as
  fully_shard cuts it), plus the largest decoder layer gathered whole while it runs, twice (FSDP2
  prefetches the next layer's all-gather).
- lora: LoRA, method heads and tuned gates in their dtype with their gradients: 8 bytes a parameter in fp32, 4 for
  LoRA with --lora-dtype bfloat16 (counted on a meta-device model with the run's LoRA and method, as train.py
  installs them).
- optimizer (--optim, train.py's): AdamW's two fp32 moments and its step, 8 bytes a trainable parameter;
  adamw8bit / adamw4bit (torchao.optim): each moment of a tensor of 4096 values or more (and whole blocks) in
  8 bits plus an fp32 scale per 256 values, or 4 bits plus one per 128, and the code table; smaller tensors
  keep moments in their own dtype, as torchao decides (`optimizer_bytes`, exact: a test holds it to the optimizer's state).
  FSDP divides lora by the GPUs, and the optimizer's state is the first rank's rows of each tensor (torchao
  quantises each rank's shard by its own size and blocks).
- activations: an estimate, not a measurement: per token and layer, what autograd keeps for the
  backward of one micro-batch, in the run's dtype: ~12 * hidden (norms, attention in/out, residuals)
  + top-K * 3 * expert width (each routed expert's gate, up and activation), for the rank's share of
  `batch_size * max_length` tokens; with --gradient-checkpointing, one hidden vector per layer plus
  one layer's full set. A DSA indexer (DeepSeek-V3.2, GLM-5) adds its fp32 scores, [rows, T, heads, T], one
  layer's at a time and kept for no backward (core/token_mixers/dsa_indexer.py).
- logits: the LM head's output over the vocabulary at the scored positions, at most --loss-chunk of them at a time
  (train.py's; default core/task/tokens.py's CHUNK, 1024: the chunked loss): three fp32 [positions, vocab] tensors (log-softmax and two gradients) and,
  when not chunked, the output in the run's dtype (a test holds this to a real step's peak). The positions follow
  --data: choice (the recipe's answer-choice benchmarks) scores only the candidates' tokens, --answer-tokens an
  example (default: the study's benchmarks' largest, 8 consecutive examples at a time, counted with a
  2048-token BPE; the data itself is not read); chat (chat and completion data) every position of the micro-batch.
With --quantize nf4 (train.py's, docs/quantization.md), weights are the packed matrices at their real
NF4 size (core/adaptation/quantized.py's nf4_bytes, what NF4Weight holds; --quantize mxfp4: gpt-oss's expert banks at
17 bytes per 32 values, as released; --quantize-embedding: the embedding's table in NF4 too,
core/adaptation/packed_embedding.py), everything else in the run's dtype, plus
the largest packed matrix dequantised in the run's dtype: the one module's weight alive at a time; and
dequantising: what dequantising holds beside it (the int32 codes and the lookup's result in the run's dtype of
one chunk of experts, at most 256 MiB, `dequantize_in_chunks`, nf4's and mxfp4's alike). With
--shard fsdp too: the rank's share of the packed bytes (ceil(1/N) of each module's, core/adaptation/sharded_nf4.py)
and its rows of the rest, two layers gathered (packed), and the largest packed module dequantised.
The verdict: fits when the sum is at most 90% of --gpu-memory (CUDA context and allocator slack).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from minimoe.core.layers.experts import GroupedLinear
from minimoe.core.task.tokens import CHUNK
from minimoe.core.adaptation.quantized import chunk_experts, nf4_bytes, nf4_temporary_bytes, quantized_modules
from minimoe.core.adaptation.sharded_nf4 import record_widths
from minimoe.loading.checkpoint import DTYPES, SAFETENSORS_DTYPES, WeightFile, _weight_files
from minimoe.loading.config_json import config_from_dict, read_config
from minimoe.loading.hub import hub_file
from minimoe.loading.mxfp4 import mxfp4_temporary_bytes

HEADROOM = 0.9  # of a GPU's memory: CUDA context, allocator fragmentation


@dataclass
class Estimate:
    weights: int  # bytes per GPU
    lora: int
    optimizer: int
    activations: int
    gpu_memory: int
    logits: int = 0
    dequantising: int = 0
    data: str = "choice"  # what the logits figure assumes (DATA_KINDS)

    @property
    def total(self) -> int:
        return self.weights + self.dequantising + self.lora + self.optimizer + self.activations + self.logits

    @property
    def fits(self) -> bool:
        return self.total <= HEADROOM * self.gpu_memory


def stored_weights(folder: Path, dtype: torch.dtype | None = None) -> int:
    """The checkpoint's tensor bytes, from its safetensors headers; in `dtype` when given (a bf16 run of
    an fp32 checkpoint holds half)."""
    total = 0
    for file, keys in _weight_files(folder).items():
        entries = WeightFile(folder / file).entries
        for key in entries if keys is None else keys:
            shape, stored = entries[key]["shape"], SAFETENSORS_DTYPES[entries[key]["dtype"]]
            total += math.prod(shape) * (dtype or stored).itemsize
    return total


def shard_bytes(params, gpus: int) -> int:
    """The largest rank's share of `params` (the first rank's: fully_shard gives it ceil(n / gpus) rows)."""
    return sum(math.ceil(p.shape[0] / gpus) * math.prod(p.shape[1:]) * p.element_size() if p.dim() else
               p.element_size() for p in params)


def quantized_weights(model, dtype: torch.dtype, fmt: str = "nf4", embedding: bool = False) -> int:
    """--quantize nf4: the base's bytes with its large matrices packed (module docstring), on a meta model
    without LoRA: packed sizes, the rest in `dtype`, and the largest packed matrix dequantised in `dtype`.
    embedding (--quantize-embedding): the embedding's table at NF4's size too, never dequantised whole."""
    if fmt == "mxfp4":  # gpt-oss's expert banks, as released: 16 bytes of codes and 1 scale per 32 values
        packed = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, GroupedLinear)}
        size = lambda shape: math.prod(shape) // 32 * 17  # noqa: E731
    else:
        packed = {f"{name}.weight" for name in quantized_modules(model)}
        size = lambda shape: nf4_bytes(shape, dtype)  # noqa: E731
    params = dict(model.named_parameters())
    table = {"model.embed_tokens.weight"} if embedding else set()
    dense = sum(p.numel() * dtype.itemsize for n, p in params.items() if n not in packed | table)
    return (dense + sum(size(params[n].shape) for n in packed) + sum(nf4_bytes(params[n].shape, dtype) for n in table)
            + max((params[n].numel() * dtype.itemsize for n in packed), default=0))


# torchao.optim's low-bit AdamW: (bits a value, values per fp32 scale, code-table entries); tensors under 4096
# values, or not whole blocks, keep moments in their own dtype (torchao's _AdamBase._new_buffer: zeros_like).
LOW_BIT_STATE = {"adamw8bit": (8, 256, 256), "adamw4bit": (4, 128, 16)}
LOW_BIT_MIN = 4096


def optimizer_bytes(params, optim: str, gpus: int = 1) -> int:
    """The bytes of --optim's state for `params` (the trainable tensors): two moments and a step each; `gpus` > 1
    (FSDP): the first rank's, ceil(n / gpus) rows of each tensor, which torchao quantises by that shard's size."""
    total = 0
    for p in params:
        n = p.numel() if gpus == 1 else math.ceil(p.shape[0] / gpus) * math.prod(p.shape[1:])
        bits, block, table = LOW_BIT_STATE.get(optim, (None, None, None))
        if bits is not None and n >= LOW_BIT_MIN and n % block == 0:
            moment = n * bits // 8 + n // block * 4 + table * 4
        else:  # torch's AdamW, and torchao's below its quantised sizes: zeros_like(p), the parameter's dtype
            moment = n * p.element_size()
        total += 2 * moment + 4
    return total


def dequantising_bytes(model, dtype: torch.dtype, fmt: str) -> int:
    """Beside a packed matrix's dequantised weight, what dequantising it holds at once: one chunk of its experts'
    temporaries (`dequantize_in_chunks`, core/adaptation/quantized.py), at the most of any packed module: nf4's
    int32 codes, lookup result and block scales; mxfp4's (gpt-oss's expert banks) int32 codes and decoded values."""
    modules = dict(model.named_modules())
    if fmt == "mxfp4":
        shapes = [m.weight.shape for m in modules.values() if isinstance(m, GroupedLinear)]
        return max((chunk_bytes(shape, mxfp4_temporary_bytes(shape[-2] * shape[-1], dtype)) for shape in shapes),
                   default=0)
    shapes = [modules[name].weight.shape for name in quantized_modules(model)]
    return max((chunk_bytes(shape, nf4_temporary_bytes(shape[-2] * shape[-1], dtype)) for shape in shapes), default=0)


def chunk_bytes(shape, temporary_bytes: int) -> int:
    """A chunk's temporaries for a bank of `shape`, one matrix's being `temporary_bytes`."""
    return min(math.prod(shape[:-2]), chunk_experts(temporary_bytes)) * temporary_bytes


def packed_shard_bytes(model, dtype: torch.dtype, gpus: int) -> tuple[int, int]:
    """--quantize nf4 --shard fsdp, on a meta model without LoRA: (the first rank's base bytes: its share of each
    packed module's records, ceil(E R / gpus) bytes (core/adaptation/sharded_nf4.py), and its rows of every other
    base parameter in `dtype`; the largest decoder layer's base bytes as FSDP gathers it: records whole, the rest)."""
    packed = {f"{name}.weight": model.get_parameter(f"{name}.weight").shape for name in quantized_modules(model)}
    records = {n: math.prod(shape[:-2]) * record_widths(*shape[-2:], dtype)[-1] for n, shape in packed.items()}
    dense = [(n, p) for n, p in model.named_parameters() if n not in packed]
    mine = sum(math.ceil(r / gpus) for r in records.values()) + shard_bytes([p for _, p in dense], gpus)
    layer = max(sum(r for n, r in records.items() if n.startswith(f"model.layers.{i}.")) +
                sum(p.numel() * p.element_size() for n, p in dense if n.startswith(f"model.layers.{i}."))
                for i in range(len(model.model.layers)))
    return mine, layer


DATA_KINDS = ("choice", "chat")  # what the loss scores: candidates' answer tokens, or every position
ANSWER_TOKENS = 68  # an example's candidates' answer tokens together: docs/quantization.md says how it was measured


def logits_bytes(positions: int, vocab: int, dtype: torch.dtype, chunk: int = CHUNK) -> int:
    """The logits' peak over a step, [positions, vocab] tensors: in fp32 the log-softmax (saved for backward), the
    gradient the gather sends it and the log-softmax's own gradient; up to `chunk` positions (--loss-chunk) the
    head's output in `dtype` too (the forward's output keeps it), past it the chunked loss's `chunk` positions at a
    time, each chunk's output recomputed in the backward and dropped (a test holds both to a real step's peak)."""
    if positions > chunk:
        return chunk * vocab * 3 * 4
    return positions * vocab * (3 * 4 + dtype.itemsize)


def estimate(model, cfg, *, gpus: int, gpu_memory: int, shard: str, weights_total: int | None = None,
             data: str = "choice", answer_tokens: int = ANSWER_TOKENS) -> Estimate:
    """Bytes per GPU for `model` (a meta-device MoEForCausalLM in the run's dtype, LoRA and `cfg.method`
    installed) under `cfg`'s batch of `data` (DATA_KINDS; choice: `answer_tokens` scored an example);
    `weights_total`: the stored bytes when the files' shapes are unknown."""
    from minimoe.runs.install import install_method
    dequantising = 0
    if cfg.quantize is not None:
        weights_total = quantized_weights(model, DTYPES[cfg.dtype], cfg.quantize,  # before LoRA wraps the linears
                                          cfg.quantize_embedding)
        dequantising = dequantising_bytes(model, DTYPES[cfg.dtype], cfg.quantize)
        if shard == "fsdp":  # the rank's packed share, two packed layers gathered, one module dequantised
            mine, layer = packed_shard_bytes(model, DTYPES[cfg.dtype], gpus)
            sharded = mine + 2 * layer + max(model.get_submodule(n).weight.numel() * DTYPES[cfg.dtype].itemsize
                                             for n in quantized_modules(model))
    install_method(model, cfg)
    config = model.config
    base = [p for p in model.parameters() if not p.requires_grad]
    trainable = [p for p in model.parameters() if p.requires_grad]
    whole = weights_total or sum(p.numel() * p.element_size() for p in base)
    split = gpus if shard == "fsdp" else 1
    if shard == "fsdp" and cfg.quantize is not None:
        weights = sharded
    elif shard == "fsdp":
        layer = max(sum(p.numel() * p.element_size() for p in layer.parameters() if not p.requires_grad)
                    for layer in model.model.layers)  # its base weights (its LoRA, gathered beside them, is small)
        weights = shard_bytes(base, gpus) + 2 * layer
    else:
        weights = whole
    itemsize = DTYPES[cfg.dtype].itemsize
    tokens = math.ceil(cfg.batch_size / gpus) * cfg.max_length  # DDP and FSDP alike split the batch over ranks
    per_token = 12 * config.hidden_size + config.num_experts_per_tok * 3 * config.intermediate_size
    if config.parallel_dense:  # Gemma 4: the dense MLP beside the experts (gate, up, their product) and its 4 norms
        per_token += 3 * config.dense_intermediate_size + 4 * config.hidden_size
    layers = config.num_hidden_layers
    kept = (layers * config.hidden_size + per_token) if cfg.gradient_checkpointing else layers * per_token
    mla = config.mixers.get("mla")  # a DSA indexer's fp32 scores (module docstring)
    indexer = tokens * cfg.max_length * mla.index_n_heads * 4 if mla is not None and mla.index_topk else 0
    positions = tokens if data == "chat" else math.ceil(cfg.batch_size / gpus) * answer_tokens
    return Estimate(weights=weights, lora=math.ceil(2 * sum(p.numel() * p.element_size() for p in trainable) / split),
                    optimizer=optimizer_bytes(trainable, cfg.optim, split),
                    activations=tokens * kept * itemsize + indexer, gpu_memory=gpu_memory,
                    logits=logits_bytes(positions, config.vocab_size, DTYPES[cfg.dtype], cfg.loss_chunk),
                    dequantising=dequantising, data=data)


def model_config(name: str):
    """(MoEConfig, the folder or None): a local folder's, or a hub id's config.json alone."""
    path = Path(name)
    if path.is_dir():
        return read_config(path), path
    return config_from_dict(json.loads(hub_file(name, "config.json").read_text()), name), None


def hub_weights(name: str) -> int:
    index = json.loads(hub_file(name, "model.safetensors.index.json").read_text())
    return int(index["metadata"]["total_size"])


def table(e: Estimate) -> str:
    gib = 2**30
    rows = [("weights", e.weights), *([("dequantising (lookup, codes)", e.dequantising)] if e.dequantising else []),
            ("LoRA + heads (with gradients)", e.lora), ("AdamW state", e.optimizer),
            ("activations (estimate)", e.activations), (f"logits (estimate: {e.data} data)", e.logits), ("total", e.total)]
    lines = [f"{what:<38} {n / gib:9.3f} GiB" for what, n in rows]
    verdict = "fits" if e.fits else "does not fit"
    lines.append(f"{verdict}: {e.total / gib:.3f} GiB of {e.gpu_memory / gib:.1f} GiB a GPU "
                 f"(at most {HEADROOM:.0%} counted as usable)")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m minimoe.runs.memory runs its command, minimoe/cli/memory_estimate.py
    import runpy
    runpy.run_module("minimoe.cli.memory_estimate", run_name="__main__")
