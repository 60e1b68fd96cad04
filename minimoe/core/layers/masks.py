"""The attention masks the model builds once per forward and hands to every mixer (core/token_mixers/mixers.py).

A mask is made per kind of attention pattern among the layers (`MaskKind`: full causal, a sliding
window, or chunked local attention), as a bool [B, 1, T, S] tensor (`bool_mask`: SDPA on every
backend) or a FlexAttention BlockMask (`block_mask`: opt-in, model.FLEX_DEVICES, no KV cache). Both
follow one rule: causal; within segment (packed answer choices: a token sees the shared prefix, segment 0, and its
own segment); within the window or chunk; onto real keys (not padding); and every query onto itself,
so that a padding query keeps SDPA finite (real queries see themselves already).

Decisions, for parity with transformers 4.57 (masking_utils.py):
- Sliding window: a query sees the last `size` positions, itself included, counted in absolute
  indices, as transformers does; packed rows count in their `position_ids`, each candidate's own,
  so that a packed candidate sees what it sees alone.
- Chunked (Llama 4's `attention_chunk_size`): a query sees the keys of its own chunk. Chunks are
  counted from the first real token (transformers subtracts each row's left padding); packed rows
  count in their `position_ids`.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode


class MaskKind(NamedTuple):
    """The pattern a layer's attention needs: window (sliding) or chunk (local) size, None for neither."""
    window: int | None = None
    chunk: int | None = None


_KINDS: dict = {}


def mask_kind(window: int | None = None, chunk: int | None = None) -> MaskKind:
    """The one MaskKind object of this pattern: layers share it, so that a compiled layer's lookup of its mask
    (dynamo guards a dict key by identity) holds for every layer of the pattern, with no recompile."""
    kind = MaskKind(window, chunk)
    return _KINDS.setdefault(kind, kind)


FULL = mask_kind()


def left_padding(attention_mask, B: int, device):
    """[B]: the padding positions before each row's first real token (0 without a mask)."""
    if attention_mask is None:
        return torch.zeros(B, dtype=torch.long, device=device)
    return (attention_mask.cumsum(-1) == 0).sum(-1)


def bool_mask(attention_mask, B, T, start, device, segment_ids=None, kind: MaskKind = FULL, position_ids=None):
    """None (plain causal, SDPA's fast path) or a bool [B, 1, T, S] mask by the module's rule;
    `start` positions are already in the KV cache (S = start + T)."""
    window, chunk = kind
    if attention_mask is None and segment_ids is None and start == 0 and window is None and chunk is None:
        return None
    S = start + T
    q_pos = torch.arange(start, S, device=device)[:, None]
    k_pos = torch.arange(S, device=device)[None, :]
    allowed = k_pos <= q_pos  # [T, S] causal
    if window is not None and segment_ids is None:
        allowed = allowed & (q_pos - k_pos < window)
    allowed = allowed[None, None].expand(B, 1, T, S)
    if chunk is not None and segment_ids is None:
        pad = left_padding(attention_mask, B, device)[:, None, None]  # [B, 1, 1]
        same = (q_pos[None] - pad) // chunk == (k_pos[None] - pad) // chunk  # [B, T, S]
        allowed = allowed & same[:, None]
    if segment_ids is not None:
        if start != 0 or segment_ids.shape != (B, T):
            raise ValueError(f"segment_ids has shape {tuple(segment_ids.shape)} with {start} cached positions; "
                             f"expected {(B, T)} and no KV cache")
        seg_q, seg_k = segment_ids[:, :, None], segment_ids[:, None, :]  # [B, T, 1], [B, 1, S]
        allowed = allowed & ((seg_k == 0) | (seg_k == seg_q))[:, None]
        if window is not None or chunk is not None:  # in each candidate's own positions
            pos_q, pos_k = position_ids[:, :, None], position_ids[:, None, :]
            if window is not None:
                allowed = allowed & (pos_q - pos_k < window)[:, None]
            if chunk is not None:
                allowed = allowed & (pos_q // chunk == pos_k // chunk)[:, None]
    if attention_mask is not None:
        if attention_mask.shape != (B, S):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; expected {(B, S)}")
        allowed = allowed & attention_mask.bool()[:, None, None, :]
        allowed = allowed | (torch.arange(S, device=device)[None, :] == q_pos)[None, None]
    return allowed


def block_mask(attention_mask, segment_ids, B: int, T: int, kind: MaskKind = FULL, position_ids=None):
    """`bool_mask`'s rule (no cache) as a FlexAttention BlockMask, which skips fully masked blocks. Opt-in:
    on an H200 with torch 2.11, SDPA ran packed GQA rows' bool mask on cuDNN, 2.3x faster than compiled
    flex at 8 x 512 (model.FLEX_DEVICES says where it runs)."""
    window, chunk = kind
    device = (segment_ids if segment_ids is not None else attention_mask).device
    pad = left_padding(attention_mask, B, device)

    def allowed(b, h, q, k):
        ok = k <= q
        if window is not None:
            ok = ok & ((q - k if segment_ids is None else position_ids[b, q] - position_ids[b, k]) < window)
        if chunk is not None:
            ok = ok & ((q - pad[b]) // chunk == (k - pad[b]) // chunk if segment_ids is None else
                       position_ids[b, q] // chunk == position_ids[b, k] // chunk)
        if segment_ids is not None:
            ok = ok & ((segment_ids[b, k] == 0) | (segment_ids[b, k] == segment_ids[b, q]))
        if attention_mask is not None:
            ok = (ok & attention_mask[b, k].bool()) | (k == q)
        return ok
    from torch.nn.attention.flex_attention import create_block_mask  # imports dynamo (2 s): only where used
    return create_block_mask(allowed, B, None, T, T, device=device)


FLEX_MIN_HEAD_DIM = 16  # inductor's flex kernel refuses smaller heads ("must be at least 16")


def flex_applies() -> bool:
    """False under a user's TorchDispatchMode (a FLOP counter, bench/common.py's HostSyncs): dynamo will not
    compile flex there, and in torch 2.11 the eager fallback failed and left every later compiled flex call
    failing in that process (seen on an H200). SDPA's bool mask serves those forwards instead."""
    return not is_in_torch_dispatch_mode(include_infra_modes=False)


@functools.cache
def flex(compiled: bool):
    """flex_attention, compiled where it runs for speed (CUDA): uncompiled it is torch's unfused reference,
    which builds the scores it exists to avoid. Imported here, not at the top: it imports dynamo (2 s).
    Shapes are dynamic after the first recompile: rows change length from batch to batch, and with
    dynamic=False each new length compiled anew until dynamo's limit of 8 sent flex to its eager path."""
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention) if compiled else flex_attention
