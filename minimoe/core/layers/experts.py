"""The routed experts: E SwiGLU experts stored as stacked `[E, out, in]` banks, run on token rows sorted
by expert (`Dispatch`), with `torch.nn.functional.grouped_mm` where it applies and a plain per-expert loop
otherwise (`expert_matmul`); both paths are tested equal. Experts are never evaluated densely, and
nothing here reads a device value back to the host in forward or backward (no bincount, .item() or
boolean indexing). The MoE block that routes tokens to them is model.py's `MoEBlock`; LoRA on the
banks (lora.py) runs through the same `expert_matmul`.

Dtype rule: the banks cast their input to `matmul_dtype` (autocast's, else their own), so that a bf16
bank under autocast runs grouped_mm in bf16 whatever dtype its input arrives in, and the combine casts
back the fp32 that CUDA autocast's `sum` returns, so the residual stream keeps the model dtype.
Letters as in model.py: T tokens, K experts per token, N = T*K rows, E experts, D hidden, I expert width.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from minimoe.core.layers import cpu_memory
from minimoe.core.layers.mlp import ACTIVATIONS, clamped


class Dispatch:
    """Token rows sorted by expert, so that each expert runs on one contiguous block.

    block > 1 rounds every expert's block up to a multiple of `block` rows with stand-in rows: copies
    of token 0 whose combine weight is 0, so they add exact zeros to its output and its gradient
    (a CPU measure against oneDNN's per-shape kernels: cpu_memory.expert_block).
    """

    def __init__(self, experts, num_experts: int, block: int = 1):  # experts [T, K]
        flat = experts.flatten()  # [N] the expert of each (token, slot)
        self.counts = expert_counts(flat, num_experts)  # [E] rows per expert, on the device
        self.padding = 0
        if block > 1:  # CPU only (cpu_memory.expert_block): the stand-in rows' number is needed on the host
            pad = (-self.counts) % block  # [E] stand-in rows, appended after the N real ones
            flat = torch.cat([flat, torch.arange(num_experts, device=flat.device).repeat_interleave(pad)])
            self.counts, self.padding = self.counts + pad, int(pad.sum())
        N = experts.numel()
        self.order = flat.argsort(stable=True)  # sorted row -> (token, slot) index; >= N: a stand-in
        self.token = torch.where(self.order < N, self.order // experts.shape[1], 0)  # sorted row -> token
        self.offsets = self.counts.cumsum(0).to(torch.int32)  # [E] block ends, grouped_mm's int32 offs
        self._counts_list = None

    def row_weights(self, weights):  # weights [T, K] -> [rows, 1]: each sorted row's combine weight
        flat = weights.flatten()
        if self.padding:
            flat = torch.cat([flat, flat.new_zeros(self.padding)])
        return flat[self.order, None]

    def combine(self, y, T: int, K: int):
        """Sorted rows y [rows, D] -> [T, D], each token's K rows summed. Rows go back to (token, slot)
        order by a plain copy, then sum over K: a scatter-add into [T, D] (index_add_) is serial on
        CPU and took 4-7% of a bf16 step in the profile (bench/RESULTS.md)."""
        unsorted = y.new_empty(T * K + self.padding, y.shape[-1]).index_copy_(0, self.order, y)
        # CUDA autocast runs `sum` in fp32: without the cast, fp32 would reach the residual stream
        # and, through the next layer's norm, the expert banks (expert_matmul's dtype rule).
        return unsorted[:T * K].view(T, K, -1).sum(1).to(y.dtype)

    @property
    def counts_list(self) -> list[int]:  # the loop path needs python ints (one host sync; grouped_mm needs none)
        if self._counts_list is None:
            self._counts_list = self.counts.tolist()
        return self._counts_list


def expert_counts(flat, num_experts: int):
    """[N] expert ids -> [E] rows per expert. Not torch.bincount: on CUDA it reads the largest id back
    to the host to size its output, a device sync in every MoE block's forward."""
    return torch.zeros(num_experts, dtype=torch.long, device=flat.device).index_add_(0, flat, torch.ones_like(flat))


USE_GROUPED_MM = hasattr(F, "grouped_mm")  # tests switch this off to compare against the loop
GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _grouped_mm_applies(x, w_t) -> bool:
    # grouped_mm wants every non-unit stride 16-byte aligned; CUDA kernels want bf16.
    if not USE_GROUPED_MM or x.dtype != w_t.dtype or x.shape[0] == 0 or x.dtype not in GROUPED_MM_DTYPES:
        return False
    if x.device.type == "cuda" and x.dtype != torch.bfloat16:
        return False
    # the output [N, out] too: backward hands its gradient, that shape, to grouped_mm
    return x.stride(-1) == 1 and _aligned(x) and _aligned(w_t) and w_t.shape[-1] * x.element_size() % 16 == 0


def _aligned(t) -> bool:
    """grouped_mm's stride rule, as torch checks it: one of the last two dims has stride 1 and every other
    stride is a multiple of 16 bytes (not "every stride but the 1s": a [N, 1] tensor's row stride is 1)."""
    *batch, rows, cols = (s * t.element_size() for s in t.stride())
    size = t.element_size()
    inner = (cols == size and rows % 16 == 0) or (rows == size and cols % 16 == 0)
    return inner and all(s % 16 == 0 for s in batch)


def matmul_dtype(x, weight) -> torch.dtype:
    """The dtype a matmul of x by weight runs in, as F.linear's: autocast's where autocast is on for
    x's device, else the weight's. The expert banks and their LoRA cast to it, so that a bf16 bank
    under autocast runs grouped_mm in bf16 whatever dtype its input arrives in."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


def expert_matmul(x, weight, dispatch: Dispatch):
    """x [N, in] sorted by expert, weight [E, out, in] -> [N, out]: row block e times weight[e].T.
    Runs in x's dtype (callers cast x with `matmul_dtype`); the weight is cast to it if it differs."""
    w_t = weight.transpose(-2, -1).to(x.dtype)  # [E, in, out], a view when the dtypes agree
    if _grouped_mm_applies(x, w_t):
        return F.grouped_mm(x, w_t, offs=dispatch.offsets)
    blocks = x.split(dispatch.counts_list)  # the readable reference path
    return torch.cat([blk @ w_t[e] for e, blk in enumerate(blocks)])


class GroupedLinear(nn.Module):
    """E linear maps stored as one [E, out, in] weight; forward runs the sorted row blocks."""

    def __init__(self, num_experts: int, out_features: int, in_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))

    def forward(self, x, dispatch: Dispatch, weight=None):  # x [N, in] -> [N, out]
        """weight: the bank to use instead of self.weight (a packed bank's dequantisation: adaptation/quantized.py)."""
        return expert_matmul(x, self.weight if weight is None else weight, dispatch)


class Experts(nn.Module):
    """E gated experts (SwiGLU, or the config's `hidden_act`). gate_up_proj [E, 2I, D] holds the gate rows first,
    then the up rows.

    The combine weight scales each expert's output, or with `scale_input` its input, the output then
    summed unweighted (Llama 4: x * g, cast to the model dtype, is what the expert sees). Gemma 4's
    `per_expert_scale` [E] multiplies each expert's combine weight, in fp32 before the cast as its reference: part
    of the expert, so that every routing policy sees it as the expert's own gain (a dense mixture's too)."""

    def __init__(self, config):  # a model.MoEConfig
        super().__init__()
        E, D, I = config.num_experts, config.hidden_size, config.intermediate_size
        self.gate_up_proj = GroupedLinear(E, 2 * I, D)
        self.down_proj = GroupedLinear(E, D, I)
        self.scale_input = config.expert_input_scaled
        self.act = ACTIVATIONS[config.hidden_act]
        self.limit = config.swiglu_clamp  # DeepSeek-V4: SwiGLU's inputs clamped (mlp.clamped); None: not
        if config.per_expert_scale:
            self.per_expert_scale = nn.Parameter(torch.ones(E))

    def forward(self, x, experts, weights):  # x [T, D], experts/weights [T, K] -> [T, D]
        E = self.gate_up_proj.weight.shape[0]
        if hasattr(self, "per_expert_scale"):
            weights = weights.float() * self.per_expert_scale.float()[experts]  # [T, K]
        # The bank's dtype (or autocast's): an fp32 x against a bf16 bank would leave grouped_mm for the loop.
        x = x.to(matmul_dtype(x, self.gate_up_proj.weight))
        dispatch = Dispatch(experts, E, cpu_memory.expert_block(x, experts.numel(), E))
        rows = x[dispatch.token]  # [N, D]
        if self.scale_input:
            rows = rows * dispatch.row_weights(weights).to(rows.dtype)
        h = self.gate_up_proj(rows, dispatch)  # [N, 2I]
        gate, up = h.chunk(2, dim=-1)
        if self.limit is not None:
            gate, up = clamped(gate, up, self.limit)
        y = self.down_proj(self.act(gate) * up, dispatch)  # [N, D]
        if not self.scale_input:
            y = y * dispatch.row_weights(weights).to(y.dtype)
        return dispatch.combine(y, *experts.shape)


class SquaredReLUExperts(nn.Module):
    """E experts without a gate (Nemotron-H): down(relu(up x)^2). up_proj [E, I, D_in], down_proj [E, D_in, I];
    D_in is the hidden size, or the latent width of a block that projects into one first (model.MoEBlock).
    The combine weight scales each expert's output, as `Experts`."""

    def __init__(self, num_experts: int, width: int, intermediate_size: int):
        super().__init__()
        self.up_proj = GroupedLinear(num_experts, intermediate_size, width)
        self.down_proj = GroupedLinear(num_experts, width, intermediate_size)

    def forward(self, x, experts, weights):  # x [T, D_in], experts/weights [T, K] -> [T, D_in]
        E = self.up_proj.weight.shape[0]
        x = x.to(matmul_dtype(x, self.up_proj.weight))
        dispatch = Dispatch(experts, E, cpu_memory.expert_block(x, experts.numel(), E))
        h = F.relu(self.up_proj(x[dispatch.token], dispatch)).square()  # [N, I]
        y = self.down_proj(h, dispatch) * dispatch.row_weights(weights).to(h.dtype)  # [N, D_in]
        return dispatch.combine(y, *experts.shape)
