"""The model every family shares: config, the MoE block, the decoder layer, causal LM.

Families differ only by config fields (`MoEConfig`; core/families.py maps each family's config.json onto
them) and by small modules switched on by those fields: each layer's token mixer (core/mixers.py: GQA
attention, MLA, ...), the routed expert bank (core/experts.py), the dense MLP of dense layers and
shared experts (core/mlp.py), the router's scoring (core/routing.py).
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
- Packed answer choices (minimoe/core/choices.py) pass `segment_ids`: the causal mask also hides other
  segments than the shared prefix (0) and the query's own, as a bool SDPA mask (every backend;
  core/masks.py). With `logits_at` the LM head runs on the gathered final-normed hidden states only.
- Qwen3: RMSNorm per head on q and k; Qwen2: biases on q, k, v only, and a shared expert scaled by
  sigmoid(w . x); Mixtral and Qwen: an optional sliding window, as a bool mask per window size.
  Dense layers (mlp_only_layers, decoder_sparse_step, first_k_dense_replace) run a dense MLP and
  return no Routing (None in the model output): they are never routed.
- FlexOlmo (`norm_after`): OLMo-2's placement, each branch's output normed before the residual add
  and no input norm. Llama 4 (`expert_input_scaled`): the combine weight scales the routed expert's
  input (core/experts.py); Granite's shared expert stores gate and up as one matrix (core/mlp.py).
- Experts: stacked `[E, out, in]` banks run on token blocks sorted by expert (core/experts.py).
  Under autocast every matmul of a bf16 model runs in bf16, the banks included; nothing in forward or
  backward reads a device value back to the host (no bincount, .item() or boolean indexing).
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from minimoe.core.clamped_experts import ClampedSwiGLUExperts
from minimoe.core.densemixer import dense_term
from minimoe.core.experts import Experts
from minimoe.core.families import family_of
from minimoe.core.masks import block_mask, bool_mask, flex_applies
from minimoe.core.mixers import MIXERS, KVCache, MixerInputs, mixer_for
from minimoe.core.mlp import DenseMLP
from minimoe.core.norms import RMSNorm
from minimoe.core.rope import rope_cos_sin, rope_frequencies, rope_type
from minimoe.core.routing import SCORE_FUNCS, TOPK_METHODS, NativeRouter, Routing, Scoring


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
    layer_types: list | None = None  # per layer "sliding_attention" | "full_attention" | "chunked_attention"; None: alike
    mixer_types: list | None = None  # per layer a core/mixers.py MIXERS name; None: "mla" with kv_lora_rank, else "attention"
    tie_word_embeddings: bool = False
    norm_topk_prob: bool = False  # renormalise the K selected weights (Granite's top-K on logits always does)
    clip_qkv: float | None = None  # OLMoE: clamp q, k, v to [-c, c] after projection (and q/k norm)
    qk_norm: str | None = None  # on q and k: RMSNorm "full" over the projection width (OLMoE), "head" per head
    # (Qwen3, GLM), or "l2" per head without a weight, after rope, on rope layers only (Llama 4)
    use_qk_norm: bool = True  # the config.json switch of a family whose q/k norm is optional (GLM, Llama 4); False: none
    partial_rotary_factor: float = 1.0  # rope turns the first factor * head_dim dims of each head (GLM), the rest pass
    no_rope_layers: list | None = None  # per layer 1 = rope, 0 = NoPE (Llama 4's name and values); None: rope everywhere
    no_rope_layer_interval: int | None = None  # no_rope_layers empty or None: every n-th layer NoPE (Llama 4's rule)
    attention_chunk_size: int | None = None  # "chunked_attention" layers see their own chunk only (Llama 4; with no
    # layer_types the rope layers are chunked, the NoPE ones full, as Llama4TextConfig fills them in)
    # Llama 4's attention temperature on NoPE layers: q times 1 + attn_scale * log1p(floor((pos + 1) / floor_scale))
    attn_temperature_tuning: bool = False
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    norm_after: bool = False  # OLMo-2 (FlexOlmo): each branch's output normed before the residual add, no input norm
    # Dense layers among the MoE ones: layer i is sparse unless i in mlp_only_layers, (i + 1) % decoder_sparse_step,
    # or i < first_k_dense_replace (Qwen; DeepSeek); a dense layer's MLP is dense_intermediate_size wide.
    mlp_only_layers: list = field(default_factory=list)
    moe_layers: list | None = None  # set: exactly these layers are sparse (Llama 4's explicit list)
    decoder_sparse_step: int = 1
    first_k_dense_replace: int = 0
    dense_intermediate_size: int | None = None
    shared_expert_intermediate_size: int = 0  # > 0: a shared expert of this width beside the routed ones
    shared_expert_gate: bool = False  # the shared expert scaled by sigmoid(w . x) (Qwen2-MoE)
    shared_expert_fused: bool = False  # the shared expert's gate and up as one gate_up_proj [2I, D] (Granite's)
    n_shared_experts: int = 0  # DeepSeek: shared experts of intermediate_size each, run as one of n times the width
    # The router's scoring and selection (routing.Scoring reads these; families.py says who uses which).
    scoring_func: str = "softmax"  # "softmax" | "sigmoid" (DeepSeek-V3)
    topk_on_logits: bool = False  # top-K on the logits, then softmax (Granite, gpt-oss) or sigmoid (Llama 4) of the K
    expert_input_scaled: bool = False  # the combine weight scales each expert's input, not its output (Llama 4)
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
    # rope dims stored as interleaved pairs; None: the mixer's own (MLA: interleaved, DeepSeek-V2 always and V3's
    # default; GQA attention: halves, but Llama 4's pairs)
    rope_interleave: bool | None = None
    rope_in_fp32: bool = False  # GQA: rotate q and k in fp32 and cast once (Llama 4's complex product); else model dtype
    swiglu_limit: float | None = None  # set: gpt-oss's clamped SwiGLU experts with biases (core/clamped_experts.py)
    # Attention options of the hybrids (core/attention.py) and their norms.
    position_embedding_type: str | None = "rope"  # anything else: no rope (Granite 4.0-H's "nope")
    attn_output_gate: bool = False  # q_proj also gives a per-head gate; output * sigmoid(gate) (Qwen3-Next)
    norm_zero_centred: bool = False  # RMSNorm scales by 1 + weight, in fp32 (Qwen3-Next)
    # Mamba-2 layers (core/mamba2.py; mixer_types "mamba2"), Granite 4.0-H's names.
    mamba_n_heads: int = 128
    mamba_d_head: int | str = "auto"  # "auto": mamba_expand * hidden_size / mamba_n_heads (filled in)
    mamba_n_groups: int = 1
    mamba_d_state: int = 256
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    # Gated DeltaNet layers (core/deltanet.py; mixer_types "gated_deltanet"), Qwen3-Next's names.
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
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
        if self.mamba_d_head in ("auto", None):
            inner = self.mamba_expand * self.hidden_size
            if inner % self.mamba_n_heads == 0:
                self.mamba_d_head = inner // self.mamba_n_heads
            elif "mamba2" in (self.mixer_types or []):  # only Mamba-2 layers read it: other models' widths are free
                raise ValueError(f"config: mamba_n_heads {self.mamba_n_heads} does not divide mamba_expand * "
                                 f"hidden_size = {inner}")
        if not self.use_qk_norm:
            self.qk_norm = None
        if not self.no_rope_layers and self.no_rope_layer_interval:
            self.no_rope_layers = [int((i + 1) % self.no_rope_layer_interval != 0) for i in range(self.num_hidden_layers)]
        if self.attention_chunk_size and self.layer_types is None and self.no_rope_layers:
            self.layer_types = ["chunked_attention" if self.uses_rope(i) else "full_attention"
                                for i in range(self.num_hidden_layers)]
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
        if self.qk_norm not in (None, "full", "head", "l2"):
            raise ValueError(f"config: qk_norm {self.qk_norm!r}; expected None, 'full', 'head' or 'l2'")
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
        kinds = ("full_attention", "sliding_attention", "chunked_attention")
        if self.layer_types is not None and not set(self.layer_types) <= set(kinds):
            raise ValueError(f"config: layer_types {self.layer_types!r}; expected each one of {kinds}")
        if self.layer_types is not None and "chunked_attention" in self.layer_types and not self.attention_chunk_size:
            raise ValueError("config: chunked_attention layers need attention_chunk_size >= 1")
        if self.no_rope_layers is not None and len(self.no_rope_layers) < self.num_hidden_layers:
            raise ValueError(f"config: no_rope_layers has {len(self.no_rope_layers)} entries; expected at least "
                             f"num_hidden_layers={self.num_hidden_layers}")
        if not 0 < self.partial_rotary_factor <= 1 or self.rope_dim % 2:
            raise ValueError(f"config: partial_rotary_factor {self.partial_rotary_factor} turns {self.rope_dim} of "
                             f"head_dim={self.head_dim} dims; expected a factor in (0, 1] giving an even count")
        if self.mixer_types is not None and (len(self.mixer_types) != self.num_hidden_layers
                                             or not set(self.mixer_types) <= set(MIXERS)):
            raise ValueError(f"config: mixer_types {self.mixer_types!r}; expected num_hidden_layers="
                             f"{self.num_hidden_layers} entries, each one of {sorted(MIXERS)}")
        if self.kv_lora_rank is not None and min(self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim) < 1:
            raise ValueError("config: Multi-head Latent Attention (kv_lora_rank set) needs qk_nope_head_dim, "
                             f"qk_rope_head_dim and v_head_dim >= 1; got {self.qk_nope_head_dim}, "
                             f"{self.qk_rope_head_dim}, {self.v_head_dim}")

    def _check_router(self):
        if self.scoring_func not in SCORE_FUNCS:
            raise ValueError(f"config: scoring_func {self.scoring_func!r}; expected one of {SCORE_FUNCS}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"config: topk_method {self.topk_method!r}; expected one of {TOPK_METHODS}")
        if self.topk_on_logits and self.topk_method != "greedy":
            raise ValueError(f"config: topk_on_logits (top-K on logits) takes greedy top-K; got {self.topk_method!r}")
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
        if self.moe_layers is not None:
            return sorted(i for i in self.moe_layers if 0 <= i < self.num_hidden_layers)
        return [i for i in range(self.num_hidden_layers) if i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0 and i >= self.first_k_dense_replace]

    def window(self, layer: int) -> int | None:
        """Layer's sliding attention window, None for full attention."""
        if not self.use_sliding_window or self.sliding_window is None or (
                self.layer_types is not None and self.layer_types[layer] != "sliding_attention"):
            return None
        return self.sliding_window

    def chunk(self, layer: int) -> int | None:
        """Layer's local attention chunk (Llama 4's chunked_attention layers), None for none."""
        if self.layer_types is None or self.layer_types[layer] != "chunked_attention":
            return None
        return self.attention_chunk_size

    def uses_rope(self, layer: int) -> bool:  # False: Llama 4's NoPE layers, every layer of Granite 4.0-H's "nope"
        return self.position_embedding_type == "rope" and (self.no_rope_layers is None or bool(self.no_rope_layers[layer]))

    @property
    def rope_dim(self) -> int:  # the dims each head rotates: MLA's rope part, else the head's first partial_rotary_factor
        if self.kv_lora_rank is not None:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_scale(self) -> float:
        return self.attention_multiplier if self.attention_multiplier is not None else self.head_dim ** -0.5


# ----------------------------------------------------------------------------- building blocks

def position_embeddings(config: MoEConfig, position_ids, dtype):
    """cos, sin [B, T, rope_dim] of `config`'s rope, its rope_scaling included (core/rope.py)."""
    inv_freq, factor = rope_frequencies(config.rope_dim, config.rope_theta, config.rope_scaling,
                                        config.max_position_embeddings)
    return rope_cos_sin(position_ids, inv_freq, factor, dtype)



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
            self.shared_expert = DenseMLP(config.hidden_size, config.shared_expert_intermediate_size,
                                          fused=config.shared_expert_fused)
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
        # Autocast would run an fp32 router's F.linear in bf16 all the same (seen on an H200: gpt-oss picked
        # other experts than its fp32 model on 1% of tokens, 0.24 logit error against 0.03 without autocast).
        with torch.autocast(flat.device.type, enabled=False) if self.router_fp32 else contextlib.nullcontext():
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
        mixer = mixer_for(config, layer_idx)  # attention, MLA, ... (core/mixers.py)
        self.mixer_attribute = type(mixer).attribute  # the checkpoint's name for it: self_attn, ...
        setattr(self, self.mixer_attribute, mixer)
        self.sparse = layer_idx in config.sparse_layers  # else a dense MLP, never routed (mlp.py)
        self.mlp = MoEBlock(config) if self.sparse else DenseMLP(config.hidden_size, config.dense_intermediate_size)
        norm = functools.partial(RMSNorm, config.hidden_size, config.rms_norm_eps, config.norm_weight_in_fp32,
                                 config.norm_zero_centred)
        self.norm_after = config.norm_after
        if self.norm_after:  # OLMo-2's placement (FlexOlmo): each branch's output normed, the checkpoint's names
            self.post_attention_layernorm, self.post_feedforward_layernorm = norm(), norm()
        else:  # pre-norm: each branch's input normed
            self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.residual_multiplier = config.residual_multiplier
        self.gradient_checkpointing = False  # recompute this block in backward instead of storing it

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_attribute)

    def forward(self, h, inputs: MixerInputs, cache=None):  # cache: this layer's slot of a KVCache
        if self.gradient_checkpointing and torch.is_grad_enabled() and cache is None:
            return torch.utils.checkpoint.checkpoint(self._forward, h, inputs, cache, {}, use_reentrant=False)
        return self._forward(h, inputs, cache, None)

    def _forward(self, h, inputs, cache, stash):
        if self.norm_after:
            h = h + scaled(self.post_attention_layernorm(self.mixer(h, inputs, cache)), self.residual_multiplier)
            mlp_out, routing = self.mlp(h, stash) if self.sparse else (self.mlp(h), None)
            return h + scaled(self.post_feedforward_layernorm(mlp_out), self.residual_multiplier), routing
        h = h + scaled(self.mixer(self.input_layernorm(h), inputs, cache), self.residual_multiplier)
        x = self.post_attention_layernorm(h)
        mlp_out, routing = self.mlp(x, stash) if self.sparse else (self.mlp(x), None)
        return h + scaled(mlp_out, self.residual_multiplier), routing


# ----------------------------------------------------------------------------- the causal LM

@dataclass
class CausalLMOutput:
    logits: torch.Tensor | None  # [B, T, V] in the model dtype; [n, V] with forward's logits_at; None with head=False
    routings: list[Routing | None]  # one per layer (None: a dense layer), tokens flattened as B*T
    hidden: torch.Tensor | None = None  # head=False: the final-normed hidden states the head would read


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
        self.norm = RMSNorm.of(config, config.hidden_size)


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
                segment_ids=None, logits_at=None, head: bool = True):
        """input_ids [B, T]; attention_mask [B, S] (1 = real token, covers cached positions too).

        segment_ids [B, T]: a block-causal layout (packed answer choices, minimoe/core/choices.py): a token of
        segment s > 0 sees segment 0 and its own segment, causally; segment 0 sees segment 0 only.
        logits_at: (rows, cols) index tensors, n each: the LM head runs at those positions only and
        logits are [n, V] (gathered after the final norm, so no [B, T, V] tensor is built).
        head=False: no LM head; `hidden` holds what it would read ([n, D] with logits_at), for a loss
        that runs the head itself a chunk at a time (core/tokens.py's chunked_token_ce).
        """
        c = self.config
        B, T = input_ids.shape
        h = scaled(self.model.embed_tokens(input_ids), c.embedding_multiplier)  # [B, T, D]
        inputs = self.mixer_inputs(B, T, h, attention_mask, position_ids, cache, segment_ids)
        routings = []
        for i, layer in enumerate(self.model.layers):
            h, routing = layer(h, inputs, cache.layers[i] if cache is not None else None)
            routings.append(routing)
        if cache is not None:
            cache.length += T
        h = self.model.norm(h)
        if logits_at is not None:
            h = h[logits_at]  # [n, D]
        if not head:
            return CausalLMOutput(logits=None, routings=routings, hidden=h)
        return CausalLMOutput(logits=self.head(h), routings=routings)

    def mixer_inputs(self, B: int, T: int, h, attention_mask=None, position_ids=None, cache: KVCache | None = None,
                     segment_ids=None) -> MixerInputs:
        """The rope tables and masks every layer's mixer reads (core/mixers.py), built once for a forward
        of T positions after the cache's; h: the embeddings (their dtype and device)."""
        device, start = h.device, cache.length if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(start, start + T, device=device).expand(B, T)
        cos, sin = position_embeddings(self.config, position_ids, torch.float32 if self.config.rope_in_fp32 else h.dtype)
        mixers = [layer.mixer for layer in self.model.layers]
        flex = device.type in FLEX_DEVICES and cache is None and (attention_mask is not None or segment_ids is not None)
        flex = flex and all(m.takes_block_mask for m in mixers) and flex_applies()  # sinks, MLA, small heads: bool
        masks = {kind: block_mask(attention_mask, segment_ids, B, T, kind, position_ids) if flex else
                 bool_mask(attention_mask, B, T, start, device, segment_ids, kind, position_ids)
                 for kind in {m.mask_kind for m in mixers}}  # one per attention pattern (core/masks.py)
        return MixerInputs(cos, sin, masks, attention_mask, segment_ids, position_ids, start)

    def head(self, hidden):
        """Final-normed hidden states [..., D] -> logits [..., V], Granite's logits_scaling included."""
        logits = self.lm_head(hidden)
        if self.config.logits_scaling != 1.0:  # Granite divides, as the reference does (not * 1/s: other bits)
            logits = logits / self.config.logits_scaling
        return logits

    @property
    def dtype(self):
        return self.lm_head.weight.dtype

    @property
    def device(self):
        return self.lm_head.weight.device


# Where masked rows run FlexAttention (masks.block_mask); none by default. Measured on an H200 (torch 2.11,
# bench/gpu.py's attention stage, Granite's heads, 8 x 512 rows): SDPA took the packed rows' bool mask with GQA
# on cuDNN in 0.51 ms forward and backward, compiled flex 1.16 ms. Add "cuda" to try flex where rows are long
# and mostly masked (it skips whole blocks; unmeasured). Never the CPU: torch 2.13 has no flex backward there.
FLEX_DEVICES: set[str] = set()


def compile_layers(model: MoEForCausalLM, **options) -> MoEForCausalLM:
    """torch.compile each decoder layer in place, as torchtitan compiles its blocks: the layers share
    one code object and dynamo treats their parameters as inputs, so one graph serves every layer.
    The embedding, the LM head and the loss stay eager; `options` go to torch.compile."""
    for layer in model.model.layers:
        layer.compile(**options)
    return model


def init_weights(model: MoEForCausalLM, std: float | None = None, generator=None):
    """Random init for tests and tiny models: N(0, std) matrices, unit norms (zero-centred ones 0), zero
    biases; the recurrent mixers' dt_bias, A_log and D keep their constructors' values."""
    std = model.config.initializer_range if std is None else std
    zero_centred = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, RMSNorm) and m.zero_centred}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".dt_bias", ".A_log", ".D")):
                continue
            if name in zero_centred:
                p.zero_()
            elif name.endswith("norm.weight") or "layernorm" in name:
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
