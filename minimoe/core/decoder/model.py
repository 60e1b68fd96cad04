"""The model every family shares: the MoE block, the decoder layer, causal LM.

Families differ only by config fields (`MoEConfig` in model_config.py, the fields they share, and in its `mixers` each token
mixer's own options, defined in the mixer's file; core/decoder/families.py maps each family's config.json onto
them) and by small modules switched on by those fields: each layer's token mixer (core/token_mixers/mixers.py: GQA
attention, MLA, ...), the routed expert bank (core/layers/experts.py), the dense MLP of dense layers and
shared experts (core/layers/mlp.py), the router's scoring (core/routing_methods/routing.py).
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
- Routing is a swappable module (`MoEBlock.router`, see minimoe/core/routing_methods/routing.py). It sees the
  pre-expert hidden state and the native affinity logits and returns a `Routing`; every layer's
  `Routing` (logits, selected experts, weights, method readouts) is returned with the logits.
- Packed answer choices (minimoe/core/task/choices.py) pass `segment_ids`: the causal mask also hides other
  segments than the shared prefix (0) and the query's own, as a bool SDPA mask (every backend;
  core/layers/masks.py). With `logits_at` the LM head runs on the gathered final-normed hidden states only.
- Qwen3: RMSNorm per head on q and k; Qwen2: biases on q, k, v only, and a shared expert scaled by
  sigmoid(w . x); Mixtral and Qwen: an optional sliding window, as a bool mask per window size.
  Dense layers (mlp_only_layers, decoder_sparse_step, first_k_dense_replace) run a dense MLP and
  return no Routing (None in the model output): they are never routed.
- FlexOlmo (`norm_after`): OLMo-2's placement, each branch's output normed before the residual add
  and no input norm. Llama 4 (`expert_input_scaled`): the combine weight scales the routed expert's
  input (core/layers/experts.py); Granite's shared expert stores gate and up as one matrix (core/layers/mlp.py).
- Gemma 4: a dense MLP beside the experts in every layer, each branch normed before and after (`parallel_dense`:
  core/layers/parallel_dense.py), the gate reading its own weightless norm of the stream (`gate_input`), a gain per
  expert (core/layers/experts.py); an input norm as well as OLMo-2's output norms (`sandwich_norm`), each layer's
  output times the checkpoint's `layer_scalar`, the embedding times sqrt(D) in the model dtype, logits softcapped.
- DeepSeek-V4 (`hc_mult`): the residual is hc_mult streams [B, T, N, D], the embedding copied into each; every
  block reads a collapse of them and its output is spread back by the layer's hyper-connections, and the model's
  `hc_head` collapses them before the final norm (core/layers/hyper_connections.py). Its first MoE layers
  (`hash_layers`) take each token's experts from a frozen table by token id (routing.hash_experts), weighed by the
  gate's scores; they report no Routing: not routers for the methods (docs/methods.md).
- Experts: stacked `[E, out, in]` banks run on token blocks sorted by expert (core/layers/experts.py).
  Under autocast every matmul of a bf16 model runs in bf16, the banks included; nothing in forward or
  backward reads a device value back to the host (no bincount, .item() or boolean indexing).
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from minimoe.core.layers.clamped_experts import ClampedSwiGLUExperts
from minimoe.core.layers.experts import Experts, SquaredReLUExperts
from minimoe.core.layers.hyper_connections import HyperConnection, HyperHead
from minimoe.core.layers.masks import block_mask, bool_mask, flex_applies
from minimoe.core.token_mixers.mixers import KVCache, MixerInputs, mixer_for
from minimoe.core.layers.mlp import DenseMLP
from minimoe.core.layers.norms import RMSNorm
from minimoe.core.layers.parallel_dense import ParallelDense
from minimoe.core.layers.rope import layer_type_frequencies, rope_cos_sin, rope_frequencies
from minimoe.core.decoder.model_config import MoEConfig, config_field_names  # noqa: F401 (importers' name for both)
from minimoe.core.routing_methods.routing import NativeRouter, Routing, Scoring, hash_experts


# ----------------------------------------------------------------------------- building blocks

def position_embeddings(config: MoEConfig, position_ids, dtype):
    """cos, sin [B, T, rope_dim] of `config`'s rope, its rope_scaling included (core/layers/rope.py)."""
    inv_freq, factor = rope_frequencies(config.rope_dim, config.rope_theta, config.rope_scaling,
                                        config.max_position_embeddings)
    return rope_cos_sin(position_ids, inv_freq, factor, dtype)


def layer_type_ropes(config: MoEConfig, position_ids, dtype) -> dict | None:
    """Layer type -> its cos, sin [B, T, d] where each type has its own rope (config.rope_parameters: Gemma 4, over
    each type's head width), else None."""
    if config.rope_parameters is None:
        return None
    opts = config.mixers["attention"]
    heads = {config.layer_types[i]: opts.heads(config, i)[1] for i in range(config.num_hidden_layers)}
    return {kind: rope_cos_sin(position_ids, layer_type_frequencies(config.rope_parameters[kind], d,
                                                                     opts.layer_rope_partial), 1.0, dtype)
            for kind, d in heads.items()}



# ----------------------------------------------------------------------------- the MoE block

class MoEBlock(nn.Module):
    def __init__(self, config: MoEConfig, hashed: bool = False):
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=config.router_bias)  # native affinity W_aff
        self.hashed = hashed  # DeepSeek-V4: the experts by token id, gate.tid2eid [V, K] (routing.hash_experts)
        if hashed:  # an integer buffer, a checkpoint tensor (loading/checkpoint.py reads persistent buffers too)
            self.gate.register_buffer("tid2eid", torch.zeros(config.vocab_size, config.num_experts_per_tok,
                                                             dtype=torch.long))
        elif config.topk_method == "noaux_tc" and config.correction_bias:  # DeepSeek-V3's selection-only bias, never trained
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts), requires_grad=False)
        if config.moe_latent_size is not None:  # Nemotron-H's latent MoE: experts in a narrower width
            self.fc1_latent_proj = nn.Linear(config.hidden_size, config.moe_latent_size, bias=False)
            self.fc2_latent_proj = nn.Linear(config.moe_latent_size, config.hidden_size, bias=False)
        if config.swiglu_limit is not None:  # gpt-oss (core/layers/clamped_experts.py)
            self.experts = ClampedSwiGLUExperts(config.num_experts, config.hidden_size, config.intermediate_size,
                                                limit=config.swiglu_limit)
        elif config.hidden_act == "relu2":  # Nemotron-H: no gate, squared ReLU
            self.experts = SquaredReLUExperts(config.num_experts, config.moe_latent_size or config.hidden_size,
                                              config.intermediate_size)
        else:
            self.experts = Experts(config)
        self.router = NativeRouter(Scoring.of(config))
        self.router_fp32 = config.router_fp32
        if config.shared_expert_intermediate_size:  # never routed: every token's, beside the routed K (mlp.py)
            self.shared_expert = DenseMLP(config.hidden_size, config.shared_expert_intermediate_size,
                                          fused=config.shared_expert_fused, act=config.hidden_act,
                                          limit=config.swiglu_clamp)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False) if config.shared_expert_gate else None

    def forward(self, x, stash: dict | None = None, gate_input=None, token_ids=None) -> tuple[torch.Tensor, Routing]:
        """x [B, T, D]. stash: under gradient checkpointing, the first pass records its expert choice there and
        the recompute replays it, so that backward never runs experts the forward did not.
        gate_input [B, T, D]: what the gate and the routing policy read where it is not the experts' input x
        (Gemma 4's own norm, core/layers/parallel_dense.py). token_ids [B, T]: a hash-routed block's input ids;
        it returns no Routing (None), as a dense layer."""
        B, T, D = x.shape
        flat = x.reshape(B * T, D)
        replay = stash.get("experts") if stash is not None else None
        g = flat if gate_input is None else gate_input.reshape(B * T, D)
        # A tuned gate is stored in fp32 (routing.py); cast at use, its logits are the model dtype's as ever
        # (DeepSeek's in fp32: then the router's input is the upcast hidden state, heads included).
        gx = g.float() if self.router_fp32 else g
        bias = self.gate.bias.to(gx.dtype) if self.gate.bias is not None else None
        # Autocast would run an fp32 router's F.linear in bf16 all the same (seen on an H200: gpt-oss picked
        # other experts than its fp32 model on 1% of tokens, 0.24 logit error against 0.03 without autocast).
        with torch.autocast(flat.device.type, enabled=False) if self.router_fp32 else contextlib.nullcontext():
            logits = F.linear(gx, self.gate.weight.to(gx.dtype), bias).float()  # [B*T, E]
        correction = getattr(self.gate, "e_score_correction_bias", None)
        extra = {} if correction is None else {"correction": correction}  # a policy of your own may not take it
        if self.hashed:  # the table's experts, the native scores' weights; never a method's (docs/methods.md)
            if token_ids is None:
                raise ValueError("a hash-routed MoE layer (DeepSeek-V4's tid2eid) needs the input ids; none were given")
            routing = Routing(logits, *self.router.scoring.select(logits, hash_experts(self.gate.tid2eid, token_ids)))
        else:
            routing = self.router(gx, logits, experts=replay, **extra)
        if stash is not None and replay is None:
            stash["experts"] = routing.experts.detach()
        latent = hasattr(self, "fc1_latent_proj")  # routed on the hidden state, the experts run in the latent width
        xe = self.fc1_latent_proj(flat) if latent else flat
        y = self.experts(xe, routing.experts, routing.weights)  # [B*T, D] (latent: [B*T, moe_latent_size])
        if routing.addend is not None:  # the policy's own term (routing.Routing), in the experts' width
            y = y + routing.addend(self.experts, xe)
        if latent:
            y = self.fc2_latent_proj(y)
        if hasattr(self, "shared_expert"):
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:  # Qwen2-MoE: sigmoid(w . x) per token
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            y = y + shared
        return y.view(B, T, D), None if self.hashed else routing


def scaled(x, factor: float):
    """x * factor, skipped at 1.0 (every OLMoE multiplier): x * 1.0 == x, and the copy costs a full pass."""
    return x if factor == 1.0 else x * factor


def _save_choices(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.topk.default else CheckpointPolicy.PREFER_RECOMPUTE


def _keep_expert_choice():
    """A traced layer's checkpoint keeps every top-K's output from forward (the expert choice, a DSA indexer's
    keys): the stash's guarantee that backward never runs experts the forward did not, kept by the partitioner
    (torch.compile traces no write to a dict inside a checkpoint)."""
    return create_selective_checkpoint_contexts(_save_choices)


class DecoderLayer(nn.Module):
    """A token mixer then a feed-forward block (the MoE block, or a dense layer's MLP), each with its norm and
    residual; in a one-block-per-layer model (Nemotron-H: config.single_block_layers) only one of the two, the
    other None: a mixer layer has input_layernorm and no `mlp`, a feed-forward one post_attention_layernorm and
    no mixer (mixer_attribute None)."""

    def __init__(self, config: MoEConfig, layer_idx: int):
        super().__init__()
        mixer = mixer_for(config, layer_idx)  # attention, MLA, ... (core/token_mixers/mixers.py); None: no mixer
        self.mixer_attribute = None if mixer is None else type(mixer).attribute  # the checkpoint's name: self_attn, ...
        if mixer is not None:
            setattr(self, self.mixer_attribute, mixer)
        self.sparse = layer_idx in config.sparse_layers  # else a dense MLP, never routed (mlp.py)
        self.mlp = None
        if config.has_mlp(layer_idx):
            self.mlp = MoEBlock(config, layer_idx in config.hash_layers) if self.sparse else DenseMLP(config.hidden_size, config.dense_intermediate_size,
                                                                     act=config.hidden_act)
        # Gemma 4: a dense MLP beside the experts, the branches' norms, the gate's own input (parallel_dense.py)
        self.parallel = ParallelDense(config) if config.parallel_dense and self.sparse else None
        norm = functools.partial(RMSNorm, config.hidden_size, config.rms_norm_eps, config.norm_weight_in_fp32,
                                 config.norm_zero_centred)
        self.norm_after = config.norm_after
        if self.norm_after:  # OLMo-2's placement (FlexOlmo): each branch's output normed, the checkpoint's names
            self.post_attention_layernorm, self.post_feedforward_layernorm = norm(), norm()
            if config.sandwich_norm:  # Gemma's: its input normed too
                self.input_layernorm = norm()
        else:  # pre-norm: each branch's input normed
            if mixer is not None:
                self.input_layernorm = norm()
            if self.mlp is not None:
                self.post_attention_layernorm = norm()
        if config.layer_scalar:  # Gemma 4: the checkpoint's layer_scalar [1], never trained
            self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)
        self.residual_multiplier = config.residual_multiplier
        if config.hc_mult:  # DeepSeek-V4: each block between its hyper-connection's collapse and spread
            hc = (config.hidden_size, config.hc_mult, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps)
            self.attn_hc, self.ffn_hc = HyperConnection(*hc), HyperConnection(*hc)
        self.gradient_checkpointing = False  # recompute this block in backward instead of storing it

    @property
    def mixer(self) -> nn.Module | None:
        return None if self.mixer_attribute is None else getattr(self, self.mixer_attribute)

    def forward(self, h, inputs: MixerInputs, cache=None):  # cache: this layer's slot of a KVCache
        if self.gradient_checkpointing and torch.is_grad_enabled() and cache is None:
            if torch.compiler.is_compiling():  # traced: a write to the stash is a side effect the HOP refuses
                return checkpoint(self._forward, h, inputs, cache, None, use_reentrant=False,
                                  context_fn=_keep_expert_choice)
            return checkpoint(self._forward, h, inputs, cache, {}, use_reentrant=False)
        return self._forward(h, inputs, cache, None)

    def _forward(self, h, inputs, cache, stash):
        if hasattr(self, "attn_hc"):  # h [B, T, N, D]: N residual streams (core/layers/hyper_connections.py)
            x, post, comb = self.attn_hc(h)
            h = HyperConnection.expand(h, self.mixer(self.input_layernorm(x), inputs, cache), post, comb)
            x, post, comb = self.ffn_hc(h)
            mlp_out, routing = self.mlp(self.post_attention_layernorm(x), stash, token_ids=inputs.token_ids)
            return HyperConnection.expand(h, mlp_out, post, comb), routing
        if self.norm_after:
            x = self.input_layernorm(h) if hasattr(self, "input_layernorm") else h
            h = h + scaled(self.post_attention_layernorm(self.mixer(x, inputs, cache)), self.residual_multiplier)
            if self.parallel is not None:
                mlp_out, routing = self.parallel(h, self.mlp, stash)
            else:
                mlp_out, routing = self.mlp(h, stash) if self.sparse else (self.mlp(h), None)
            h = h + scaled(self.post_feedforward_layernorm(mlp_out), self.residual_multiplier)
            return (h * self.layer_scalar if hasattr(self, "layer_scalar") else h), routing
        if self.mixer is not None:
            h = h + scaled(self.mixer(self.input_layernorm(h), inputs, cache), self.residual_multiplier)
        if self.mlp is None:
            return h, None
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
        if config.hc_mult:  # DeepSeek-V4: the streams' final collapse, before the norm
            self.hc_head = HyperHead(config.hidden_size, config.hc_mult, config.hc_eps, config.rms_norm_eps)


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
        """The installed method's record on its layers (Method.record), what an adapter saves; None: native everywhere."""
        return None if self.router_method is None else self.router_method.record(self.router_layers)

    def gradient_checkpointing_enable(self, enable: bool = True):
        for layer in self.model.layers:
            layer.gradient_checkpointing = enable

    def tie_weights(self):
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache: KVCache | None = None, *,
                segment_ids=None, logits_at=None, head: bool = True):
        """input_ids [B, T]; attention_mask [B, S] (1 = real token, covers cached positions too).

        segment_ids [B, T]: a block-causal layout (packed answer choices, minimoe/core/task/choices.py): a token of
        segment s > 0 sees segment 0 and its own segment, causally; segment 0 sees segment 0 only.
        logits_at: (rows, cols) index tensors, n each: the LM head runs at those positions only and
        logits are [n, V] (gathered after the final norm, so no [B, T, V] tensor is built).
        head=False: no LM head; `hidden` holds what it would read ([n, D] with logits_at), for a loss
        that runs the head itself a chunk at a time (core/task/tokens.py's chunked_token_ce).
        """
        c = self.config
        B, T = input_ids.shape
        h = scaled(self.model.embed_tokens(input_ids), c.embedding_multiplier)  # [B, T, D]
        if c.embedding_sqrt_scale:  # Gemma: sqrt(D) rounded to the model dtype first, as its reference multiplies
            h = h * torch.tensor(c.hidden_size ** 0.5).to(h.dtype)
        inputs = self.mixer_inputs(B, T, h, attention_mask, position_ids, cache, segment_ids)
        inputs.token_ids = input_ids
        if c.hc_mult:  # DeepSeek-V4: the embedding in each of the N residual streams [B, T, N, D]
            h = h.unsqueeze(2).expand(B, T, c.hc_mult, c.hidden_size).contiguous()
        routings = []
        for i, layer in enumerate(self.model.layers):
            h, routing = layer(h, inputs, cache.layers[i] if cache is not None else None)
            routings.append(routing)
        if cache is not None:
            cache.length += T
        if c.hc_mult:
            h = self.model.hc_head(h)
        h = self.model.norm(h)
        if logits_at is not None:
            h = h[logits_at]  # [n, D]
        if not head:
            return CausalLMOutput(logits=None, routings=routings, hidden=h)
        return CausalLMOutput(logits=self.head(h), routings=routings)

    def mixer_inputs(self, B: int, T: int, h, attention_mask=None, position_ids=None, cache: KVCache | None = None,
                     segment_ids=None) -> MixerInputs:
        """The rope tables and masks every layer's mixer reads (core/token_mixers/mixers.py), built once for a forward
        of T positions after the cache's; h: the embeddings (their dtype and device)."""
        device, start = h.device, cache.length if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(start, start + T, device=device).expand(B, T)
        cos, sin = position_embeddings(self.config, position_ids, torch.float32 if self.config.rope_in_fp32 else h.dtype)
        mixers = [layer.mixer for layer in self.model.layers if layer.mixer is not None]
        flex = device.type in FLEX_DEVICES and cache is None and (attention_mask is not None or segment_ids is not None)
        flex = flex and all(m.takes_block_mask for m in mixers) and flex_applies()  # sinks, MLA, small heads: bool
        masks = {kind: block_mask(attention_mask, segment_ids, B, T, kind, position_ids) if flex else
                 bool_mask(attention_mask, B, T, start, device, segment_ids, kind, position_ids)
                 for kind in {m.mask_kind for m in mixers}}  # one per attention pattern (core/layers/masks.py)
        ropes = layer_type_ropes(self.config, position_ids, h.dtype)
        inputs = MixerInputs(cos, sin, masks, attention_mask, segment_ids, position_ids, start, ropes=ropes)
        for read in {type(m).read_layout for m in mixers if hasattr(m, "read_layout")}:
            read(inputs)  # packed rows' layout, read on the host here, outside the (compiled) layers
        return inputs

    def head(self, hidden):
        """Final-normed hidden states [..., D] -> logits [..., V], Granite's logits_scaling included."""
        logits = self.lm_head(hidden)
        if self.config.logits_scaling != 1.0:  # Granite divides, as the reference does (not * 1/s: other bits)
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcapping
        if cap:  # Gemma: cap * tanh(logits / cap), in the logits' dtype as the reference
            logits = torch.tanh(logits / cap) * cap
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
    """Random init for tests and tiny models: N(0, std) matrices, unit norms and gains (zero-centred norms 0), zero
    biases; the recurrent mixers' dt_bias, A_log and D keep their constructors' values; a hash table's rows random."""
    std = model.config.initializer_range if std is None else std
    zero_centred = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, RMSNorm) and m.zero_centred}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".dt_bias", ".A_log", ".D")):
                continue
            if name in zero_centred:
                p.zero_()
            elif name.endswith(("norm.weight", "layer_scalar", "gate_input_scale", "per_expert_scale")) or "layernorm" in name:
                p.fill_(1.0)  # norms, and Gemma 4's gains (transformers' init: ones)
            elif name.endswith(("_hc.scale", "hc_head.hc_scale")):  # hyper-connections: transformers' init
                p.fill_(1.0)
            elif name.endswith((".bias", "_hc.base", "hc_head.hc_base")):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=generator)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):  # DeepSeek-V4's hash table: K distinct experts per token id, at random
                E = model.config.num_experts
                b.copy_(torch.rand(b.shape[0], E, generator=generator).argsort(-1)[:, :b.shape[1]])
        pad = model.model.embed_tokens.padding_idx
        if pad is not None:
            model.model.embed_tokens.weight[pad].zero_()
    return model
