"""A frozen base stored in 4 bits (QLoRA): the large matrices packed, dequantised one module at a time.

`quantize_module(module, packed)` takes a module whose `weight` is a frozen base matrix (an nn.Linear
[out, in], a GroupedLinear bank [E, out, in], or their LoRA forms) and stores it packed. Its `weight`
becomes a placeholder of the same shape, dtype and device holding no memory (stride 0), so that
whatever reads the weight's shape or dtype outside the forward (Experts, LoRA's init) reads what it
read before; the module's class becomes a `Dequantizing` one whose forward

1. dequantises the weight into a fresh tensor in the matmul's dtype (`matmul_dtype`: autocast's, else
   the weight's), and makes it `weight` for the duration of the module's own, unchanged forward;
2. runs that forward under saved-tensor hooks: any tensor autograd saves that lives in the dequantised
   storage (W, W.T, one expert's block of it) is saved as a token naming the packed weight, not as the
   tensor; backward's first unpack dequantises again, the later ones of the same forward share it, and
   the last drops it. So the dequantised weight lives from its module's forward to the end of its
   forward, and again across its module's backward: one module's weight at a time, never the model's.

The module's forward takes the dequantised weight as an argument (`weight=`, a LoRA bank's `stacked=`), so
nothing is written to the module while it runs. Under torch.compile the hooks cannot be traced (they read
storage pointers: 27 graph breaks on a tiny granitemoe), so a traced forward runs the same dequantise-then-
forward under torch's selective activation checkpointing instead: the products (mm, addmm, grouped_mm) are
kept from forward, everything else, the dequantisation first, is recomputed in backward. The same contract,
which the partitioner keeps: no dequantised weight is saved for backward (tests/core/adaptation/test_quantized.py
holds that, and the compiled step equal to eager's bit for bit). Eager keeps the hooks: eager selective
checkpointing reruns the module's Python forward in backward and holds each product's output until then.

The LoRA delta meets the dequantised base as it meets a dense one (core/adaptation/lora.py: in the matmul's accumulator), because it
is the same code: per-block addmm on the CPU, one grouped_mm over [x | a] against [W | s B] under
autocast. A LoRA bank's dequantised weight is written into the first `in` columns of a fresh
[E, out, in + k] buffer, which serves as the bank's `stacked` for that forward: the stride rules and any
rank hold as they do for a dense bank, with no copy of W. What autograd saves of that buffer is its
LoRA-sized tail (s B), beside the token.

What is packed (`quantized_modules`): every Linear and expert bank inside the decoder layers except the
router gates (routing decisions must not flip because of the base's storage; every method reads the gate
logits); the embeddings, LM head, norms and biases stay as loaded, and so does everything trained.

Formats: `NF4Weight` (QLoRA's NormalFloat-4 with double-quantised scales, packed per expert matrix by
torchao's `to_nf4` as QLoRA on transformers' per-expert modules packs them, held as whole-bank tensors and
dequantised a bank at a time by `nf4_dequantize`: a fixed number of kernels, not one set per expert, for each
chunk of experts whose temporaries fit DEQUANTIZE_CHUNK_BYTES, `dequantize_in_chunks`, which MXFP4's banks share). The
library is optional (the `quant` extra); `require("nf4")` names the extra when it is missing.
"""
from __future__ import annotations

import importlib
import logging
import math
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from minimoe.core.layers.experts import GroupedLinear, matmul_dtype

FORMATS = ("nf4", "mxfp4")  # mxfp4: gpt-oss's released expert blocks kept as loaded (loading/mxfp4.py)
NF4_BLOCK = 64  # values per NF4 scale (QLoRA's, torchao's default)
NF4_SCALER_BLOCK = 256  # scales per second-level scale (torchao's default); smaller where a matrix has fewer
ROUTER_GATES = ("gate", "shared_expert_gate")  # never packed: every method reads their logits
# never packed: a DSA indexer's top-k picks each query's keys, and so does DeepSeek-V4's CSA indexer (its
# compressor's `indexer`), each held dense on measured drift (docs/quantization.md)
SELECTORS = ("indexer",)


def require(fmt: str) -> None:
    """Raise, naming the extra to install, when `fmt`'s library is missing; or when `fmt` is unknown."""
    if fmt not in FORMATS:
        raise ValueError(f"--quantize {fmt!r}: unknown format; expected one of {FORMATS}")
    if fmt == "mxfp4":
        return  # our own decoder (loading/mxfp4.py), no library
    try:
        _nf4_module()
    except ImportError as e:
        raise ImportError(f"--quantize {fmt} needs torchao, which is not installed: pip install -e \".[quant]\" "
                          f"({e})") from None


def _nf4_module():
    return torchao_module("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")


def torchao_module(name: str):
    """A torchao module (`name`: its dotted path), imported without the warning torchao's import logs for each
    of its compiled extensions that this machine cannot load (its CUDA kernels, on a CPU machine: "Failed to
    load .../torchao/_C_mxfp8...so"), which reads as an error where nothing is wrong; its other messages pass."""
    log = logging.getLogger("torchao")
    unloadable = logging.Filter()
    unloadable.filter = lambda record: not record.getMessage().startswith("Failed to load ")
    log.addFilter(unloadable)
    try:
        importlib.import_module("torchao")  # first: the submodule alone may sit in sys.modules after torchao went
        return importlib.import_module(name)
    finally:
        log.removeFilter(unloadable)


def _to_nf4():
    return _nf4_module().to_nf4


class NF4Weight:
    """A [out, in] or [E, out, in] weight in torchao's NF4 layout, held as whole-bank tensors.

    Each [out, in] matrix is packed by torchao's own `to_nf4` (so the codes and scales are the library's):
    blocks of 64 consecutive values (row-major) share an absmax scale; the scales, less their per-matrix
    mean, are quantised to int8 in blocks of 256 (double quantisation), or of the largest power of two
    dividing their number when it is smaller (a toy width). The matrices' packed parts are then stacked,
    so that `nf4_dequantize` dequantises the whole bank in a fixed handful of kernels whatever its number
    of experts, with the library's arithmetic in the library's order: bit for bit its `get_original_weight`.

    codes [E, n / 2] uint8 (two values a byte, the first in the high nibble); scalers [E, n / 64] int8;
    factors [E, n / 64 / scaler_block] and means [E] in `dtype`; pairs: `nf4_pairs`, shared."""

    def __init__(self, weight: torch.Tensor, name: str = "weight"):
        rows, cols = weight.shape[-2:]
        if rows * cols % NF4_BLOCK:
            raise ValueError(f"--quantize nf4: {name} [{rows}, {cols}] has {rows * cols} values per matrix, not a "
                             f"multiple of NF4's block of {NF4_BLOCK}")
        scaler_block = math.gcd(rows * cols // NF4_BLOCK, NF4_SCALER_BLOCK)
        to_nf4 = _to_nf4()
        self.shape, self.dtype, self.device = weight.shape, weight.dtype, weight.device
        parts = [to_nf4(m.detach().contiguous(), NF4_BLOCK, scaler_block) for m in weight.reshape(-1, rows, cols)]
        self.codes = torch.stack([q.quantized_data for q in parts])
        self.scalers = torch.stack([q.quantized_scalers for q in parts])
        self.factors = torch.stack([q.quantization_factor for q in parts])
        self.means = torch.stack([q.scaler_mean for q in parts])
        self.pairs = nf4_pairs(parts[0].nf4)
        self.sample = digest_sample(weight)  # of the unpacked weight: an adapter's base digest is the checkpoint's

    def dequantize_into(self, out: torch.Tensor) -> torch.Tensor:
        """Write the weight into `out` (its shape; any float dtype, any strides); returns out."""
        return nf4_dequantize_into(out, self.codes, self.scalers, self.factors, self.means, self.pairs)

    def tensors(self) -> dict[str, torch.Tensor]:
        """What this weight alone holds (the pair table is shared)."""
        return {"codes": self.codes, "scalers": self.scalers, "factors": self.factors, "means": self.means}

    def to(self, device) -> NF4Weight:
        for name, t in self.tensors().items():
            setattr(self, name, t.to(device))
        moved = self.pairs.to(device)
        self.pairs, self.device = _PAIRS.setdefault((moved.dtype, moved.device), moved), moved.device
        return self

    @property
    def nbytes(self) -> int:
        """Bytes held: the packed values, both levels of scales and the per-matrix means."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


_PAIRS: dict[tuple, torch.Tensor] = {}


def nf4_pairs(table: torch.Tensor) -> torch.Tensor:
    """[256, 2]: the two values of `table` (torchao's 16 NF4 levels, [16]) that each code byte stands for,
    high nibble first, so that one lookup decodes a byte. One per dtype and device, shared by every weight."""
    key = (table.dtype, table.device)
    if key not in _PAIRS:
        byte = torch.arange(256, device=table.device)
        _PAIRS[key] = torch.stack((table[byte >> 4], table[byte & 0x0F]), dim=-1)
    return _PAIRS[key]


def nf4_dequantize(codes, scalers, factors, means, pairs):
    """NF4Weight's parts -> the [E, n] weight in pairs' dtype: torchao's get_original_weight for every matrix
    at once. Six kernels whatever E (tests/core/adaptation/test_quantized.py counts them), plain tensor ops that
    torch.compile traces whole. Transient: the int32 codes and the lookup, each the size of E matrices in bf16
    (`nf4_dequantize_into` passes a chunk of experts)."""
    E, blocks = scalers.shape
    # The block scales: int8 / second-level factor, in the weight's dtype, plus the matrix's mean (torchao's order).
    scales = (scalers.view(E, factors.shape[1], -1) / factors.unsqueeze(-1)).view(E, blocks) + means.unsqueeze(-1)
    values = F.embedding(codes.int(), pairs).view(E, blocks, NF4_BLOCK)  # [E, n / 2, 2]: each byte's two values
    return values.mul_(scales.unsqueeze(-1)).view(E, -1)


# The most that dequantising a bank holds beside its output at once: the int32 codes and the lookup's result of a
# chunk of experts. A whole Qwen3-30B-A3B gate_up bank's would be 1.5 GiB in bf16, a DeepSeek-V3 one's 28 GiB; at
# 256 MiB a chunk's kernels still each stream tens of millions of values, so their count costs no launch time.
DEQUANTIZE_CHUNK_BYTES = 2**28


def chunk_experts(temporary_bytes: int) -> int:
    """Experts of a bank that `dequantize_in_chunks` decodes at once, given one matrix's temporaries: as many as keep
    them within DEQUANTIZE_CHUNK_BYTES, one at least (a single larger matrix is one chunk). nf4's and mxfp4's plan."""
    return max(1, DEQUANTIZE_CHUNK_BYTES // temporary_bytes)


def dequantize_in_chunks(out, temporary_bytes: int, decode):
    """Write a bank into `out` ([..., out, in], any float dtype and strides) a chunk of experts at a time
    (`chunk_experts` of one matrix's `temporary_bytes`): decode(experts, a slice) returns those experts' values,
    any shape of their size. Each chunk runs decode's same few kernels, and decoding is per value, so the result
    is the whole bank's bit for bit; the temporaries are a chunk's."""
    rows, cols = out.shape[-2:]
    matrices = out.view(-1, rows, cols)  # a plain [out, in] Linear is one matrix
    step = chunk_experts(temporary_bytes)
    for e in range(0, matrices.shape[0], step):
        # one expression: a name bound to a chunk's values would hold them while the next chunk is decoded
        matrices[e:e + step].copy_(decode(slice(e, e + step)).view(-1, rows, cols))
    return out


def nf4_temporary_bytes(n: int, dtype: torch.dtype) -> int:
    """What `nf4_dequantize` holds at once for one matrix of n values in `dtype`: the int32 codes (4 bytes a pair),
    the lookup's result and the block scales (the division's result before them is freed when the mean is added)."""
    return n // 2 * 4 + n * dtype.itemsize + n // NF4_BLOCK * dtype.itemsize


def nf4_dequantize_into(out, codes, scalers, factors, means, pairs):
    """`nf4_dequantize` of every matrix, written into `out` ([..., out, in], any float dtype and strides) a chunk
    of experts at a time (`dequantize_in_chunks`)."""
    return dequantize_in_chunks(out, nf4_temporary_bytes(out.shape[-2] * out.shape[-1], pairs.dtype),
                                lambda c: nf4_dequantize(codes[c], scalers[c], factors[c], means[c], pairs))


DIGEST_VALUES = 4096  # values of a weight in the base-weights digest


def digest_sample(weight: torch.Tensor) -> torch.Tensor:
    """<= 4096 values of a weight, strided, in bf16: what the base-weights digest of an adapter reads
    (runs/adapters.py), kept of a packed weight as it was before packing."""
    flat = weight.detach().reshape(-1)
    return flat[::digest_stride(flat.numel())][:DIGEST_VALUES].to(torch.bfloat16)


def digest_stride(numel: int) -> int:
    return max(1, numel // DIGEST_VALUES)


def nf4_bytes(shape, dtype: torch.dtype) -> int:
    """The bytes NF4Weight holds for a weight of `shape` ([out, in] or [E, out, in]) stored from `dtype`,
    without packing it: per matrix of n values, n / 2 bytes of 4-bit codes, n / 64 int8 scales, one
    second-level factor per scaler block and a mean in `dtype` (runs/memory.py)."""
    *lead, rows, cols = shape
    n = rows * cols
    blocks = n // NF4_BLOCK
    itemsize = dtype.itemsize
    per_matrix = n // 2 + blocks + blocks // math.gcd(blocks, NF4_SCALER_BLOCK) * itemsize + itemsize
    return math.prod(lead) * per_matrix


class _Saved:
    """What autograd keeps of a tensor in a module's dequantised storage: the view's geometry, the
    buffer's non-weight tail (a LoRA bank's s B) and the shared rebuild (`_Rebuild`)."""

    def __init__(self, rebuild, t, tail):
        self.rebuild, self.tail = rebuild, tail
        self.geometry = (t.size(), t.stride(), t.storage_offset())


class _Rebuild:
    """One forward's dequantised buffer, rebuilt at backward's first unpack and shared by the unpacks of
    that forward's saved views (a per-expert loop saves one view per expert); dropped after the last."""

    def __init__(self, packed, shape, dtype, device):
        self.packed, self.shape, self.dtype, self.device = packed, shape, dtype, device
        self.pending, self.buffer = 0, None

    def unpack(self, saved: _Saved):
        buffer = self.buffer
        if buffer is None:
            buffer = dequantized_buffer(self.packed, self.shape, self.dtype, self.device)
        if saved.tail is not None:
            buffer[..., self.packed.shape[-1]:].copy_(saved.tail)
        self.pending -= 1
        self.buffer = buffer if self.pending > 0 else None
        return buffer.as_strided(*saved.geometry)


def dequantized_buffer(packed, shape, dtype, device):
    """A fresh [..., out, in + k] buffer whose first `in` columns hold the dequantised weight."""
    buffer = torch.empty(shape, dtype=dtype, device=device)
    packed.dequantize_into(buffer[..., :packed.shape[-1]])
    return buffer


class Dequantizing:
    """Mixed into a module's class by `quantize_module`: forward on the weight dequantised (module docstring)."""

    def forward(self, x, *args, **kwargs):
        if torch.compiler.is_compiling():  # traced: torch's own recomputation instead of the hooks (module docstring)
            return checkpoint(self._dequantized_forward, x, *args, use_reentrant=False,
                              context_fn=_recompute_all_but_products, **kwargs)
        packed, k = self.packed, getattr(self, "k", 0)  # k: a LoRA bank's [x | a] width (its `stacked` buffer)
        buffer = self._dequantized(x)
        storage, device = buffer.untyped_storage().data_ptr(), buffer.device
        rebuild = _Rebuild(packed, buffer.shape, buffer.dtype, device)
        alive = weakref.ref(buffer)  # autograd keeps the hooks with what they saved: no strong reference here

        def pack(t):
            if type(t) is not torch.Tensor or t.device != device or t.untyped_storage().data_ptr() != storage:
                return t
            rebuild.pending += 1
            return _Saved(rebuild, t, alive()[..., packed.shape[-1]:].clone() if k else None)

        def unpack(saved):
            return saved.rebuild.unpack(saved) if isinstance(saved, _Saved) else saved

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return self._forward_on(buffer, x, *args, **kwargs)

    def _dequantized(self, x):
        """A fresh [..., out, in + k] buffer, the weight dequantised in the matmul's dtype in its first `in` columns."""
        packed = self.packed
        shape = (*packed.shape[:-1], packed.shape[-1] + getattr(self, "k", 0))
        return dequantized_buffer(packed, shape, matmul_dtype(x, self.weight), self.weight.device)

    def _forward_on(self, buffer, x, *args, **kwargs):
        """The module's own forward on `buffer`'s weight instead of the placeholder (a LoRA bank's `stacked`: buffer)."""
        weight = buffer[..., :self.packed.shape[-1]]
        if isinstance(self, nn.Linear):
            return F.linear(x, weight, self.bias)  # nn.Linear.forward, on this weight
        if hasattr(self, "k"):
            kwargs["stacked"] = buffer
        return super().forward(x, *args, weight=weight, **kwargs)

    def _dequantized_forward(self, x, *args, **kwargs):
        return self._forward_on(self._dequantized(x), x, *args, **kwargs)

    def merge(self):  # a LoRA module's: the delta has no packed weight to go into
        raise ValueError("merge: this LoRA's base weight is packed (--quantize); dequantize_model(model) first, "
                         "as export.py --merged does")

    def _apply(self, fn, recurse=True):
        """.to(device or dtype): the placeholder takes the new dtype (the compute dtype), the packed weight
        the new device; the packed values themselves are never cast."""
        placeholder = self.weight
        super()._apply(fn, recurse)
        probe = fn(torch.empty((), dtype=placeholder.dtype, device=placeholder.device))
        self.weight = probe.expand(placeholder.shape)
        if probe.device != self.packed.device:
            self.packed.to(probe.device)
        if hasattr(self, "k"):
            self.stacked = None
        return self


# Under compile, the outputs of these are kept from forward (recomputing one would be a second forward matmul);
# the rest is recomputed in backward, the dequantised weight first, which must not be saved.
PRODUCTS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten._grouped_mm.default)


def _save_products(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in PRODUCTS else CheckpointPolicy.PREFER_RECOMPUTE


def _recompute_all_but_products():
    return create_selective_checkpoint_contexts(_save_products)


_CLASSES: dict[type, type] = {}


def dequantizing_class(cls: type) -> type:
    if issubclass(cls, Dequantizing):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Quantized{cls.__name__}", (Dequantizing, cls), {"__module__": __name__})
    return _CLASSES[cls]


def quantize_module(module: nn.Module, packed) -> nn.Module:
    """Store `module.weight` as `packed` (an NF4Weight of it, or loading/mxfp4.py's MXFP4Weight: anything
    with shape, dtype, device, dequantize_into, to, nbytes and sample) and dequantise it per forward."""
    placeholder = torch.empty((), dtype=packed.dtype, device=packed.device).expand(packed.shape)
    module._parameters.pop("weight", None)
    module.weight, module.packed = placeholder, packed
    if hasattr(module, "k"):
        module.stacked = None
    module.__class__ = dequantizing_class(type(module))
    return module


def carry_quantization(base: nn.Module, new: nn.Module) -> nn.Module:
    """`new` (a LoRA module built on `base`) dequantises as `base` did: add_lora calls this."""
    if isinstance(base, Dequantizing):
        quantize_module(new, base.packed)
    return new


def is_quantized(module: nn.Module) -> bool:
    return isinstance(module, Dequantizing)


def quantized_modules(model: nn.Module) -> list[str]:
    """The modules whose weight `--quantize` packs: every nn.Linear and expert bank in the decoder layers
    but the router gates (module docstring) and the `SELECTORS`."""
    return [name for name, m in model.named_modules()
            if ".layers." in f".{name}" and isinstance(m, (nn.Linear, GroupedLinear))
            and name.rpartition(".")[2] not in ROUTER_GATES and ".router." not in f".{name}."  # a method's heads train
            and not any(f".{s}." in f".{name}." for s in SELECTORS)]


def pack(weight: torch.Tensor, fmt: str, name: str = "weight"):
    if fmt != "nf4":
        raise ValueError(f"--quantize {fmt}: packs only what a checkpoint stores so (loading/checkpoint.py); "
                         f"a dense weight ({name}) packs as nf4")
    require(fmt)
    return NF4Weight(weight, name)


def quantize_model(model: nn.Module, fmt: str) -> nn.Module:
    """Pack every `quantized_modules` weight of a loaded model in `fmt` (loading/checkpoint.py packs them as
    it reads them instead, so that the whole unpacked model is never in memory)."""
    require(fmt)
    for name in quantized_modules(model):
        module = model.get_submodule(name)
        if not is_quantized(module):
            quantize_module(module, pack(module.weight.data, fmt, name))
    return model


def dequantize_model(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Every packed weight back as a plain frozen parameter, dequantised in `dtype` (default the
    placeholder's): the model a QLoRA merge goes into (export.py --merged)."""
    for module in model.modules():
        if is_quantized(module):
            placeholder, packed = module.weight, module.packed
            weight = torch.empty(placeholder.shape, dtype=dtype or placeholder.dtype, device=placeholder.device)
            packed.dequantize_into(weight)
            del module.weight, module.packed
            module.__class__ = type(module).__bases__[1]  # the class dequantizing_class mixed into
            module.weight = nn.Parameter(weight, requires_grad=False)
            if hasattr(module, "_stack"):  # a LoRA bank aliases its `stacked` buffer again
                module._stack()
    return model


def packed_bytes(model: nn.Module) -> int:
    return sum(m.packed.nbytes for m in model.modules() if is_quantized(m))
