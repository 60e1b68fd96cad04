"""The model's configuration: `MoEConfig`, the fields every family shares, and in its `mixers` each token
mixer's own options (their dataclasses live in the mixers' files, core/token_mixers/). A family's config.json
becomes one through its record (core/decoder/families.py); flat names go in and out through `from_flat` /
`flat`, so config.json and a run's recorded model_config keep one flat shape. Checks that name the field and
what was expected run in `__post_init__`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from minimoe.core.decoder.family_record import family_of
from minimoe.core.layers.mlp import ACTIVATIONS
from minimoe.core.layers.rope import layer_type_frequencies, rope_type
from minimoe.core.routing_methods.routing import SCORE_FUNCS, TOPK_METHODS
from minimoe.core.token_mixers.mixers import FEED_FORWARD, MIXERS, flat_mixer_types, mixer_field_names, mixer_type


@dataclass
class MoEConfig:
    model_type: str  # a family_record.FAMILIES key; the family fixes some switches below (Family.fixed)
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
    attention_bias: bool = False  # biases on q, k, v and o (GQA attention), MLA's down-projections and o
    use_sliding_window: bool = False  # attend to the last `sliding_window` positions only (Mixtral: always)
    sliding_window: int | None = None
    layer_types: list | None = None  # per layer "sliding_attention" | "full_attention" | "chunked_attention"; None: alike
    mixer_types: list | None = None  # per layer a core/token_mixers/mixers.py MIXERS name; None: "mla" where mixers holds MLA's, else "attention"
    # Nemotron-H: each layer is one block with its own norm and residual, a mixer alone (mixer_types' MIXERS
    # names) or a feed-forward block alone (mixers.FEED_FORWARD in mixer_types: "moe" routed, "mlp" dense)
    single_block_layers: bool = False
    # Each token mixer's own options (core/token_mixers/mixers.py): MIXERS name -> its config_class, one per kind the layers run
    # (and each kind of a hybrid family, Family.layer_kinds); one left out is built with its defaults.
    mixers: dict = field(default_factory=dict)
    tie_word_embeddings: bool = False
    norm_topk_prob: bool = False  # renormalise the K selected weights (Granite's top-K on logits always does)
    partial_rotary_factor: float = 1.0  # rope turns the first factor * head_dim dims of each head (GLM), the rest pass
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
    moe_latent_size: int | None = None  # set: the routed experts run in this width, projected in and out (Nemotron-H)
    n_shared_experts: int = 0  # DeepSeek: shared experts of intermediate_size each, run as one of n times the width
    # The router's scoring and selection (routing.Scoring reads these; families.py says who uses which).
    scoring_func: str = "softmax"  # "softmax" | "sigmoid" (DeepSeek-V3) | "sqrtsoftplus" (DeepSeek-V4)
    topk_on_logits: bool = False  # top-K on the logits, then softmax (Granite, gpt-oss) or sigmoid (Llama 4) of the K
    expert_input_scaled: bool = False  # the combine weight scales each expert's input, not its output (Llama 4)
    topk_method: str = "greedy"  # greedy | group_limited_greedy (DeepSeek-V2) | noaux_tc (DeepSeek-V3)
    correction_bias: bool = True  # noaux_tc selects with a checkpoint bias e_score_correction_bias (Mistral 4: none)
    n_group: int = 1  # expert groups for the group-limited methods
    topk_group: int = 1  # groups kept per token
    group_mask_inf: bool = False  # experts of the groups not kept score -inf, not 0 (transformers 5's DeepSeek-V3 router)
    routed_scaling_factor: float = 1.0  # multiplies the routed experts' weights (DeepSeek)
    sigmoid_norm_eps: float = 1e-20  # added to the K sigmoid scores' sum when renormalised (DeepSeek-V3's; LFM2: 1e-6)
    router_bias: bool = False  # the gate has a bias (gpt-oss)
    router_fp32: bool = False  # the gate's matmul in fp32, its input upcast (DeepSeek); else the model dtype
    norm_weight_in_fp32: bool = False  # the layer norms multiply their weight before the cast back (gpt-oss)
    # rope dims stored as interleaved pairs; None: the mixer's own (MLA: interleaved, DeepSeek-V2 always and V3's
    # default; GQA attention: halves, but Llama 4's pairs)
    rope_interleave: bool | None = None
    rope_in_fp32: bool = False  # rotate q and k in fp32 and cast once (Llama 4's complex product); else model dtype
    swiglu_limit: float | None = None  # set: gpt-oss's clamped SwiGLU experts with biases (core/layers/clamped_experts.py)
    swiglu_clamp: float | None = None  # set: SwiGLU's inputs clamped in the experts and shared expert (DeepSeek-V4; mlp.py)
    # DeepSeek-V4's manifold-constrained hyper-connections (core/layers/hyper_connections.py): hc_mult residual streams
    # (0: one plain residual), Sinkhorn-Knopp passes and eps of their mixing
    hc_mult: int = 0
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    hash_layers: list = field(default_factory=list)  # MoE layers routed by token id (DeepSeek-V4's tid2eid; routing.py)
    norm_zero_centred: bool = False  # RMSNorm scales by 1 + weight, in fp32 (Qwen3-Next)
    # Gemma 4 (core/decoder/parallel_block.py): a dense MLP of dense_intermediate_size beside the routed experts in
    # every MoE layer, each branch normed before and after, the gate reading its own weightless norm of the stream
    parallel_dense: bool = False
    per_expert_scale: bool = False  # a learned gain per expert on its combine weight (Gemma 4; core/layers/experts.py)
    sandwich_norm: bool = False  # with norm_after: an input norm too before the mixer (Gemma's four norms a layer)
    layer_scalar: bool = False  # each layer's output times a frozen scalar of the checkpoint (Gemma 4)
    embedding_sqrt_scale: bool = False  # the embedding times sqrt(hidden_size) rounded to the model dtype (Gemma)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap) (Gemma); None: none
    # per layer type its rope ({rope_type: default | proportional, rope_theta, partial_rotary_factor}), transformers
    # 5's rope_parameters where the types differ (Gemma 4: core/layers/rope.py); None: rope_theta and rope_scaling
    rope_parameters: dict | None = None
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
    hidden_act: str = "silu"  # the experts' and MLPs': SwiGLU's gate (mlp.ACTIVATIONS) or "relu2" (no gate: Nemotron-H)
    rope_scaling: dict | None = None
    torch_dtype: str | None = None  # dtype the checkpoint was saved in
    extra: dict = field(default_factory=dict, repr=False)  # unknown config.json fields, written back on save

    @classmethod
    def from_flat(cls, flat: dict) -> MoEConfig:
        """A config from flat field names, as config.json (after the family's renames) and a run's recorded
        model_config hold them: each mixer's options go to its config, for the kinds this model holds (the
        ones its layers run, a hybrid family's every kind); another kind's are dropped, as no layer reads them."""
        d = dict(flat)
        given = d.pop("mixers", None) or {}
        held = flat_mixer_types(d) | (set(family_of(d.get("model_type")).layer_kinds.values()) - set(FEED_FORWARD))
        owners = mixer_field_names()
        options = {kind: {} for kind in held}
        for name in [k for k in d if k in owners]:
            value = d.pop(name)
            if owners[name] in options:
                options[owners[name]][name] = value
        mixers = {kind: MIXERS[kind].config_class(**mine) for kind, mine in options.items() if kind in MIXERS}
        return cls(**d, mixers={**mixers, **given})

    def flat(self) -> dict:
        """Every field by its flat name (from_flat's inverse): the shared ones, then each held mixer's options."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("mixers", "extra")}
        for options in self.mixers.values():
            d.update(vars(options))
        return d

    def __post_init__(self):
        family = family_of(self.model_type)  # the unknown model_type error names them all
        single = family.fixed.get("single_block_layers", self.single_block_layers)  # fixed: set just below
        kinds = set(MIXERS) | (set(FEED_FORWARD) if single else set())
        if self.mixer_types is not None and (len(self.mixer_types) != self.num_hidden_layers
                                             or not set(self.mixer_types) <= kinds):
            raise ValueError(f"config: mixer_types {self.mixer_types!r}; expected num_hidden_layers="
                             f"{self.num_hidden_layers} entries, each one of {sorted(kinds)}")
        self._hold_mixers(family)
        owners = mixer_field_names()
        for name, value in family.fixed.items():  # a mixer's option on its config, where the model holds that kind
            if name not in owners:
                setattr(self, name, value)
            elif owners[name] in self.mixers:
                self.mixers[owners[name]] = replace(self.mixers[owners[name]], **{name: value})
        if self.n_shared_experts:  # n SwiGLU experts summed = one of n times the width (their rows concatenated)
            self.shared_expert_intermediate_size = self.n_shared_experts * self.intermediate_size
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"config: hidden_size {self.hidden_size} is not divisible by "
                                 f"num_attention_heads {self.num_attention_heads} (and no head_dim is given)")
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.mlp_only_layers = list(self.mlp_only_layers or [])
        for options in self.mixers.values():  # what each derives from the shared fields (core/token_mixers/mixers.py)
            if hasattr(options, "resolve"):
                options.resolve(self)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"config: num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"config: num_experts_per_tok {self.num_experts_per_tok} must be in "
                             f"[1, num_experts={self.num_experts}]")
        if self.hidden_act not in (*ACTIVATIONS, "relu2") or (self.hidden_act == "relu2" and self.swiglu_limit is not None):
            raise ValueError(f"config: hidden_act {self.hidden_act!r} is not supported; expected one of "
                             f"{sorted(ACTIVATIONS)} or 'relu2' (without swiglu_limit)")
        if self.moe_latent_size is not None and not (isinstance(self.moe_latent_size, int) and self.moe_latent_size >= 1):
            raise ValueError(f"config: moe_latent_size {self.moe_latent_size!r}; expected an int >= 1 or null")
        rope_type(self.rope_scaling)  # refuses, by name, a type core/layers/rope.py does not compute
        self._check_layer_ropes()
        self._check_attention()
        if self.sliding_window is not None and not (isinstance(self.sliding_window, int) and self.sliding_window >= 1):
            raise ValueError(f"config: sliding_window {self.sliding_window!r}; expected an int >= 1 or null")
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"config: layer_types has {len(self.layer_types)} entries; expected num_hidden_layers="
                             f"{self.num_hidden_layers}")
        if not self.sparse_layers:
            raise ValueError("config: no layer is sparse (mlp_only_layers, decoder_sparse_step, first_k_dense_replace); "
                             "expected at least one MoE layer")
        dense = [i for i in range(self.num_hidden_layers) if self.has_mlp(i) and i not in self.sparse_layers]
        if dense and not self.dense_intermediate_size:
            raise ValueError("config: dense layers need dense_intermediate_size (config.json's intermediate_size)")
        if self.parallel_dense and not self.dense_intermediate_size:
            raise ValueError("config: parallel_dense (Gemma 4) needs dense_intermediate_size (config.json's "
                             "intermediate_size), the width of the dense MLP beside the experts")
        self._check_router()
        self._check_hyper_connections()

    def _check_hyper_connections(self):
        if not (isinstance(self.hc_mult, int) and self.hc_mult >= 0) or not (
                isinstance(self.hc_sinkhorn_iters, int) and self.hc_sinkhorn_iters >= 1):
            raise ValueError(f"config: hc_mult {self.hc_mult!r}, hc_sinkhorn_iters {self.hc_sinkhorn_iters!r}; expected "
                             f"an int >= 0 (0: no hyper-connections) and an int >= 1")
        if not set(self.hash_layers) <= set(self.sparse_layers):
            raise ValueError(f"config: hash_layers {self.hash_layers!r}; expected MoE layers among {self.sparse_layers}")

    def _hold_mixers(self, family):
        """`mixers` as its own copies (replace re-checks each), one per kind held, each of its mixer's class."""
        held = self.mixer_kinds | (set(family.layer_kinds.values()) - set(FEED_FORWARD))
        for kind, options in self.mixers.items():
            if kind not in held or not isinstance(options, MIXERS[kind].config_class):
                raise ValueError(f"config: mixers[{kind!r}] {options!r}; expected a {kind} config only where a "
                                 f"layer runs {kind} (mixer_types) or the family's layers may (layer_kinds), "
                                 f"of that mixer's config_class (core/token_mixers/mixers.py)")
        self.mixers = {kind: replace(self.mixers[kind]) if kind in self.mixers else MIXERS[kind].config_class()
                       for kind in sorted(held)}

    def _check_attention(self):
        kinds = ("full_attention", "sliding_attention", "chunked_attention")
        if self.layer_types is not None and not set(self.layer_types) <= set(kinds):
            raise ValueError(f"config: layer_types {self.layer_types!r}; expected each one of {kinds}")
        if not 0 < self.partial_rotary_factor <= 1 or self.rope_dim % 2:
            raise ValueError(f"config: partial_rotary_factor {self.partial_rotary_factor} turns {self.rope_dim} of "
                             f"head_dim={self.head_dim} dims; expected a factor in (0, 1] giving an even count")

    def _check_layer_ropes(self):
        if self.rope_parameters is None:
            return
        kinds = set(self.layer_types or [])
        if not kinds or not isinstance(self.rope_parameters, dict) or not kinds <= set(self.rope_parameters):
            raise ValueError(f"config: rope_parameters {self.rope_parameters!r}; expected one rope per layer type "
                             f"of layer_types ({sorted(kinds)})")
        for kind in kinds:
            layer_type_frequencies(self.rope_parameters[kind], 2)  # refuses a rope_type it does not compute

    def _check_router(self):
        if self.scoring_func not in SCORE_FUNCS:
            raise ValueError(f"config: scoring_func {self.scoring_func!r}; expected one of {SCORE_FUNCS}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"config: topk_method {self.topk_method!r}; expected one of {TOPK_METHODS}")
        if self.topk_on_logits and self.scoring_func == "sqrtsoftplus":
            raise ValueError("config: topk_on_logits (top-K on logits) takes softmax or sigmoid scores; got "
                             "scoring_func 'sqrtsoftplus'")
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
        if self.single_block_layers:  # the "moe" blocks; "mlp" ones are dense, a mixer's layer has no MLP
            return [i for i in range(self.num_hidden_layers) if mixer_type(self, i) == "moe"]
        return [i for i in range(self.num_hidden_layers) if i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0 and i >= self.first_k_dense_replace]

    def window(self, layer: int) -> int | None:
        """Layer's sliding attention window, None for full attention."""
        if not self.use_sliding_window or self.sliding_window is None or (
                self.layer_types is not None and self.layer_types[layer] != "sliding_attention"):
            return None
        return self.sliding_window

    @property
    def mixer_kinds(self) -> set[str]:
        """The MIXERS names the layers run."""
        return {mixer_type(self, i) for i in range(self.num_hidden_layers)} - set(FEED_FORWARD)

    def has_mlp(self, layer: int) -> bool:
        """Whether layer `layer` has a feed-forward block (not in a one-block-per-layer model's mixer layers)."""
        return not self.single_block_layers or mixer_type(self, layer) in FEED_FORWARD

    @property
    def rope_dim(self) -> int:  # the dims each head rotates: MLA's rope part, else the head's first partial_rotary_factor
        if "mla" in self.mixers:
            return self.mixers["mla"].qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_scale(self) -> float:
        return self.attention_multiplier if self.attention_multiplier is not None else self.head_dim ** -0.5


def config_field_names() -> list[str]:
    """Every field's flat name (config.json's, before a family's renames): the shared ones and each mixer's."""
    return [f.name for f in fields(MoEConfig) if f.name not in ("mixers", "extra")] + list(mixer_field_names())
