"""Multi-head Latent Attention (DeepSeek-V2 and V3): low-rank queries and keys/values, rope and no-rope parts.

Letters: B batch, T query positions, S key positions, D hidden, H heads, Q q_lora_rank,
C kv_lora_rank, n qk_nope_head_dim, r qk_rope_head_dim, v v_head_dim.

Each head's query and key are [no-rope part n | rope part r]; values are v wide.
- q: D -> Q (q_a_proj) -> RMSNorm -> H*(n+r) (q_b_proj); with q_lora_rank null (V2-Lite) one q_proj.
- kv: D -> C + r (kv_a_proj_with_mqa). The C part is normed (kv_a_layernorm) and expanded to every
  head's no-rope key and value, H*(n+v) (kv_b_proj). The r part is ONE rope key shared by all heads.
- Softmax scale: (n+r)^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 (core/layers/rope.py).
- Mistral 4 scales the query by position past YaRN's original context (llama_4_scaling_beta; rope.query_temperature).
  Kimi Linear's MLA turns nothing (`mla_nope`): its "rope" dims pass as they are.

Decisions, for parity with transformers 4.57 (modeling_deepseek_v2.py, modeling_deepseek_v3.py):
- q_a_layernorm and kv_a_layernorm use eps 1e-6 whatever rms_norm_eps says: both references build
  them with their RMSNorm's default (DeepSeek's own modeling code does the same).
- The rope part is stored in interleaved pairs; we reorder it to rotate-half's layout before the
  rotation (rope.deinterleave). DeepSeek-V2 always does so; V3 when `rope_interleave` (its default).
  V2's reference rotates complex pairs in place instead: the same rotation, dims in another order,
  the same q.k products.
- The full keys and values are built per head and sent to SDPA (v may be narrower than q/k): the
  readable form. The absorbed form that caches only the C + r latent is an inference optimisation
  we do not need for training; the KV cache holds keys [B, H, S, n+r] and values [B, H, S, v].
- Its options are `MLAConfig` (MoEConfig.mixers["mla"]), by DeepSeek's config.json names; a flat config whose
  kv_lora_rank is set runs MLA in every layer (core/token_mixers/mixers.py's `layer_kinds`).
- DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): where `index_topk` is set, a lightning indexer
  (core/token_mixers/dsa_indexer.py, whose options MLAConfig extends) picks each query's top-k keys and the
  attention mask keeps only those; the cache slot then holds the indexer's keys too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from minimoe.core.token_mixers.attention import KVSlot
from minimoe.core.token_mixers.dsa_indexer import IndexedKVSlot, IndexerConfig, LightningIndexer, causal, keep_selected
from minimoe.core.layers.masks import FULL
from minimoe.core.layers.norms import RMSNorm
from minimoe.core.layers.rope import apply_rope, deinterleave, query_temperature, yarn_softmax_mscale

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: the references' RMSNorm default, not rms_norm_eps


@dataclass
class MLAConfig(IndexerConfig):
    """MLA's low ranks and head parts (the letters of the module docstring), and DSA's indexer's options."""
    kv_lora_rank: int | None = None  # C, the latent every head's no-rope key and value come from
    q_lora_rank: int | None = None  # Q, the query's low rank; None: one q_proj (DeepSeek-V2-Lite)
    qk_nope_head_dim: int = 0  # n, each head's query/key part without rope
    qk_rope_head_dim: int = 0  # r, each head's query/key part with rope (one rope key for all heads)
    v_head_dim: int = 0  # v, each head's value width
    # set: the query scaled by 1 + beta * log(1 + floor(p / YaRN's original_max_position_embeddings)) at position p,
    # Llama 4's scaling as Mistral 4 applies it (its rope_parameters' llama_4_scaling_beta)
    llama_4_scaling_beta: float | None = None
    mla_nope: bool = False  # no rope at all: the r "rope" dims of q and the shared key pass unrotated (Kimi Linear)

    def __post_init__(self):
        super().__post_init__()
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"config: Multi-head Latent Attention's {name} {getattr(self, name)!r}; expected an "
                                 f"int >= 1")
        if self.q_lora_rank is not None and not (isinstance(self.q_lora_rank, int) and self.q_lora_rank >= 1):
            raise ValueError(f"config: q_lora_rank {self.q_lora_rank!r}; expected an int >= 1 or null (one q_proj)")
        if self.llama_4_scaling_beta is not None and not isinstance(self.llama_4_scaling_beta, (int, float)):
            raise ValueError(f"config: llama_4_scaling_beta {self.llama_4_scaling_beta!r}; expected a number or null")

    def resolve(self, config):
        self.check_model(config, self.qk_rope_head_dim, self.q_lora_rank)


class MLAttention(nn.Module):
    """Reads the config.json fields of DeepSeek-V2/V3 by their names; a mixer as attention.Attention is."""
    attribute = "self_attn"  # the checkpoint's name, as attention's
    takes_block_mask = False  # SDPA with a bool mask: v is narrower than q and k
    config_class = MLAConfig  # its options: MoEConfig.mixers["mla"]

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        D, H, mla = config.hidden_size, config.num_attention_heads, config.mixers["mla"]
        n, r, v, C = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim, mla.kv_lora_rank
        self.H, self.n, self.r, self.v, self.C = H, n, r, v, C
        self.q_lora_rank = mla.q_lora_rank
        bias = config.attention_bias
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(D, H * (n + r), bias=False)
        else:
            self.q_a_proj = nn.Linear(D, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(self.q_lora_rank, H * (n + r), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, C + r, bias=bias)
        self.kv_a_layernorm = RMSNorm(C, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(C, H * (n + v), bias=False)
        self.o_proj = nn.Linear(H * v, D, bias=bias)
        self.interleaved = getattr(config, "rope_interleave", None) is not False  # None or absent (DeepSeek-V2): interleaved
        self.scale = (n + r) ** -0.5 * yarn_softmax_mscale(config.rope_scaling)
        self.beta, self.nope = mla.llama_4_scaling_beta, mla.mla_nope
        if self.beta is not None:  # positions are scaled past YaRN's original context
            original = (config.rope_scaling or {}).get("original_max_position_embeddings")
            if not original:
                raise ValueError("config: llama_4_scaling_beta needs rope_scaling's original_max_position_embeddings "
                                 f"(the positions' floor scale); rope_scaling is {config.rope_scaling!r}")
            self.floor_scale = float(original)
        self.mask_kind = FULL  # DeepSeek's layers all attend causally in full
        self.topk_from = mla.source(layer_idx)  # the layer whose indexer picks our keys; None: no DSA
        if self.topk_from == layer_idx:
            self.indexer = LightningIndexer(config, self.q_lora_rank)

    @staticmethod
    def cache_slot(config, layer_idx: int, batch_size: int, max_len: int, dtype, device) -> KVSlot:
        """Every head's full key and value (the readable form, module docstring)."""
        mla = config.mixers["mla"]
        n, r, v = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        if mla.source(layer_idx) == layer_idx:  # its indexer's keys too
            return IndexedKVSlot(batch_size, config.num_attention_heads, max_len, n + r, v, mla.index_head_dim,
                                 dtype, device)
        return KVSlot(batch_size, config.num_attention_heads, max_len, n + r, v, dtype, device)

    def forward(self, x, inputs, cache: KVSlot | None = None):  # x [B, T, D]; inputs.cos, .sin [B, T, r]
        cos, sin = inputs.cos, inputs.sin
        B, T, _ = x.shape
        H, n, r, v = self.H, self.n, self.r, self.v
        q_latent = None if self.q_lora_rank is None else self.q_a_layernorm(self.q_a_proj(x))  # [B, T, Q]
        q = self.q_proj(x) if q_latent is None else self.q_b_proj(q_latent)
        q_pass, q_rot = q.view(B, T, H, n + r).transpose(1, 2).split([n, r], dim=-1)  # [B, H, T, n], [B, H, T, r]
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.C, r], dim=-1)  # [B, T, C], [B, T, r]
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, T, H, n + v).transpose(1, 2)
        k_pass, values = kv.split([n, v], dim=-1)  # [B, H, T, n], [B, H, T, v]
        k_rot = k_rot[:, None]  # [B, 1, T, r]: one rope key for all heads
        if not self.nope:
            if self.interleaved:
                q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
            q_rot, k_rot = apply_rope(q_rot, cos, sin), apply_rope(k_rot, cos, sin)
        q = torch.cat((q_pass, q_rot), dim=-1)  # [B, H, T, n+r]
        if self.beta is not None:  # Mistral 4 casts the fp32 scale to q's dtype first
            q = q * query_temperature(inputs, B, T, self.floor_scale, self.beta, 0.0, q.device).to(q.dtype)
        k = torch.cat((k_pass, k_rot.expand(B, H, T, r)), dim=-1)
        if cache is not None:
            k, values = cache.update(inputs.cache_start, k, values)  # [B, H, S, n+r], [B, H, S, v]
        mask = inputs.masks[self.mask_kind]
        if self.topk_from is not None:  # DSA: only the keys the indexer picks (core/token_mixers/dsa_indexer.py)
            mask = self.sparse_mask(x, q_latent, inputs, mask, cache)
        y = F.scaled_dot_product_attention(q, k, values, attn_mask=mask, is_causal=mask is None,
                                           scale=self.scale)  # [B, H, T, v]
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * v))

    def sparse_mask(self, x, q_latent, inputs, mask, cache):
        """`mask` (None: causal) AND the top-k keys of each query, from this layer's indexer or, on a shared layer,
        from its source layer's (MixerInputs.shared) -> bool [B, 1, T, S]."""
        allowed = mask if mask is not None else causal(x.shape[1], inputs.cache_start, x.device)
        if self.topk_from == self.layer_idx:
            inputs.shared[self.layer_idx] = self.indexer(x, q_latent, inputs.cos, inputs.sin, allowed, cache,
                                                         inputs.cache_start)
        return keep_selected(allowed, inputs.shared[self.topk_from])
