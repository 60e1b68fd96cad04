"""GQA attention, the mixer of every family but DeepSeek's (core/token_mixers/mla.py) and the hybrids' state layers.

Letters: B batch, T query positions, S key positions, D hidden, H query heads, G key/value heads, d head dim.

One class, its options read from config fields (never the family's name): the model's shared ones (heads,
head_dim, biases, windows, rope) and its own, `AttentionConfig` (MoEConfig.mixers["attention"]):
- q/k RMSNorm over the whole projection width before the head split (OLMoE, FlexOlmo: `qk_norm="full"`)
  or per head (Qwen3, GLM: `"head"`), before rope; clip_qkv (OLMoE) after it; or Llama 4's L2 norm per
  head without a weight (`"l2"`), after rope and on rope layers only;
- biases on q, k, v and o (`attention_bias`) or on q, k, v only (`qkv_bias`: Qwen2-MoE, GLM);
- sinks (gpt-oss, core/token_mixers/sinks.py);
- a sliding window (`config.window(i)`) or a local chunk (`attention_chunk_size`, on Llama 4's
  "chunked_attention" layers) per layer: the mask the model builds for its `MaskKind` (core/layers/masks.py);
- rope on the first `rope_dim` dims of each head only (GLM's partial_rotary_factor), in halves or in
  interleaved pairs (`rope_interleave`: Llama 4, whose reference rotates complex pairs), or on no dims
  (a NoPE layer of Llama 4's `no_rope_layers`), where `attn_temperature_tuning` scales q by
  1 + attn_scale * log1p(floor((p + 1) / floor_scale)).
- a gated output (Qwen3-Next, `attn_output_gate`): q_proj is twice as wide, each head's [query | gate],
  and the attention output is scaled by sigmoid(gate) before o_proj; no rope on any layer where
  `position_embedding_type` is not "rope" (Granite 4.0-H's "nope");
- q/k norms zero-centred (1 + w) where the config says (Qwen3-Next, `norm_zero_centred`).
- Gemma 4's global layers: full-attention layers with their own head width (`global_head_dim`) and, where keys are
  values (`attention_k_eq_v`: no v_proj, v is k's projection before its norm and rope), their own key/value head
  count (`num_global_key_value_heads`); a weightless RMSNorm on v (`v_norm`); a rope per layer type
  (MoEConfig.rope_parameters: `MixerInputs.ropes`).
- MiMo-V2-Flash: sliding layers with `sliding_kv_factor` times the key/value heads and the sinks alone
  (`sinks_sliding_only`); values `value_head_dim` wide, apart from the keys' head_dim (o_proj reads H * that), and
  scaled by `attention_value_scale` after v_proj; a rope per layer type turning each head's first
  partial_rotary_factor (`layer_rope_partial`, rope.layer_type_frequencies).

Decisions:
- Query head h reads key/value head h // (H/G), transformers' repeat_interleave layout, via SDPA's
  enable_gqa. The readable path is SDPA with a bool mask; a FlexAttention BlockMask (CUDA, packed or
  padded rows, `takes_block_mask`) runs the fused kernel instead.
- Interleaved pairs are reordered to rotate-half's layout before the rotation (rope.deinterleave), on
  q and k alike: every q.k product, hence attention, is unchanged, and the cache holds the reordered k.
- Temperature tuning's position p is the token's index in the row (cache included), as transformers'
  cache_position; packed rows (segment_ids) use their position_ids, each candidate's own, so that a
  packed candidate scores as it does alone.
- The KV cache slot (`KVSlot`) is preallocated [B, G, S_max, d] per layer and filled left to right.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from minimoe.core.layers.masks import FLEX_MIN_HEAD_DIM, flex, mask_kind
from minimoe.core.layers.norms import RMSNorm
from minimoe.core.layers.rope import apply_rope, deinterleave, layer_rope_dim, query_temperature
from minimoe.core.token_mixers.sinks import sink_attention


QK_NORMS = (None, "full", "head", "l2")


@dataclass
class AttentionConfig:
    """GQA attention's own options, by the config.json names of the families that brought them."""
    qk_norm: str | None = None  # on q and k: RMSNorm "full" over the projection width (OLMoE), "head" per head
    # (Qwen3, GLM), or "l2" per head without a weight, after rope, on rope layers only (Llama 4)
    use_qk_norm: bool = True  # the config.json switch of a family whose q/k norm is optional (GLM, Llama 4); False: none
    clip_qkv: float | None = None  # OLMoE: clamp q, k, v to [-c, c] after projection (and q/k norm)
    qkv_bias: bool = False  # biases on q, k and v only (Qwen2-MoE); MoEConfig.attention_bias: on o too
    attention_sinks: bool = False  # a learned logit per head joins every softmax, with no value (gpt-oss)
    attn_output_gate: bool = False  # q_proj also gives a per-head gate; output * sigmoid(gate) (Qwen3-Next)
    position_embedding_type: str | None = "rope"  # anything else: no rope (Granite 4.0-H's "nope")
    no_rope_layers: list | None = None  # per layer 1 = rope, 0 = NoPE (Llama 4's name and values); None: rope everywhere
    no_rope_layer_interval: int | None = None  # no_rope_layers empty or None: every n-th layer NoPE (Llama 4's rule)
    attention_chunk_size: int | None = None  # "chunked_attention" layers see their own chunk only (Llama 4; with no
    # layer_types the rope layers are chunked, the NoPE ones full, as Llama4TextConfig fills them in)
    # Llama 4's attention temperature on NoPE layers: q times 1 + attn_scale * log1p(floor((pos + 1) / floor_scale))
    attn_temperature_tuning: bool = False
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    # Gemma 4: its full_attention layers' head width and, where keys are values, key/value heads (None: the model's)
    global_head_dim: int | None = None
    num_global_key_value_heads: int | None = None
    attention_k_eq_v: bool = False  # full_attention layers have no v_proj: v is k_proj's output, v-normed (Gemma 4)
    v_norm: bool = False  # v over its RMS per head, without a weight (Gemma 4)
    # MiMo-V2-Flash: its sliding layers' key/value heads are this many times num_key_value_heads, and carry the sinks
    sliding_kv_factor: int = 1
    sinks_sliding_only: bool = False  # with attention_sinks: on the sliding layers only (MiMo-V2-Flash)
    value_head_dim: int | None = None  # each head's value width where it is not head_dim (MiMo-V2-Flash's v_head_dim)
    attention_value_scale: float | None = None  # v times this after v_proj (MiMo-V2-Flash); None: 1
    # a rope per layer type (rope_parameters) with "default" entries turning the first partial_rotary_factor of each
    # head, this where an entry gives none (MiMo-V2-Flash: 0.334); None: the whole head whatever it says (Gemma 4)
    layer_rope_partial: float | None = None

    def __post_init__(self):
        if not self.use_qk_norm:
            self.qk_norm = None
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"config: qk_norm {self.qk_norm!r}; expected one of {QK_NORMS}")
        if self.clip_qkv is not None and not (isinstance(self.clip_qkv, (int, float)) and self.clip_qkv > 0):
            raise ValueError(f"config: clip_qkv {self.clip_qkv!r}; expected a number > 0 or null")
        if not (isinstance(self.sliding_kv_factor, int) and self.sliding_kv_factor >= 1):
            raise ValueError(f"config: sliding_kv_factor {self.sliding_kv_factor!r}; expected an int >= 1")
        if self.value_head_dim is not None and not (isinstance(self.value_head_dim, int) and self.value_head_dim >= 1):
            raise ValueError(f"config: value_head_dim {self.value_head_dim!r}; expected an int >= 1 or null")

    def resolve(self, config):
        """Llama 4's derived layers (config: the MoEConfig that holds this one): the NoPE layers from their
        interval, and where config.json gives no layer_types, chunked attention on the rope layers; Gemma 4's
        sliding and global layers where it gives none, and MiMo-V2-Flash's."""
        n = config.num_hidden_layers
        if self.global_head_dim is not None and config.layer_types is None:
            config.layer_types = gemma_layer_types(n)
        if self.sliding_kv_factor > 1 and config.layer_types is None:  # MiMo's rope and heads go by the layer kinds
            config.layer_types = mimo_layer_types(n)
        if self.global_head_dim is not None and config.layer_types[-1] != "full_attention":
            raise ValueError(f"config: layer_types ends with {config.layer_types[-1]!r}; Gemma 4 (global_head_dim) runs "
                             f"its last layer as full_attention whatever the file says: expected it to say so")
        if not self.no_rope_layers and self.no_rope_layer_interval:
            self.no_rope_layers = [int((i + 1) % self.no_rope_layer_interval != 0) for i in range(n)]
        if self.no_rope_layers is not None and len(self.no_rope_layers) < n:
            raise ValueError(f"config: no_rope_layers has {len(self.no_rope_layers)} entries; expected at least "
                             f"num_hidden_layers={n}")
        if self.attention_chunk_size and config.layer_types is None and self.no_rope_layers:
            config.layer_types = ["chunked_attention" if self.uses_rope(i) else "full_attention" for i in range(n)]
        if config.layer_types is not None and "chunked_attention" in config.layer_types and not self.attention_chunk_size:
            raise ValueError("config: chunked_attention layers need attention_chunk_size >= 1")

    def global_layer(self, config, layer: int) -> bool:
        """A layer with Gemma 4's global options: a full_attention one of a model that sets global_head_dim."""
        return self.global_head_dim is not None and (config.layer_types or [None] * (layer + 1))[layer] == "full_attention"

    def sliding_layer(self, config, layer: int) -> bool:
        return (config.layer_types or [None] * (layer + 1))[layer] == "sliding_attention"

    def heads(self, config, layer: int) -> tuple[int, int]:
        """(G key/value heads, d head width) of `layer`: the model's (MiMo's sliding layers: sliding_kv_factor times
        its heads), or Gemma 4's global layers' own."""
        if not self.global_layer(config, layer):
            factor = self.sliding_kv_factor if self.sliding_layer(config, layer) else 1
            return config.num_key_value_heads * factor, config.head_dim
        G = self.num_global_key_value_heads if self.attention_k_eq_v and self.num_global_key_value_heads else None
        return G or config.num_key_value_heads, self.global_head_dim

    def value_dim(self, config, layer: int) -> int:  # dv, each value head's width
        return self.value_head_dim or self.heads(config, layer)[1]

    def has_sinks(self, config, layer: int) -> bool:
        return self.attention_sinks and (not self.sinks_sliding_only or self.sliding_layer(config, layer))

    def uses_rope(self, layer: int) -> bool:  # False: Llama 4's NoPE layers, every layer of Granite 4.0-H's "nope"
        return self.position_embedding_type == "rope" and (self.no_rope_layers is None or bool(self.no_rope_layers[layer]))


def gemma_layer_types(n: int) -> list[str]:
    """Gemma4TextConfig's layer_types where config.json gives none: five sliding layers, then a full one; the last full."""
    return ["full_attention" if (i + 1) % 6 == 0 or i == n - 1 else "sliding_attention" for i in range(n)]


def mimo_layer_types(n: int) -> list[str]:
    """MiMoV2FlashConfig's layer_types where config.json gives none: the first layer and every sixth full."""
    return ["full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]


def l2_norm(x, eps: float):
    """x / rms(x) over the last dim, in fp32, cast back: Llama 4's weightless q/k norm."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


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


class Attention(nn.Module):
    attribute = "self_attn"  # the layer's attribute, hence the checkpoint's name (model.layers.i.self_attn.*)
    config_class = AttentionConfig  # its options: MoEConfig.mixers["attention"]

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.options = opts = config.mixers["attention"]
        (G, d), H, D = opts.heads(config, layer_idx), config.num_attention_heads, config.hidden_size
        dv = opts.value_dim(config, layer_idx)
        self.H, self.G, self.d, self.dv = H, G, d, dv
        qkv_bias = config.attention_bias or opts.qkv_bias
        self.gated = opts.attn_output_gate  # each head's q_proj rows: [query d | gate d]
        self.q_proj = nn.Linear(D, H * d * (2 if self.gated else 1), bias=qkv_bias)
        self.k_proj = nn.Linear(D, G * d, bias=qkv_bias)
        self.k_is_v = opts.attention_k_eq_v and opts.global_layer(config, layer_idx)  # Gemma 4: no v_proj
        if not self.k_is_v:
            self.v_proj = nn.Linear(D, G * dv, bias=qkv_bias)
        self.o_proj = nn.Linear(H * dv, D, bias=config.attention_bias)
        self.rope = opts.uses_rope(layer_idx)  # False: a NoPE layer (Llama 4; every layer of Granite 4.0-H's nope)
        # a rope per layer type (Gemma 4, MiMo) turns its frequencies' dims (rope.layer_type_frequencies), else rope_dim
        self.rope_kind = config.layer_types[layer_idx] if config.rope_parameters else None
        self.rope_dim = (layer_rope_dim(config.rope_parameters[self.rope_kind], d, opts.layer_rope_partial)
                         if self.rope_kind else config.rope_dim) if self.rope else 0
        self.qk_norm = opts.qk_norm if opts.qk_norm != "l2" or self.rope else None  # Llama 4: rope layers only
        if self.qk_norm in ("full", "head"):  # OLMoE: over the whole projection width, before the head split; Qwen3: per head
            width = {"full": (H * d, G * d), "head": (d, d)}[opts.qk_norm]
            self.q_norm = RMSNorm(width[0], config.rms_norm_eps, config.norm_weight_in_fp32, config.norm_zero_centred)
            self.k_norm = RMSNorm(width[1], config.rms_norm_eps, config.norm_weight_in_fp32, config.norm_zero_centred)
        self.temperature = opts.attn_temperature_tuning and not self.rope
        self.has_sinks = opts.has_sinks(config, layer_idx)
        if self.has_sinks:  # gpt-oss: one logit per head in every softmax (core/token_mixers/sinks.py)
            self.sinks = nn.Parameter(torch.zeros(H))
        chunked = config.layer_types is not None and config.layer_types[layer_idx] == "chunked_attention"
        self.mask_kind = mask_kind(window=config.window(layer_idx), chunk=opts.attention_chunk_size if chunked else None)
        # Sinks add a key column: a bool mask only. Inductor's flex kernel takes head dims of 16 or more (torch
        # 2.11 refused a tiny Mixtral's 12 on an H200): smaller heads keep SDPA's bool mask, as do values of another
        # width than the keys (MiMo: transformers runs no flex kernel on them either).
        self.takes_block_mask = not self.has_sinks and d >= FLEX_MIN_HEAD_DIM and dv == d

    @staticmethod
    def cache_slot(config, layer_idx: int, batch_size: int, max_len: int, dtype, device) -> KVSlot:
        opts = config.mixers["attention"]
        G, d = opts.heads(config, layer_idx)
        return KVSlot(batch_size, G, max_len, d, opts.value_dim(config, layer_idx), dtype, device)

    def forward(self, x, inputs, cache: KVSlot | None = None):  # x [B, T, D], inputs: mixers.MixerInputs
        c, H, G, d = self.config, self.H, self.G, self.d
        B, T, _ = x.shape
        q, k = self.q_proj(x), self.k_proj(x)
        v = k if self.k_is_v else self.v_proj(x)  # Gemma 4's global layers: keys are values (before k's norm)
        if self.gated:
            q, gate = q.view(B, T, H, 2 * d).chunk(2, dim=-1)  # [B, T, H, d] each
        q = q.reshape(B, T, H, d)  # [B, T, H, d]
        k = k.view(B, T, G, d)  # [B, T, G, d]
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        elif self.qk_norm == "full":
            q, k = self.q_norm(q.flatten(2)).view_as(q), self.k_norm(k.flatten(2)).view_as(k)
        clip = self.options.clip_qkv
        if clip is not None:
            q, k, v = (t.clamp(-clip, clip) for t in (q, k, v))
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, T, d], [B, G, T, d]
        v = v.view(B, T, G, self.dv)
        if self.options.attention_value_scale is not None:  # MiMo: after v_proj, in the model dtype as transformers
            v = v * self.options.attention_value_scale
        if self.options.v_norm:  # Gemma 4: over each head's RMS, no weight (Llama 4's l2_norm computes it)
            v = l2_norm(v, c.rms_norm_eps)
        v = v.transpose(1, 2)  # [B, G, T, d]
        if self.rope:
            q, k = self.rotate(q, inputs), self.rotate(k, inputs)
        if self.qk_norm == "l2":
            q, k = l2_norm(q, c.rms_norm_eps), l2_norm(k, c.rms_norm_eps)
        if self.temperature:
            q = self.temper(q, inputs)
        if cache is not None:
            k, v = cache.update(inputs.cache_start, k, v)  # [B, G, S, d]
        y = self.attend(q, k, v, inputs.masks[self.mask_kind]).transpose(1, 2)  # [B, T, H, dv]
        if self.gated:
            y = y * torch.sigmoid(gate)
        return self.o_proj(y.reshape(B, T, -1))

    def rotate(self, x, inputs):  # x [B, h, T, d] -> rope on its first rope_dim dims (all of them but GLM's)
        r = self.rope_dim
        cos, sin = inputs.ropes[self.rope_kind] if self.rope_kind else (inputs.cos, inputs.sin)
        turned, kept = x[..., :r], x[..., r:]
        if self.config.rope_interleave:
            turned = deinterleave(turned)
        if self.config.rope_in_fp32:  # cos, sin are fp32 then (model.mixer_inputs)
            turned = apply_rope(turned.float(), cos, sin).to(x.dtype)
        else:
            turned = apply_rope(turned, cos, sin)
        return turned if r == x.shape[-1] else torch.cat((turned, kept), dim=-1)

    def temper(self, q, inputs):  # q [B, H, T, d] -> q * (1 + attn_scale * log1p(floor((p + 1) / floor_scale)))
        c = self.options
        scale = query_temperature(inputs, q.shape[0], q.shape[2], c.floor_scale, c.attn_scale, 1.0, q.device)
        return (q * scale).to(q.dtype)  # in fp32, as the reference

    def attend(self, q, k, v, mask):  # q [B, H, T, d], k [B, G, S, d], v [B, G, S, dv], mask bool or None -> [B, H, T, dv]
        if self.has_sinks:
            return sink_attention(q, k, v, self.sinks, mask, self.config.attention_scale)
        if mask is not None and not isinstance(mask, torch.Tensor):  # a BlockMask on CUDA: a fused kernel
            return flex(q.is_cuda)(q, k, v, block_mask=mask, scale=self.config.attention_scale, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              scale=self.config.attention_scale, enable_gqa=True)
