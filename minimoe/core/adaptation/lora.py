"""LoRA on attention projections and routed experts: the layers, `add_lora`, merge and unmerge.

`add_lora(model)` replaces the targeted modules in place. A LoRA module keeps the base module's
parameter names (`...q_proj.weight`, `...experts.gate_up_proj.weight`), so checkpoint I/O is
unchanged, and adds `lora_A`, `lora_B` beside them: y = W x + (alpha / r) B A dropout(x).
add_lora freezes the base model and trains LoRA. What trains of routing (the method heads, and
the gates that `set_router(..., tune_router=True)` tunes) is routing's rule,
`routing.set_routing_trainable`, which add_lora applies last: LoRA and the router may be
installed in either order.

Decisions:
- Targets: "q", "k", "v", "o" and the two expert banks "gate_up", "down" ("experts": both). The
  default is the paper's (Table experimental_configuration): Granite Q/K/V + routed experts, OLMoE
  Q/K/V/O + routed experts, in every layer.
- Experts: grouped LoRA, A [E, r, in] and B [E, out, r], run on the expert-sorted rows with the
  base bank's `expert_matmul`, the base product added per expert block (see dtype below); `W + BA`
  is built only by merging, never per step.
- One rank-r LoRA per *on-disk* matrix, read off the checkpoint name table. Granite stores the fused
  input_linear [E, 2I, D] and output_linear: one LoRA each. OLMoE stores gate_proj and up_proj
  apart, so our fused gate_up bank carries two independent LoRAs, as peft puts on OLMoE's
  per-expert modules: A [E, 2r, D] whose first r rows feed B[:, :I] (gate) and last r rows B[:, I:]
  (up), B [E, 2I, r]. A test against peft on transformers' OlmoeForCausalLM holds this equal. One
  difference: peft draws separate dropout masks for gate_proj and up_proj; here both share one.
- Init as peft: A Kaiming-uniform (a = sqrt 5: U(+-1/sqrt(in)) per expert), B = 0, so outputs
  are unchanged until training moves B. Dropout acts on the LoRA input only (train mode only).
- dtype: adapters are stored in fp32 (peft's default, `autocast_adapter_dtype`), so small AdamW
  steps are not rounded away on a bf16 base; they are cast to the activation dtype at use, as
  autocast would, so a bf16 expert LoRA's A and B run through grouped_mm as a base bank does. On the
  CPU without autocast the branch stays in fp32 instead, for oneDNN's kernel cache; that and the
  CPU's other measures (dropout saved as a mask) are minimoe/core/layers/cpu_memory.py's, behind `branch`.
  The base keeps its load dtype. Merging adds in fp32 and rounds once, so in bf16 a merge/unmerge
  round trip may move a weight by one rounding step (as in peft); `export_merged` puts the exact
  original weights back instead of unmerging.
- Where the delta meets a bf16 base output: in the matmul's fp32 accumulator, never as
  round(round(W x) + delta). W x rounded to bf16 lies on the bf16 grid, so a delta below half a
  bf16 step there is lost entirely, and early in training (B starts at 0 and moves ~lr a step) most
  of it is that small: the default run's bf16 forward saw none of the loss change its adapter
  makes in fp32 at a tenth of the trained B (a fifth at three tenths), and trained 2 points worse.
  `torch.addmm(delta, x, W.T)` rounds W x + delta once (C holds delta in bf16: 8 significant bits
  of delta itself, not of W x), for a linear layer and for each expert's block of a bank, where
  grouped_mm has no C. Carrying y + delta in fp32 to the residual add instead over-responded (3x
  fp32's loss change at a tenth of B), and an fp32 residual stream or fp32 logits changed nothing
  (docs/precision.md). The per-block addmm needs the block sizes on the host (a device
  sync) and one launch per expert, so off the CPU and under autocast (the GPU recipe) a bank computes
  W_e x + B_e a in one grouped_mm over [x | a] against [W_e | scale B_e] instead (`base_plus_delta`):
  the same single rounding, a and B held in bf16, no sync, and a backward that computes no gradient
  for the frozen bank. [W_e | scale B_e] is one persistent buffer per bank, of which the bank's weight
  is a view (`LoRAGroupedLinear.stacked`), so no step copies a bank; the rank is padded to a multiple
  of 8 for grouped_mm's 16-byte strides, so every rank runs. Two products summed in fp32 would need
  grouped_mm's out_dtype=fp32 for bf16 inputs, which the CPU's refuses in torch 2.13 ("Grouped gemm
  output dtype must match `mat_a` dtype"; CUDA's unchecked): no CPU test could hold it.
  Only this path's numerics are tested on the CPU (bf16 autocast replays its grouped_mm calls and
  stride checks); it has not run on a GPU.

Saving and loading what was trained: minimoe/runs/adapters.py; exporting it: minimoe/integrations/hf_export.py.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from minimoe.core.layers import cpu_memory
from minimoe.core.layers.experts import GroupedLinear, _grouped_mm_applies, expert_matmul, matmul_dtype
from minimoe.core.decoder.family_record import family_of
from minimoe.core.decoder.model import MoEForCausalLM, scaled
from minimoe.core.adaptation.quantized import carry_quantization
from minimoe.core.routing_methods.routing import set_routing_trainable

TARGETS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
           "gate_up": "mlp.experts.gate_up_proj", "down": "mlp.experts.down_proj",
           # the recurrent mixers' projections (core/token_mixers/mamba2.py, core/token_mixers/deltanet.py), in the layers that have them
           "mamba_in": "mamba.in_proj", "mamba_out": "mamba.out_proj", "linear_qkvz": "linear_attn.in_proj_qkvz",
           "linear_ba": "linear_attn.in_proj_ba", "linear_out": "linear_attn.out_proj",
           # Qwen3.5's DeltaNet projections, stored apart (deltanet.py's linear_in_proj "split")
           "linear_qkv": "linear_attn.in_proj_qkv", "linear_z": "linear_attn.in_proj_z",
           "linear_b": "linear_attn.in_proj_b", "linear_a": "linear_attn.in_proj_a",
           "conv_in": "conv.in_proj", "conv_out": "conv.out_proj"}  # LFM2's short conv (core/token_mixers/short_conv.py)
ALIASES = {"experts": ("gate_up", "down"), "mamba": ("mamba_in", "mamba_out"),
           "deltanet": ("linear_qkvz", "linear_ba", "linear_qkv", "linear_z", "linear_b", "linear_a", "linear_out"),
           "short_conv": ("conv_in", "conv_out")}


def target_path(layer: nn.Module, paths: dict, t: str) -> str:
    """The module that target `t` adapts in `layer`: the first of the family's own paths for it that the
    layer has (`paths`: Family.lora_paths, DeepSeek's MLA projections), else TARGETS's."""
    return next((p for p in paths.get(t, ()) if has_submodule(layer, p)), TARGETS[t])


def has_submodule(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


class LoRAMixin:
    """lora_A [..., blocks*r, in], lora_B [..., out, r]: block b of A feeds row block b of B."""

    def _init_lora(self, rank: int, alpha: float, dropout: float, blocks: int, dtype):
        *lead, out_features, in_features = self.weight.shape
        kw = dict(dtype=dtype, device=self.weight.device)
        bound = 1 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)) on one [r, in] matrix
        self.lora_A = nn.Parameter(torch.empty(*lead, blocks * rank, in_features, **kw).uniform_(-bound, bound))
        self.lora_B = nn.Parameter(torch.zeros(*lead, out_features, rank, **kw))
        self.blocks, self.scale, self.merged = blocks, alpha / rank, False
        self.dropout = nn.Dropout(dropout)

    @contextmanager
    def branch(self, x):
        """`with self.branch(x) as (dropped, A, B):` dropout(x), A and B in the dtype the adapter branch
        runs in, for the LoRA matmuls inside the block. That dtype is the base matmul's (`matmul_dtype`:
        bf16 under autocast, because grouped_mm on CUDA takes bf16 only: an fp32 branch there runs the
        per-expert loop), or on the CPU the adapters' own (cpu_memory.keeps_adapter_dtype), where
        dropout(x) is also saved for backward as a mask (cpu_memory.dropout_saved_as_mask)."""
        dtype = self.lora_A.dtype if cpu_memory.keeps_adapter_dtype(x) else matmul_dtype(x, self.weight)
        A, B = self.lora_A.to(dtype), self.lora_B.to(dtype)
        with cpu_memory.dropout_saved_as_mask(x, dtype, self.dropout.p, self.training) as dropped:
            yield dropped, A, B

    def delta_weight(self):
        """scale * B A in fp32, shaped like the base weight, with OLMoE's gate/up blocks kept apart."""
        A, B = self.lora_A.float(), self.lora_B.float()
        pairs = zip(B.chunk(self.blocks, dim=-2), A.chunk(self.blocks, dim=-2))
        return self.scale * torch.cat([b @ a for b, a in pairs], dim=-2)

    @torch.no_grad()
    def merge(self):
        if not self.merged:
            self.weight.copy_(self.weight.float() + self.delta_weight())
            self.merged = True

    @torch.no_grad()
    def unmerge(self):
        if self.merged:
            self.weight.copy_(self.weight.float() - self.delta_weight())
            self.merged = False

    def extra_repr(self):
        return f"rank={self.lora_B.shape[-1]}, blocks={self.blocks}, scale={self.scale}, merged={self.merged}"


class LoRALinear(LoRAMixin, nn.Module):
    """An nn.Linear's own weight and bias plus lora_A [r, in], lora_B [out, r]."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float, dtype=torch.float32):
        super().__init__()
        self.weight, self.bias = base.weight, base.bias
        self._init_lora(rank, alpha, dropout, 1, dtype)

    def forward(self, x, weight=None):  # x [..., in] -> [..., out]; weight: in place of self.weight (a packed base's)
        weight = self.weight if weight is None else weight
        if self.merged:
            return F.linear(x, weight, self.bias)
        with self.branch(x) as (dropped, A, B):
            delta = scaled(F.linear(F.linear(dropped, A), B), self.scale)  # [..., out]
        return linear_plus_delta(x, weight, self.bias, delta)


def linear_plus_delta(x, weight, bias, delta):
    """x [..., in], weight [out, in], delta [..., out] -> W x + b + delta, summed in the matmul's fp32
    accumulator and rounded once to x's dtype (module docstring): addmm with the delta as its C."""
    if bias is not None:
        delta = delta + bias
    *lead, out = delta.shape
    y = torch.addmm(delta.reshape(-1, out).to(x.dtype), x.reshape(-1, x.shape[-1]), weight.t())
    return y.view(*lead, out)


class LoRAGroupedLinear(LoRAMixin, GroupedLinear):
    """A GroupedLinear's weight [E, out, in] plus lora_A [E, blocks*r, in], lora_B [E, out, r].

    The bank lives in `stacked` [E, out, in + k], k = blocks*r rounded up to a multiple of 8, and
    `weight` is its view [..., :in]: the GPU path's one grouped_mm over [x | a] needs [W_e | s B_e] as
    one strided matrix, and building it per step copied the whole bank each way (measured on the
    GPU path). The last k columns take s B (block-diagonal, zero-padded) in place at each forward, a
    LoRA-sized write. Memory: k / in more than the bank (Granite-3B's down bank, in 512, k 8: 1.6%).
    Why 8: grouped_mm wants every stride a multiple of 16 bytes, so a bf16 [N, in + k] needs in + k
    a multiple of 8; the zero rows of A and columns of B add exact zeros."""

    def __init__(self, base: GroupedLinear, rank: int, alpha: float, dropout: float, blocks: int = 1,
                 dtype=torch.float32):
        nn.Module.__init__(self)  # adopt the base bank instead of allocating a new one
        self.weight = base.weight
        self._init_lora(rank, alpha, dropout, blocks, dtype)
        self.k = -(-blocks * rank // 8) * 8  # [x | a]'s a width, padded (class docstring)
        self._stack()

    def _stack(self):
        """Move the bank into `stacked`'s first `in` columns and make `weight` that view (a one-time copy).
        Not for a bank with no storage of its own (meta, an expanded placeholder, an FSDP shard): FSDP
        gathers the bank anew at each forward, so there is nothing to alias, and a placeholder's buffer
        would be the whole bank on every rank (minimoe/runs/sharding.py); base_plus_delta builds [W | b]."""
        W = self.weight.data
        if isinstance(W, DTensor) or W.is_meta or 0 in W.stride():
            self.stacked = None
            return
        stacked = torch.zeros(*W.shape[:-1], W.shape[-1] + self.k, dtype=W.dtype, device=W.device)
        stacked[..., :W.shape[-1]] = W
        self.weight.data = stacked[..., :W.shape[-1]]
        self.stacked = stacked  # a plain attribute: not in state_dict, not broadcast by DDP, not moved by .to()

    def _apply(self, fn, recurse=True):
        """.to() and friends give `weight` storage of its own: stack it again, so `stacked` keeps aliasing it."""
        self.stacked = None
        super()._apply(fn, recurse)
        self._stack()
        return self

    def forward(self, x, dispatch, weight=None, stacked=None):  # x [N, in] sorted by expert -> [N, out]
        """weight, stacked: in place of self.weight and self.stacked (a packed bank's dequantisation, whose
        buffer [E, out, in + k] is its `stacked`: core/adaptation/quantized.py)."""
        weight = self.weight if weight is None else weight
        if self.merged:
            return expert_matmul(x, weight, dispatch)
        with self.branch(x) as (dropped, A, B):
            if cpu_memory.keeps_adapter_dtype(x):  # fp32 a and B on the CPU: the delta apart, addmm per block
                a = expert_matmul(dropped, A, dispatch)  # [N, blocks*r]
                pairs = zip(a.chunk(self.blocks, dim=-1), B.chunk(self.blocks, dim=-2))
                delta = scaled(torch.cat([expert_matmul(a_b, B_b, dispatch) for a_b, B_b in pairs], dim=-1), self.scale)
                return per_block_addmm(x, weight, delta, dispatch)
            A, b = self.padded_factors(A, B)
            a = expert_matmul(dropped, A, dispatch)  # [N, k]
        stacked = self.stacked if stacked is None else stacked  # None: a cast or FSDP-gathered bank, a copy anyway
        stacked = stacked if stacked is not None and stacked.dtype == x.dtype else None
        return base_plus_delta(x, weight, a.to(x.dtype), b.to(x.dtype), dispatch, stacked)

    def padded_factors(self, A, B):
        """A [E, k, in] and s B as one block-diagonal b [E, out, k]: block i of A's rows feeds row block i
        of B; rows and columns past blocks*r are zeros (the class docstring's padding)."""
        r, n = B.shape[-1], self.blocks
        b = torch.cat([F.pad(B_i, (i * r, self.k - (i + 1) * r)) for i, B_i in enumerate(B.chunk(n, dim=-2))], dim=-2)
        return F.pad(A, (0, 0, 0, self.k - n * r)), scaled(b, self.scale)


def per_block_addmm(x, weight, delta, dispatch):
    """x [N, in] sorted by expert, weight [E, out, in], delta [N, out] -> W_e x + delta per expert block,
    the delta as addmm's C (summed in the fp32 accumulator, rounded once; as expert_matmul's loop, one host sync)."""
    w_t, rows = weight.transpose(-2, -1).to(x.dtype), dispatch.counts_list  # [E, in, out]
    pairs = zip(x.split(rows), delta.to(x.dtype).split(rows))
    return torch.cat([torch.addmm(d, blk, w_t[e]) for e, (blk, d) in enumerate(pairs)])


class _BasePlusDelta(torch.autograd.Function):
    """y = [x | a] [W_e | b_e]^T per expert block: x W_e^T + a b_e^T with one accumulation and one
    rounding, read from `stacked` = [W | b] [E, out, in + k], which the caller keeps (no copy here).
    Backward as torch's grouped_mm derivative, but only for what needs a gradient: a frozen bank
    (w None, or not requiring grad) gets no bank-sized product."""

    @staticmethod
    def forward(ctx, xa, stacked, w, b, offs):  # xa [N, in + k]; w [E, out, in] or None; b [E, out, k]
        ctx.save_for_backward(xa, stacked, offs)
        ctx.d_in = stacked.shape[-1] - b.shape[-1]
        return F.grouped_mm(xa, stacked.transpose(-2, -1), offs=offs)

    @staticmethod
    def backward(ctx, dy):  # dy [N, out]
        xa, stacked, offs = ctx.saved_tensors
        dy = dy.contiguous()  # an expanded gradient (of a sum) has stride 0, which grouped_mm refuses
        dxa = dw = db = None
        if ctx.needs_input_grad[0]:
            dxa = F.grouped_mm(dy, stacked, offs=offs)  # [N, in + k]
        if ctx.needs_input_grad[2]:
            dw = F.grouped_mm(dy.transpose(0, 1), xa[:, :ctx.d_in], offs=offs)  # [E, out, in]
        if ctx.needs_input_grad[3]:
            db = F.grouped_mm(dy.transpose(0, 1), xa[:, ctx.d_in:], offs=offs)  # [E, out, k]
        return dxa, None, dw, db, None


def base_plus_delta(x, weight, a, b, dispatch, stacked=None):
    """x [N, in] and a [N, k] sorted by expert, weight [E, out, in], b [E, out, k] -> x W_e^T + a b_e^T
    [N, out], summed before the one rounding to x's dtype (module docstring). stacked: [W | b] [E, out, in + k]
    whose [..., in:] this fills with b (LoRAGroupedLinear keeps one, aliasing its bank); None builds it
    (a copy of the bank). grouped_mm where the strides allow; else the per-expert loop (one host sync)."""
    xa = torch.cat([x, a], dim=-1)  # [N, in + k]: activations, not the bank
    d_in = weight.shape[-1]
    if stacked is None:
        stacked = torch.cat([weight.detach().to(x.dtype), b.detach()], dim=-1)
    else:  # through .data, which autograd does not version: another call of the same bank before this one's
        # backward (DenseMixer's dense term runs every expert in its own backward) writes the same b, and a
        # versioned write there failed that backward (what the call saved had been "modified by an inplace operation")
        stacked.data[..., d_in:].copy_(b.detach())
    if not _grouped_mm_applies(xa, stacked.transpose(-2, -1)):
        return per_block_addmm(x, weight, expert_matmul(a, b, dispatch), dispatch)
    w = weight if weight.requires_grad else None
    return _BasePlusDelta.apply(xa, stacked, w, b, dispatch.offsets)


def resolve_targets(targets) -> list[str]:
    """User target names -> bank names in TARGETS order; an unknown name raises, naming it."""
    names = set()
    for t in [targets] if isinstance(targets, str) else targets:
        if t not in TARGETS and t not in ALIASES:
            raise ValueError(f"add_lora: unknown target {t!r}; expected some of {list(TARGETS) + list(ALIASES)}")
        names.update(ALIASES.get(t, (t,)))
    if not names:
        raise ValueError("add_lora: no targets given")
    return [t for t in TARGETS if t in names]


def lora_modules(model: nn.Module) -> dict[str, LoRAMixin]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRAMixin)}


# The paper's LoRA for both backbones (Experimental Configuration table): add_lora's defaults and every recipe's.
RANK, ALPHA, DROPOUT = 8, 8.0, 0.05


def add_lora(model: MoEForCausalLM, rank: int = RANK, alpha: float = ALPHA, dropout: float = DROPOUT, targets=None,
             dtype=torch.float32) -> MoEForCausalLM:
    """Put LoRA on `targets` of every layer (None: the family's default) and freeze the base model;
    routing's parameters then train as `model.router_spec` says (`routing.set_routing_trainable`)."""
    config = model.config
    if not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"add_lora: rank must be a positive int, got {rank!r}")
    if not 0 <= dropout < 1:
        raise ValueError(f"add_lora: dropout must be in [0, 1), got {dropout!r}")
    if lora_modules(model):
        raise ValueError("add_lora: the model already has LoRA modules")
    family = family_of(config.model_type)
    targets = resolve_targets(family.lora_targets if targets is None else targets)
    model.requires_grad_(False)  # the base; LoRA's parameters below are new and train
    for i, layer in enumerate(model.model.layers):
        for t in targets:
            path = target_path(layer, family.lora_paths, t)
            if path.startswith("mlp.experts") and not layer.sparse:
                continue  # a dense layer's MLP is not adapted (nor is a shared expert: docs/methods.md)
            if not path.startswith("mlp.") and path.split(".")[0] != layer.mixer_attribute:
                continue  # a hybrid's layer: attention targets reach its attention layers, mamba ones its Mamba-2 layers
            if not has_submodule(layer, path):
                continue  # a DeltaNet layer holds the fused projections (Qwen3-Next) or the split ones (Qwen3.5);
                # Gemma 4's global layers, whose keys are values, have no v_proj (peft adapts none there either)
            parent_name, _, leaf = path.rpartition(".")
            parent, base = layer.get_submodule(parent_name), layer.get_submodule(path)
            if isinstance(base, LoRAMixin):  # MLA's kv_b_proj, named by both "k" and "v"
                continue
            if isinstance(base, GroupedLinear):
                disk = family.layer_keys.get(f"{path}.weight")
                blocks = len(disk) if isinstance(disk, tuple) else 1  # one LoRA per on-disk matrix
                lora = LoRAGroupedLinear(base, rank, alpha, dropout, blocks, dtype)
            else:
                lora = LoRALinear(base, rank, alpha, dropout, dtype)
            lora = carry_quantization(base, lora)  # a packed base stays packed (core/adaptation/quantized.py)
            setattr(parent, leaf, lora.train(base.training))  # an eval model keeps its dropout off
    model.lora_spec = dict(rank=rank, alpha=alpha, dropout=dropout, targets=targets,
                           dtype=str(dtype).removeprefix("torch."))
    set_routing_trainable(model)  # heads and tuned gates train whether set_router came first or comes next
    return model


def merge_lora(model: nn.Module):
    for m in lora_modules(model).values():
        m.merge()


def unmerge_lora(model: nn.Module):
    for m in lora_modules(model).values():
        m.unmerge()
