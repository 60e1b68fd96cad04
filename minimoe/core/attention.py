"""GQA attention, the mixer of every family but DeepSeek's (core/mla.py) and the hybrids' state layers.

Letters: B batch, T query positions, S key positions, D hidden, H query heads, G key/value heads, d head dim.

One class, its options read from config fields (never the family's name):
- q/k RMSNorm over the whole projection width before the head split (OLMoE, `qk_norm="full"`) or per
  head (Qwen3, `"head"`); clip_qkv (OLMoE) after it;
- biases on q, k, v and o (`attention_bias`) or on q, k, v only (`qkv_bias`);
- sinks (gpt-oss, core/sinks.py);
- rope on every head dim, on the first `partial_rotary_factor` of them (Qwen3-Next), or none (NoPE:
  Granite 4.0-H's `position_embedding_type` other than "rope");
- a gated output (Qwen3-Next, `attn_output_gate`): q_proj is twice as wide, each head's [query | gate],
  and the attention output is scaled by sigmoid(gate) before o_proj;
- a sliding window per layer (`config.window(i)`): the mask the model builds for its `MaskKind`
  (core/masks.py).

Decisions:
- Query head h reads key/value head h // (H/G), transformers' repeat_interleave layout, via SDPA's
  enable_gqa. The readable path is SDPA with a bool mask; a FlexAttention BlockMask (CUDA, packed or
  padded rows, `takes_block_mask`) runs the fused kernel instead.
- The KV cache slot (`KVSlot`) is preallocated [B, G, S_max, d] per layer and filled left to right.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from minimoe.core.masks import MaskKind, flex
from minimoe.core.norms import RMSNorm
from minimoe.core.rope import apply_rope
from minimoe.core.sinks import sink_attention


class KVSlot:
    """One attention layer's cache: keys [B, G, S_max, dk] and values [B, G, S_max, dv], filled left to right."""

    def __init__(self, batch_size: int, heads: int, max_len: int, dk: int, dv: int, dtype, device):
        self.k = torch.zeros(batch_size, heads, max_len, dk, dtype=dtype, device=device)
        self.v = torch.zeros(batch_size, heads, max_len, dv, dtype=dtype, device=device)

    def update(self, start: int, k, v):  # k, v [B, G, T, d] at positions start.. -> all so far [B, G, S, d]
        end = start + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache holds {self.k.shape[2]} positions; {end} were asked for")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


def rotate(x, cos, sin):
    """Rope on the first cos.shape[-1] dims of each head (all of them, or a partial rotary's part)."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)


class Attention(nn.Module):
    attribute = "self_attn"  # the layer's attribute, hence the checkpoint's name (model.layers.i.self_attn.*)

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        H, G, d, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.hidden_size
        qkv_bias = config.attention_bias or config.qkv_bias
        self.gated = config.attn_output_gate  # each head's q_proj rows: [query d | gate d]
        self.q_proj = nn.Linear(D, H * d * (2 if self.gated else 1), bias=qkv_bias)
        self.k_proj = nn.Linear(D, G * d, bias=qkv_bias)
        self.v_proj = nn.Linear(D, G * d, bias=qkv_bias)
        self.o_proj = nn.Linear(H * d, D, bias=config.attention_bias)
        if config.qk_norm:  # OLMoE: over the whole projection width, before the head split; Qwen3: per head
            width = {"full": (H * d, G * d), "head": (d, d)}[config.qk_norm]
            self.q_norm = RMSNorm(width[0], config.rms_norm_eps, zero_centred=config.norm_zero_centred)
            self.k_norm = RMSNorm(width[1], config.rms_norm_eps, zero_centred=config.norm_zero_centred)
        if config.attention_sinks:  # gpt-oss: one logit per head in every softmax (core/sinks.py)
            self.sinks = nn.Parameter(torch.zeros(H))
        self.mask_kind = MaskKind(window=config.window(layer_idx))
        self.takes_block_mask = not config.attention_sinks  # sinks add a key column: a bool mask only

    @staticmethod
    def cache_slot(config, layer_idx: int, batch_size: int, max_len: int, dtype, device) -> KVSlot:
        G, d = config.num_key_value_heads, config.head_dim
        return KVSlot(batch_size, G, max_len, d, d, dtype, device)

    def forward(self, x, inputs, cache: KVSlot | None = None):  # x [B, T, D], inputs: mixers.MixerInputs
        c = self.config
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.gated:
            q, gate = q.view(B, T, c.num_attention_heads, 2 * c.head_dim).chunk(2, dim=-1)  # [B, T, H, d] each
        q = q.reshape(B, T, c.num_attention_heads, c.head_dim)  # [B, T, H, d]
        k = k.view(B, T, c.num_key_value_heads, c.head_dim)  # [B, T, G, d]
        if c.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        elif c.qk_norm == "full":
            q, k = self.q_norm(q.flatten(2)).view_as(q), self.k_norm(k.flatten(2)).view_as(k)
        if c.clip_qkv is not None:
            q, k, v = (t.clamp(-c.clip_qkv, c.clip_qkv) for t in (q, k, v))
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, T, d], [B, G, T, d]
        v = v.view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        if c.position_embedding_type == "rope":
            q, k = rotate(q, inputs.cos, inputs.sin), rotate(k, inputs.cos, inputs.sin)
        if cache is not None:
            k, v = cache.update(inputs.cache_start, k, v)  # [B, G, S, d]
        y = self.attend(q, k, v, inputs.masks[self.mask_kind]).transpose(1, 2)  # [B, T, H, d]
        if self.gated:
            y = y * torch.sigmoid(gate)
        return self.o_proj(y.reshape(B, T, -1))

    def attend(self, q, k, v, mask):  # q [B, H, T, d], k/v [B, G, S, d], mask bool or None -> [B, H, T, d]
        if self.config.attention_sinks:
            return sink_attention(q, k, v, self.sinks, mask, self.config.attention_scale)
        if mask is not None and not isinstance(mask, torch.Tensor):  # a BlockMask on CUDA: a fused kernel
            return flex(q.is_cuda)(q, k, v, block_mask=mask, scale=self.config.attention_scale, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              scale=self.config.attention_scale, enable_gqa=True)
