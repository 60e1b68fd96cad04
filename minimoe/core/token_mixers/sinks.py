"""gpt-oss attention sinks: a learned logit per head in every softmax (its sliding-window layers are
the model's window masks, core/layers/masks.py).

Letters: B batch, H query heads, G key/value heads, T query positions, S key positions, d head dim.

A sink is one more entry in each query's softmax, with logit `sinks[h]` and no value: attention
weights become exp(s_j) / (sum_j exp(s_j) + exp(sinks[h])), so a head may attend to nothing
(transformers 4.57's modeling_gpt_oss.py, `eager_attention_forward`).

Decisions:
- The sink runs inside SDPA as one extra key with a zero value: q gains a last coordinate
  sinks[h] / scale and keys a 0 there, the sink key a 1 there and zeros elsewhere, so its logit is
  scale * (sinks[h] / scale) = sinks[h] for each query head (GQA included: the per-head part sits
  in q). The division by the scale is exact when the scale is a power of two (gpt-oss: head_dim 64,
  scale 1/8); otherwise it is one rounding of the sink logit. The sink's column is always allowed,
  so a sink layer always passes an explicit mask (never SDPA's is_causal).
- Values may be narrower than keys (MiMo-V2-Flash: dv 128 beside d 192); the sink's value row is dv zeros.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_mask(T: int, S: int, start: int, device):
    """bool [1, 1, T, S]: query start+i sees keys 0..start+i."""
    q_pos = torch.arange(start, start + T, device=device)[:, None]
    return (torch.arange(S, device=device)[None, :] <= q_pos)[None, None]


def sink_attention(q, k, v, sinks, mask, scale: float):
    """q [B, H, T, d], k [B, G, S, d], v [B, G, S, dv], sinks [H], mask bool [B|1, 1, T, S] or None (causal)
    -> [B, H, T, dv]."""
    B, H, T, d = q.shape
    G, S = k.shape[1], k.shape[2]
    if mask is None:
        mask = causal_mask(T, S, S - T, q.device)
    sink_q = (sinks.float() / scale).to(q.dtype)[None, :, None, None].expand(B, H, T, 1)
    q = torch.cat((q, sink_q), dim=-1)  # [B, H, T, d+1]
    k = torch.cat((k, k.new_zeros(B, G, S, 1)), dim=-1)  # [B, G, S, d+1]
    sink_k = k.new_zeros(B, G, 1, d + 1)
    sink_k[..., -1] = 1
    k = torch.cat((k, sink_k), dim=2)  # [B, G, S+1, d+1]
    v = torch.cat((v, v.new_zeros(B, G, 1, v.shape[-1])), dim=2)  # [B, G, S+1, dv]: the sink adds nothing
    mask = torch.cat((mask, mask.new_ones(*mask.shape[:-1], 1)), dim=-1)  # [B|1, 1, T, S+1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
