"""The model every family shares: config, attention, the MoE block, causal LM.

Families differ only by config fields (`MoEConfig`; core/families.py maps each family's config.json onto
them) and by small modules switched on by those fields: the routed expert bank (core/experts.py), the
dense MLP of dense layers and shared experts (core/mlp.py), the router's scoring (core/routing.py).
Letters in shape comments: B batch, T query positions, S key positions, D hidden, H query heads,
G key/value heads, d head dim, E experts, K experts per token, I expert width, V vocab, N = T*K rows.

Decisions that matter for parity with `transformers` 4.57 (its modeling files of each family):
- RMSNorm normalises in fp32, casts back to the input dtype, *then* multiplies by its weight.
- Router logits are computed in the model dtype and upcast; softmax and top-K run in fp32 because
  bf16 ties and rounding would change which experts run. The combine weights are cast back to the
  model dtype before they scale expert outputs, as the reference does.
- Granite: top-K on logits then softmax over the K (= full softmax renormalised over the K), the
  attention scale is `attention_multiplier`, and three more multipliers scale the embedding, the
  residual branches and the logits. OLMoE: RMSNorm over the full q/k projection width before the
  head split, optional clip_qkv, and renormalisation of the K weights only when `norm_topk_prob`.
- Routing is a swappable module (`MoEBlock.router`, see minimoe/core/routing.py). It sees the
  pre-expert hidden state and the native affinity logits and returns a `Routing`; every layer's
  `Routing` (logits, selected experts, weights, method readouts) is returned with the logits.
- Packed answer choices (minimoe/core/scoring.py) pass `segment_ids`: the causal mask also hides other
  segments than the shared prefix (0) and the query's own, as a bool SDPA mask (every backend). With
  `logits_at` the LM head runs on the gathered final-normed hidden states only.
- Qwen3: RMSNorm per head on q and k; Qwen2: biases on q, k, v only, and a shared expert scaled by
  sigmoid(w . x); Mixtral and Qwen: an optional sliding window, as a bool mask per window size.
  Dense layers (mlp_only_layers, decoder_sparse_step, first_k_dense_replace) run a dense MLP and
  return no Routing (None in the model output): they are never routed.
- Experts: stacked `[E, out, in]` banks run on token blocks sorted by expert (core/experts.py).
  Under autocast every matmul of a bf16 model runs in bf16, the banks included; nothing in forward or
  backward reads a device value back to the host (no bincount, .item() or boolean indexing).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from minimoe.core.clamped_experts import ClampedSwiGLUExperts
from minimoe.core.densemixer import dense_term
from minimoe.core.experts import Experts
from minimoe.core.families import family_of
from minimoe.core.mlp import DenseMLP
from minimoe.core.rope import apply_rope, rope_cos_sin, rope_frequencies, rope_type
from minimoe.core.routing import SCORE_FUNCS, TOPK_METHODS, NativeRouter, Routing, Scoring
from minimoe.core.sinks import sink_attention


@dataclass
class MoEConfig:
    model_type: str  # a families.FAMILIES key; the family fixes some switches below (Family.fixed)
    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int  # I, width of one expert
    num_hidden_layers: int
    num_attention_heads: int  # H
    num_key_value_heads: int  # G; GQA when G < H
    num_experts: int  # E (Granite calls it num_local_experts)
    num_experts_per_tok: int  # K
    head_dim: int | None = None  # d; None: hidden_size / num_attention_heads (filled in)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    attention_bias: bool = False  # biases on q, k, v and o
    qkv_bias: bool = False  # biases on q, k and v only (Qwen2-MoE)
    use_sliding_window: bool = False  # attend to the last `sliding_window` positions only (Mixtral: always)
    sliding_window: int | None = None
    layer_types: list | None = None  # per layer "sliding_attention" | "full_attention"; None: every layer alike
    tie_word_embeddings: bool = False
    norm_topk_prob: bool = False  # renormalise the K selected weights (Granite's top-K on logits always does)
    clip_qkv: float | None = None  # OLMoE: clamp q, k, v to [-c, c] after projection (and q/k norm)
    qk_norm: str | None = None  # RMSNorm on q and k: "full" over the projection width (OLMoE), "head" per head (Qwen3)
    # Dense layers among the MoE ones: layer i is sparse unless i in mlp_only_layers, (i + 1) % decoder_sparse_step,
    # or i < first_k_dense_replace (Qwen; DeepSeek); a dense layer's MLP is dense_intermediate_size wide.
    mlp_only_layers: list = field(default_factory=list)
    decoder_sparse_step: int = 1
    first_k_dense_replace: int = 0
    dense_intermediate_size: int | None = None
    shared_expert_intermediate_size: int = 0  # > 0: a shared expert of this width beside the routed ones
    shared_expert_gate: bool = False  # the shared expert scaled by sigmoid(w . x) (Qwen2-MoE)
    n_shared_experts: int = 0  # DeepSeek: shared experts of intermediate_size each, run as one of n times the width
    # The router's scoring and selection (routing.Scoring reads these; families.py says who uses which).
    scoring_func: str = "softmax"  # "softmax" | "sigmoid" (DeepSeek-V3)
    topk_on_logits: bool = False  # top-K on the logits, then softmax over the K (Granite, gpt-oss)
    topk_method: str = "greedy"  # greedy | group_limited_greedy (DeepSeek-V2) | noaux_tc (DeepSeek-V3)
    n_group: int = 1  # expert groups for the group-limited methods
    topk_group: int = 1  # groups kept per token
    routed_scaling_factor: float = 1.0  # multiplies the routed experts' weights (DeepSeek)
    router_bias: bool = False  # the gate has a bias (gpt-oss)
    router_fp32: bool = False  # the gate's matmul in fp32, its input upcast (DeepSeek); else the model dtype
    # Attention beyond GQA. gpt-oss: sinks (core/sinks.py); DeepSeek: MLA (core/mla.py).
    attention_sinks: bool = False  # a learned logit per head joins every softmax, with no value
    norm_weight_in_fp32: bool = False  # the layer norms multiply their weight before the cast back (gpt-oss)
    kv_lora_rank: int | None = None  # set: Multi-head Latent Attention, with the four fields below
    q_lora_rank: int | None = None  # MLA's query low rank; None: one q_proj
    qk_nope_head_dim: int = 0  # MLA: each head's query/key part without rope
    qk_rope_head_dim: int = 0  # MLA: each head's query/key part with rope (one rope key for all heads)
    v_head_dim: int = 0  # MLA: each head's value width
    rope_interleave: bool = True  # MLA: rope dims stored as interleaved pairs (DeepSeek-V2 always, V3's switch)
    swiglu_limit: float | None = None  # set: gpt-oss's clamped SwiGLU experts with biases (core/clamped_experts.py)
    # Granite's multipliers; the OLMoE values leave the forward unchanged.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    attention_multiplier: float | None = None  # None: 1/sqrt(head_dim)
    router_aux_loss_coef: float = 0.01
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    initializer_range: float = 0.02
    hidden_act: str = "silu"
    rope_scaling: dict | None = None
    torch_dtype: str | None = None  # dtype the checkpoint was saved in
    extra: dict = field(default_factory=dict, repr=False)  # unknown config.json fields, written back on save

    def __post_init__(self):
        for name, value in family_of(self.model_type).fixed.items():  # the unknown model_type error names them all
            setattr(self, name, value)
        if self.n_shared_experts:  # n SwiGLU experts summed = one of n times the width (their rows concatenated)
            self.shared_expert_intermediate_size = self.n_shared_experts * self.intermediate_size
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"config: hidden_size {self.hidden_size} is not divisible by "
                                 f"num_attention_heads {self.num_attention_heads} (and no head_dim is given)")
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.mlp_only_layers = list(self.mlp_only_layers or [])
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"config: num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"config: num_experts_per_tok {self.num_experts_per_tok} must be in "
                             f"[1, num_experts={self.num_experts}]")
        if self.hidden_act != "silu":
            raise ValueError(f"config: hidden_act {self.hidden_act!r} is not supported; expected 'silu'")
        rope_type(self.rope_scaling)  # refuses, by name, a type core/rope.py does not compute
        self._check_attention()
        if self.qk_norm not in (None, "full", "head"):
            raise ValueError(f"config: qk_norm {self.qk_norm!r}; expected None, 'full' or 'head'")
        if self.sliding_window is not None and not (isinstance(self.sliding_window, int) and self.sliding_window >= 1):
            raise ValueError(f"config: sliding_window {self.sliding_window!r}; expected an int >= 1 or null")
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"config: layer_types has {len(self.layer_types)} entries; expected num_hidden_layers="
                             f"{self.num_hidden_layers}")
        if not self.sparse_layers:
            raise ValueError("config: no layer is sparse (mlp_only_layers, decoder_sparse_step, first_k_dense_replace); "
                             "expected at least one MoE layer")
        if len(self.sparse_layers) < self.num_hidden_layers and not self.dense_intermediate_size:
            raise ValueError("config: dense layers need dense_intermediate_size (config.json's intermediate_size)")
        self._check_router()

    def _check_attention(self):
        kinds = ("full_attention", "sliding_attention")
        if self.layer_types is not None and not set(self.layer_types) <= set(kinds):
            raise ValueError(f"config: layer_types {self.layer_types!r}; expected each one of {kinds}")
        if self.kv_lora_rank is not None and min(self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim) < 1:
            raise ValueError("config: Multi-head Latent Attention (kv_lora_rank set) needs qk_nope_head_dim, "
                             f"qk_rope_head_dim and v_head_dim >= 1; got {self.qk_nope_head_dim}, "
                             f"{self.qk_rope_head_dim}, {self.v_head_dim}")

    def _check_router(self):
        if self.scoring_func not in SCORE_FUNCS:
            raise ValueError(f"config: scoring_func {self.scoring_func!r}; expected one of {SCORE_FUNCS}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"config: topk_method {self.topk_method!r}; expected one of {TOPK_METHODS}")
        if self.topk_on_logits and (self.scoring_func != "softmax" or self.topk_method != "greedy"):
            raise ValueError("config: topk_on_logits (top-K on logits, softmax over the K) takes softmax scoring "
                             f"and greedy top-K; got {self.scoring_func!r} and {self.topk_method!r}")
        if self.topk_method != "greedy":
            E, G = self.num_experts, self.n_group
            if G < 1 or E % G or not 1 <= self.topk_group <= G:
                raise ValueError(f"config: {self.topk_method} needs n_group dividing num_experts={E} and "
                                 f"1 <= topk_group <= n_group; got n_group={G}, topk_group={self.topk_group}")
            if self.num_experts_per_tok > self.topk_group * (E // G):
                raise ValueError(f"config: num_experts_per_tok {self.num_experts_per_tok} exceeds the "
                                 f"{self.topk_group * (E // G)} experts of topk_group={self.topk_group} groups")
            if self.topk_method == "noaux_tc" and E // G < 2:
                raise ValueError(f"config: noaux_tc ranks groups by their two best experts; groups have {E // G}")

    @property
    def sparse_layers(self) -> list[int]:
        """The MoE layers' indices; the others are dense (the transformers 4.57 rule of each family)."""
        return [i for i in range(self.num_hidden_layers) if i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0 and i >= self.first_k_dense_replace]

    def window(self, layer: int) -> int | None:
        """Layer's sliding attention window, None for full attention."""
        if not self.use_sliding_window or self.sliding_window is None or (
                self.layer_types is not None and self.layer_types[layer] != "sliding_attention"):
            return None
        return self.sliding_window

    @property
    def rope_dim(self) -> int:  # the dims each head rotates: MLA's rope part, else the whole head
        return self.qk_rope_head_dim if self.kv_lora_rank is not None else self.head_dim

    @property
    def attention_scale(self) -> float:
        return self.attention_multiplier if self.attention_multiplier is not None else self.head_dim ** -0.5


# ----------------------------------------------------------------------------- building blocks

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, weight_in_fp32: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.weight_in_fp32 = eps, weight_in_fp32

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_in_fp32:  # gpt-oss: the weight multiplies the fp32 values, one rounding at the end
            return (self.weight * x32).to(x.dtype)
        return self.weight * x32.to(x.dtype)  # cast before the weight, as the reference does


def position_embeddings(config: MoEConfig, position_ids, dtype):
    """cos, sin [B, T, rope_dim] of `config`'s rope, its rope_scaling included (core/rope.py)."""
    inv_freq, factor = rope_frequencies(config.rope_dim, config.rope_theta, config.rope_scaling,
                                        config.max_position_embeddings)
    return rope_cos_sin(position_ids, inv_freq, factor, dtype)


class KVCache:
    """Preallocated keys and values for every layer: [B, G, S_max, d] each, filled left to right."""

    def __init__(self, config: MoEConfig, batch_size: int, max_len: int, dtype, device):
        G, dk, dv = config.num_key_value_heads, config.head_dim, config.head_dim
        if config.kv_lora_rank is not None:  # MLA caches every head's full key and value (core/mla.py)
            G, dk, dv = config.num_attention_heads, config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
        self.k = [torch.zeros(batch_size, G, max_len, dk, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.v = [torch.zeros(batch_size, G, max_len, dv, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.length = 0  # positions filled so far; advanced once per forward by the model

    def update(self, layer: int, k, v):  # k, v [B, G, T, d] -> all keys/values so far [B, G, S, d]
        end = self.length + k.shape[2]
        if end > self.k[layer].shape[2]:
            raise ValueError(f"KV cache holds {self.k[layer].shape[2]} positions; {end} were asked for")
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class Attention(nn.Module):
    def __init__(self, config: MoEConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        H, G, d, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.hidden_size
        qkv_bias = config.attention_bias or config.qkv_bias
        self.q_proj = nn.Linear(D, H * d, bias=qkv_bias)
        self.k_proj = nn.Linear(D, G * d, bias=qkv_bias)
        self.v_proj = nn.Linear(D, G * d, bias=qkv_bias)
        self.o_proj = nn.Linear(H * d, D, bias=config.attention_bias)
        if config.qk_norm:  # OLMoE: over the whole projection width, before the head split; Qwen3: per head
            width = {"full": (H * d, G * d), "head": (d, d)}[config.qk_norm]
            self.q_norm = RMSNorm(width[0], config.rms_norm_eps)
            self.k_norm = RMSNorm(width[1], config.rms_norm_eps)
        if config.attention_sinks:  # gpt-oss: one logit per head in every softmax (core/sinks.py)
            self.sinks = nn.Parameter(torch.zeros(H))

    def forward(self, x, cos, sin, mask, cache: KVCache | None):  # x [B, T, D]
        c = self.config
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(B, T, c.num_attention_heads, c.head_dim)  # [B, T, H, d]
        k = k.view(B, T, c.num_key_value_heads, c.head_dim)  # [B, T, G, d]
        if c.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        elif c.qk_norm == "full":
            q, k = self.q_norm(q.flatten(2)).view_as(q), self.k_norm(k.flatten(2)).view_as(k)
        if c.clip_qkv is not None:
            q, k, v = (t.clamp(-c.clip_qkv, c.clip_qkv) for t in (q, k, v))
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, T, d], [B, G, T, d]
        v = v.view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # [B, G, S, d]
        return self.o_proj(self.attend(q, k, v, mask).transpose(1, 2).reshape(B, T, -1))

    def attend(self, q, k, v, mask):  # q [B, H, T, d], k/v [B, G, S, d], mask bool or None -> [B, H, T, d]
        if self.config.attention_sinks:
            return sink_attention(q, k, v, self.sinks, mask, self.config.attention_scale)
        if mask is not None and not isinstance(mask, torch.Tensor):  # a BlockMask on CUDA: a fused kernel (`block_mask`)
            return flex(q.is_cuda)(q, k, v, block_mask=mask, scale=self.config.attention_scale, enable_gqa=True)
        # the readable reference path; query head h reads kv head h // (H/G): the reference's repeat_interleave layout
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              scale=self.config.attention_scale, enable_gqa=True)


# ----------------------------------------------------------------------------- the MoE block

class MoEBlock(nn.Module):
    def __init__(self, config: MoEConfig):
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=config.router_bias)  # native affinity W_aff
        if config.topk_method == "noaux_tc":  # DeepSeek-V3's selection-only bias, a checkpoint tensor, never trained
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts), requires_grad=False)
        if config.swiglu_limit is not None:  # gpt-oss (core/clamped_experts.py)
            self.experts = ClampedSwiGLUExperts(config.num_experts, config.hidden_size, config.intermediate_size,
                                                limit=config.swiglu_limit)
        else:
            self.experts = Experts(config)
        self.router = NativeRouter(Scoring.of(config))
        self.router_fp32 = config.router_fp32
        if config.shared_expert_intermediate_size:  # never routed: every token's, beside the routed K (mlp.py)
            self.shared_expert = DenseMLP(config.hidden_size, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False) if config.shared_expert_gate else None

    def forward(self, x, stash: dict | None = None) -> tuple[torch.Tensor, Routing]:  # x [B, T, D]
        """stash: under gradient checkpointing, the first pass records its expert choice there and
        the recompute replays it, so that backward never runs experts the forward did not."""
        B, T, D = x.shape
        flat = x.reshape(B * T, D)
        replay = stash.get("experts") if stash is not None else None
        # A tuned gate is stored in fp32 (routing.py); cast at use, its logits are the model dtype's as ever
        # (DeepSeek's in fp32: then the router's input is the upcast hidden state, heads included).
        gx = flat.float() if self.router_fp32 else flat
        bias = self.gate.bias.to(gx.dtype) if self.gate.bias is not None else None
        logits = F.linear(gx, self.gate.weight.to(gx.dtype), bias).float()  # [B*T, E]
        correction = getattr(self.gate, "e_score_correction_bias", None)
        extra = {} if correction is None else {"correction": correction}  # a policy of your own may not take it
        routing = self.router(gx, logits, experts=replay, **extra)
        if stash is not None and replay is None:
            stash["experts"] = routing.experts.detach()
        y = self.experts(flat, routing.experts, routing.weights)  # [B*T, D]
        if routing.dense_weights is not None and torch.is_grad_enabled():  # DenseMixer: + 0, dense router gradient
            y = y + dense_term(self.experts, flat, routing.dense_weights)
        if hasattr(self, "shared_expert"):
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:  # Qwen2-MoE: sigmoid(w . x) per token
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            y = y + shared
        return y.view(B, T, D), routing


def scaled(x, factor: float):
    """x * factor, skipped at 1.0 (every OLMoE multiplier): x * 1.0 == x, and the copy costs a full pass."""
    return x if factor == 1.0 else x * factor


class DecoderLayer(nn.Module):
    def __init__(self, config: MoEConfig, layer_idx: int):
        super().__init__()
        if config.kv_lora_rank is not None:  # DeepSeek; imported here: mla.py builds on this file's RMSNorm
            from minimoe.core.mla import MLAttention
            self.self_attn = MLAttention(config, layer_idx)
        else:
            self.self_attn = Attention(config, layer_idx)
        self.sparse = layer_idx in config.sparse_layers  # else a dense MLP, never routed (mlp.py)
        self.mlp = MoEBlock(config) if self.sparse else DenseMLP(config.hidden_size, config.dense_intermediate_size)
        self.window = config.window(layer_idx)  # sliding attention window, None: full
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_weight_in_fp32)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_weight_in_fp32)
        self.residual_multiplier = config.residual_multiplier
        self.gradient_checkpointing = False  # recompute this block in backward instead of storing it

    def forward(self, h, cos, sin, mask, cache):
        if self.gradient_checkpointing and torch.is_grad_enabled() and cache is None:
            return torch.utils.checkpoint.checkpoint(self._forward, h, cos, sin, mask, cache, {}, use_reentrant=False)
        return self._forward(h, cos, sin, mask, cache, None)

    def _forward(self, h, cos, sin, mask, cache, stash):
        h = h + scaled(self.self_attn(self.input_layernorm(h), cos, sin, mask, cache), self.residual_multiplier)
        x = self.post_attention_layernorm(h)
        mlp_out, routing = self.mlp(x, stash) if self.sparse else (self.mlp(x), None)
        return h + scaled(mlp_out, self.residual_multiplier), routing


# ----------------------------------------------------------------------------- the causal LM

@dataclass
class CausalLMOutput:
    logits: torch.Tensor  # [B, T, V] in the model dtype; [n, V] with forward's logits_at
    routings: list[Routing | None]  # one per layer (None: a dense layer), tokens flattened as B*T


class Model(nn.Module):
    def __init__(self, config: MoEConfig):
        super().__init__()
        pad = config.pad_token_id if config.pad_token_id is not None and config.pad_token_id < config.vocab_size else None
        # Built without nn.Embedding's own N(0, 1) init when on the meta device (from_pretrained):
        # normal_ on meta imports torch._dynamo, 1.5-2 s of every load for values never used.
        weight = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=pad, _weight=weight)
        if not weight.is_meta:
            self.embed_tokens.reset_parameters()
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_weight_in_fp32)


class MoEForCausalLM(nn.Module):
    """`model(input_ids, attention_mask=None)` -> CausalLMOutput(logits, routings).

    `logits_at=` runs the LM head at chosen positions only; `segment_ids=` gives a block-causal mask."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.model = Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # What was installed on top of the checkpoint, as JSON-ready dicts that rebuild it; adapters
        # save them. None: native routing everywhere (`methods.set_router` sets it), no LoRA (`lora.add_lora`).
        self.router_method = None  # the configured methods.Method installed (set_router); router_spec is its JSON
        self.router_layers: list[int] = []  # the MoE layers its scope resolved to on this model
        self.lora_spec: dict | None = None

    @property
    def router_spec(self) -> dict | None:
        """The installed method's JSON (Method.spec), what an adapter saves; None: native everywhere."""
        return None if self.router_method is None else self.router_method.spec(self.router_layers)

    def gradient_checkpointing_enable(self, enable: bool = True):
        for layer in self.model.layers:
            layer.gradient_checkpointing = enable

    def tie_weights(self):
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache: KVCache | None = None, *,
                segment_ids=None, logits_at=None):
        """input_ids [B, T]; attention_mask [B, S] (1 = real token, covers cached positions too).

        segment_ids [B, T]: a block-causal layout (packed answer choices, minimoe/core/scoring.py): a token of
        segment s > 0 sees segment 0 and its own segment, causally; segment 0 sees segment 0 only.
        logits_at: (rows, cols) index tensors, n each: the LM head runs at those positions only and
        logits are [n, V] (gathered after the final norm, so no [B, T, V] tensor is built).
        """
        c = self.config
        B, T = input_ids.shape
        start = cache.length if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(start, start + T, device=input_ids.device).expand(B, T)
        h = scaled(self.model.embed_tokens(input_ids), c.embedding_multiplier)  # [B, T, D]
        cos, sin = position_embeddings(c, position_ids, h.dtype)
        flex = input_ids.device.type in FLEX_DEVICES and cache is None and (attention_mask is not None or
                                                                         segment_ids is not None)
        flex = flex and not c.attention_sinks and c.kv_lora_rank is None  # sinks and MLA take a bool mask
        masks = {w: block_mask(attention_mask, segment_ids, B, T, w, position_ids) if flex else
                 self._attention_mask(attention_mask, B, T, start, input_ids.device, segment_ids, w, position_ids)
                 for w in {layer.window for layer in self.model.layers}}  # one per window size, None: full
        routings = []
        for layer in self.model.layers:
            h, routing = layer(h, cos, sin, masks[layer.window], cache)
            routings.append(routing)
        if cache is not None:
            cache.length += T
        h = self.model.norm(h)
        if logits_at is not None:
            h = h[logits_at]  # [n, D]
        return CausalLMOutput(logits=self.head(h), routings=routings)

    def head(self, hidden):
        """Final-normed hidden states [..., D] -> logits [..., V], Granite's logits_scaling included."""
        logits = self.lm_head(hidden)
        if self.config.logits_scaling != 1.0:  # Granite divides, as the reference does (not * 1/s: other bits)
            logits = logits / self.config.logits_scaling
        return logits

    @staticmethod
    def _attention_mask(attention_mask, B, T, start, device, segment_ids=None, window=None, position_ids=None):
        """None (plain causal, SDPA's fast path) or a bool [B, 1, T, S] mask: causal, not padding and,
        with segment_ids, block-causal; with `window`, a query sees the last `window` positions only
        (itself included), as transformers' sliding-window mask. Packed rows (segment_ids) count the
        window in their `position_ids`, each candidate's own positions, so that a packed candidate
        sees what it sees alone. A bool mask works with SDPA on every backend, CUDA included."""
        if attention_mask is None and segment_ids is None and start == 0 and window is None:
            return None
        S = start + T
        q_pos = torch.arange(start, S, device=device)[:, None]
        k_pos = torch.arange(S, device=device)[None, :]
        allowed = k_pos <= q_pos  # [T, S] causal
        if window is not None and segment_ids is None:
            allowed = allowed & (q_pos - k_pos < window)
        allowed = allowed[None, None].expand(B, 1, T, S)
        if segment_ids is not None:
            if start != 0 or segment_ids.shape != (B, T):
                raise ValueError(f"segment_ids has shape {tuple(segment_ids.shape)} with {start} cached positions; "
                                 f"expected {(B, T)} and no KV cache")
            seg_q, seg_k = segment_ids[:, :, None], segment_ids[:, None, :]  # [B, T, 1], [B, 1, S]
            allowed = allowed & ((seg_k == 0) | (seg_k == seg_q))[:, None]
            if window is not None:  # in each candidate's own positions
                allowed = allowed & (position_ids[:, :, None] - position_ids[:, None, :] < window)[:, None]
        if attention_mask is not None:
            if attention_mask.shape != (B, S):
                raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; expected {(B, S)}")
            allowed = allowed & attention_mask.bool()[:, None, None, :]
            # A padding query would see no key at all; letting it see itself keeps SDPA finite.
            # Real queries always see themselves already, so their outputs do not change.
            allowed = allowed | (torch.arange(S, device=device)[None, :] == q_pos)[None, None]
        return allowed

    @property
    def dtype(self):
        return self.lm_head.weight.dtype

    @property
    def device(self):
        return self.lm_head.weight.device


# Where masked rows run FlexAttention (`block_mask`). Not the CPU: torch 2.13 has no flex backward there.
FLEX_DEVICES = {"cuda"}


@functools.cache
def flex(compiled: bool):
    """flex_attention, compiled where it runs for speed (CUDA): uncompiled it is torch's unfused reference,
    which builds the scores it exists to avoid. Imported here, not at the top: it imports dynamo (2 s)."""
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False) if compiled else flex_attention


def block_mask(attention_mask, segment_ids, B: int, T: int, window: int | None = None, position_ids=None):
    """`_attention_mask`'s rule (no cache) as a FlexAttention BlockMask: causal, within segment (or onto
    the shared prefix, segment 0), within the sliding window (packed rows: in their own positions),
    onto real keys, and every query onto itself. Why: a bool mask keeps
    packed GQA rows off the fused SDPA kernels (flash takes no mask; memory-efficient lacks GQA in 2.11),
    so the math kernel builds fp32 [B, H, T, S] scores; flex skips the masked blocks (unmeasured on a GPU)."""
    def allowed(b, h, q, k):
        ok = k <= q
        if window is not None:
            ok = ok & ((q - k if segment_ids is None else position_ids[b, q] - position_ids[b, k]) < window)
        if segment_ids is not None:
            ok = ok & ((segment_ids[b, k] == 0) | (segment_ids[b, k] == segment_ids[b, q]))
        if attention_mask is not None:
            ok = (ok & attention_mask[b, k].bool()) | (k == q)
        return ok
    from torch.nn.attention.flex_attention import create_block_mask  # imports dynamo (2 s): only where used
    device = (segment_ids if segment_ids is not None else attention_mask).device
    return create_block_mask(allowed, B, None, T, T, device=device)


def compile_layers(model: MoEForCausalLM, **options) -> MoEForCausalLM:
    """torch.compile each decoder layer in place, as torchtitan compiles its blocks: the layers share
    one code object and dynamo treats their parameters as inputs, so one graph serves every layer.
    The embedding, the LM head and the loss stay eager; `options` go to torch.compile."""
    for layer in model.model.layers:
        layer.compile(**options)
    return model


def init_weights(model: MoEForCausalLM, std: float | None = None, generator=None):
    """Random init for tests and tiny models: N(0, std) matrices, unit norms, zero biases."""
    std = model.config.initializer_range if std is None else std
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=generator)
        pad = model.model.embed_tokens.padding_idx
        if pad is not None:
            model.model.embed_tokens.weight[pad].zero_()
    return model


def config_field_names() -> list[str]:
    return [f.name for f in fields(MoEConfig) if f.name != "extra"]
