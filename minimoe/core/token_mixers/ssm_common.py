"""What the recurrent token mixers share (core/token_mixers/mamba2.py, core/token_mixers/deltanet.py,
core/token_mixers/short_conv.py): the causal depthwise conv1d with its window state, padding masks, chunk padding, and packed rows run as a prompt plus candidates
that each continue from the prompt's state.

Each mixer is: position-wise projections, then a *sequential part* (the causal conv1d and, but for the short
conv, a chunked scan whose state is carried from position to position), then position-wise output. The sequential
part is a function `sequence(u [B, T, F], mask [B, T] | None, state | None) -> (y [B, T, F'], state)`
of the projections `u`; its `state` (a `RecurrentState`) is the conv window and the scan's state, the
same thing the generation cache keeps.

Padding, as transformers 4.57 masks it: the mixer's input and the conv's output are zeroed at padded
positions. From a zero state (left padding) the state then stays zero across the padding, so a
left-padded row equals the unpadded one; right padding comes after every real token and cannot reach it.

Packed answer choices (core/task/choices.py: the prompt is segment 0, candidate c is segment c+1, each
candidate sees the prompt and itself) cannot run as one left-to-right scan: the state entering a
candidate must be the prompt's final state, not the previous candidate's. `run_segments` runs the
prompts once (left-aligned, so each ends at the last column and its final state is the scan's), then
all candidates as one right-padded batch of pieces, each starting from its row's prompt state; this
is exactly what a candidate's own unpacked row computes, prompt once instead of once per candidate.
Packed examples (core/task/tokens.py: several whole examples in one row, segments 1, 2, ..., no segment 0)
are the same pieces without a prompt: each starts from the zero state, as its own row would.
The piece layout is read on the host once per forward (`segment_plan`, one device sync), by the model before its
layers run (`read_layout`: no compiled layer traces a host read), and kept on the forward's MixerInputs; it holds the real positions as index tensors
(found on the host), so that no layer indexes by a mask on the device (a mask index is a nonzero: a sync each).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from minimoe.core.layers.norms import rms_normalized


@dataclass
class RecurrentState:
    """One recurrent layer's state after the positions it has seen: the conv window and the scan state."""
    conv: torch.Tensor  # [B, C, K-1] the last K-1 conv inputs (C channels, K the kernel width)
    scan: torch.Tensor | None  # [B, H, ...] Mamba-2: [B, H, P, N]; Gated DeltaNet: [B, H, dk, dv]; fp32; short conv: None

    def select(self, rows) -> "RecurrentState":
        return RecurrentState(self.conv[rows], None if self.scan is None else self.scan[rows])


class StateSlot:
    """A recurrent layer's entry in the generation cache (core/token_mixers/mixers.py's KVCache): its state so far."""

    def __init__(self):
        self.state: RecurrentState | None = None


def run_sequence(sequence, u, inputs, cache: StateSlot | None):
    """A mixer's sequential part over u [B, T, F] with what the model passes every mixer (mixers.MixerInputs):
    the padding of these T positions, packed rows (`run_segments`), or the cache's state, carried on."""
    T = u.shape[1]
    mask = None if inputs.attention_mask is None else inputs.attention_mask[:, -T:]
    if inputs.segment_ids is not None:
        read_layout(inputs)  # done already where the model built `inputs`; a mixer called alone reads it here
        return run_segments(sequence, u, inputs.segment_plan)
    y, state = sequence(u, mask, None if cache is None else cache.state)
    if cache is not None:
        cache.state = state
    return y


def read_layout(inputs):
    """Packed rows' layout onto `inputs` (MixerInputs.segment_plan), read on the host once per forward: the
    recurrent mixers' `read_layout`, which the model calls before its layers run (mixers.py), so that a compiled
    layer traces no host read; a no op where no rows are packed or the plan is there."""
    if inputs.segment_ids is not None and inputs.segment_plan is None:
        T = inputs.segment_ids.shape[1]
        mask = None if inputs.attention_mask is None else inputs.attention_mask[:, -T:]
        inputs.segment_plan = segment_plan(inputs.segment_ids, mask)


def causal_conv1d(u, weight, bias, window=None, silu: bool = True):
    """Depthwise causal conv then SiLU (`silu` False: none, LFM2's short conv). u [B, T, C]; weight [C, 1, K]
    (nn.Conv1d's); window [B, C, K-1] the inputs before u (None: zeros) -> (y [B, T, C], the new window [B, C, K-1])."""
    B, T, C = u.shape
    K = weight.shape[-1]
    if window is None:
        window = u.new_zeros(B, C, K - 1)
    x = torch.cat([window.to(u.dtype), u.transpose(1, 2)], dim=-1)  # [B, C, K-1+T]
    y = F.conv1d(x, weight, bias, groups=C)  # [B, C, T]
    return (F.silu(y) if silu else y).transpose(1, 2), x[:, :, x.shape[-1] - (K - 1):]


def wide(t):
    """t in fp32, or in fp64 where it is (the scans run in fp32 at least; fp64 checks them)."""
    return t if t.dtype == torch.float64 else t.float()


class GatedRMSNorm(nn.Module):
    """The recurrent mixers' output norm, gated by z, with a weight over the last dim; computed wide (fp32).
    Each reference orders and rounds it its own way, and the parity tests hold both:
    gate_first (Mamba-2): RMSNorm(y * silu(z)), rounded to y's dtype, times the weight; with `groups`, over
    each group of channels apart (transformers 5's Mamba-2s, Nemotron-H's: the B/C groups' channels);
    else (Qwen3-Next's Gated DeltaNet): RMSNorm(y) rounded to y's dtype, times the weight, times silu(z) in
    fp32, rounded once at the end."""

    def __init__(self, dim: int, eps: float, gate_first: bool, groups: int = 1):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.gate_first, self.groups = eps, gate_first, groups

    def forward(self, y, z):
        if self.gate_first:  # groups > 1: each group of dim / groups channels over its own root mean square
            g = (wide(y) * F.silu(wide(z))).unflatten(-1, (self.groups, -1))
            return self.weight * rms_normalized(g, self.eps).flatten(-2).to(y.dtype)
        h = self.weight * rms_normalized(wide(y), self.eps).to(y.dtype)
        return (h * F.silu(wide(z))).to(y.dtype)


def masked(x, mask):
    """x [B, T, ...] with padded positions (mask 0) zeroed; mask None: x."""
    if mask is None:
        return x
    return (x * mask.reshape(*mask.shape, *([1] * (x.dim() - 2)))).to(x.dtype)


def pad_to_chunks(x, chunk: int, dim: int = 1):
    """Zero-pad `dim` of x to a multiple of `chunk` (zeros: no input, no decay, so no state change)."""
    pad = -x.shape[dim] % chunk
    if pad == 0:
        return x
    widths = [0, 0] * (x.dim() - dim - 1) + [0, pad]
    return F.pad(x, widths)


class SegmentPlan(NamedTuple):
    """Where packed rows' prompts and candidates sit (device index tensors), for `run_segments`."""
    rows: torch.Tensor  # [B, P] each prompt column's row
    src: torch.Tensor  # [B, P] its position in the row (prompts right-aligned; clamped where p_mask is False)
    p_mask: torch.Tensor  # [B, P] a real prompt position
    c_rows: torch.Tensor | None  # [N, L] each candidate piece's row (None: no candidates)
    cols: torch.Tensor | None  # [N, L] its positions (clamped where c_mask is False)
    c_mask: torch.Tensor | None  # [N, L] a real candidate position
    piece_row: torch.Tensor | None  # [N] the row whose prompt state each piece starts from
    p_at: tuple  # ([n], [n]) the (row, column) of each real prompt position in the [B, P] layout
    c_at: tuple | None  # ([m], [m]) the (piece, column) of each real candidate position in the [N, L] layout


def segment_plan(segment_ids, attention_mask=None) -> SegmentPlan:
    """segment_ids [B, T] (the prompt, segment 0, first in each row, then candidates 1, 2, ...) and padding
    -> the layout `run_segments` gathers by, read on the host (one device sync)."""
    B, T = segment_ids.shape
    dev = segment_ids.device
    if attention_mask is None:
        seg = segment_ids.cpu()
        ok = torch.ones_like(seg, dtype=torch.bool)
    else:  # both in one copy to the host
        seg, ok = torch.stack((segment_ids, attention_mask.to(segment_ids.dtype))).cpu()
        ok = ok.bool()
    prompt_len = ((seg == 0) & ok).sum(1)  # [B]
    P = int(prompt_len.max())
    # prompts, right-aligned: column j of row r holds position j - (P - P_r)
    src = torch.arange(P)[None, :] - (P - prompt_len)[:, None]  # [B, P]
    p_mask = src >= 0
    rows = torch.arange(B)[:, None].expand(B, P)
    pieces = [(r, int(s)) for r in range(B) for s in torch.unique(seg[r][ok[r]]) if s > 0]
    p_at = tuple(i.to(dev) for i in p_mask.nonzero().unbind(1))
    if not pieces:
        return SegmentPlan(rows.to(dev), src.clamp(min=0).to(dev), p_mask.to(dev), None, None, None, None, p_at, None)
    # candidates: one piece each, left-aligned, starting from its row's prompt state
    starts, lengths = [], []
    for r, s in pieces:
        cols = ((seg[r] == s) & ok[r]).nonzero()[:, 0]
        starts.append(int(cols[0])), lengths.append(len(cols))
    L = max(lengths)
    piece_row = torch.tensor([r for r, _ in pieces])
    cols = torch.tensor(starts)[:, None] + torch.arange(L)[None, :]  # [N, L]
    c_mask = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]
    c_rows = piece_row[:, None].expand_as(cols)
    c_at = tuple(i.to(dev) for i in c_mask.nonzero().unbind(1))
    return SegmentPlan(rows.to(dev), src.clamp(min=0).to(dev), p_mask.to(dev), c_rows.to(dev),
                       cols.clamp(max=T - 1).to(dev), c_mask.to(dev), piece_row.to(dev), p_at, c_at)


def run_segments(sequence, u, plan: SegmentPlan):
    """Packed rows (module docstring). u [B, T, F] the sequential part's input, laid out by `plan`
    -> y [B, T, F'] (zeros at padding)."""
    B, T, _ = u.shape
    out, state = None, None
    if plan.rows.shape[1]:  # prompts (none in packed examples' rows)
        u_p = masked(u[plan.rows, plan.src], plan.p_mask)
        y_p, state = sequence(u_p, plan.p_mask, None)
        out = y_p.new_zeros(B, T, y_p.shape[-1])  # y's dtype: fp32 where autocast runs the scan wide (Mamba-2)
        b, j = plan.p_at
        out[plan.rows[b, j], plan.src[b, j]] = y_p[b, j]
    if plan.c_rows is None:
        return out
    u_c = masked(u[plan.c_rows, plan.cols], plan.c_mask)
    start = None if plan.rows.shape[1] == 0 else state.select(plan.piece_row)  # packed examples: a fresh state
    y_c, _ = sequence(u_c, plan.c_mask, start)
    out = y_c.new_zeros(B, T, y_c.shape[-1]) if out is None else out
    n, l = plan.c_at
    out[plan.c_rows[n, l], plan.cols[n, l]] = y_c[n, l]
    return out
