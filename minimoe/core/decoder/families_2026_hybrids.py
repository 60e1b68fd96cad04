"""The 2026 hybrids only transformers 5.x holds: Qwen3.5-MoE (Gated DeltaNet), Kimi Linear (Kimi Delta Attention),
LFM2-MoE (gated short convolutions) and Nemotron-H (Mamba-2, one block per layer), declared as families.py declares
the others (its module docstring says what a record holds); families_2026.py holds the attention-only ones.
decoder/__init__.py imports this file, so that importing any of the decoder's modules registers them."""
from __future__ import annotations

from minimoe.core.decoder.families import (DEEPSEEK_FIELDS, DELTANET_FIELDS, MAMBA2_FIELDS, MLA_LORA_PATHS,
                                           MLA_UNREAD, PER_EXPERT_KEYS, QWEN_RENAMES)
from minimoe.core.decoder.family_record import FAMILIES, Family, register_family
from minimoe.core.decoder.families_2026 import dense_layers


# Qwen3.5's MoE text model: Qwen3-Next's layer (transformers 5.23 builds it from Qwen3-Next's attention, norms, experts
# and gated shared expert) with the DeltaNet projections stored apart (linear_in_proj "split": in_proj_qkv, in_proj_z,
# in_proj_b, in_proj_a), every layer sparse (its config deletes mlp_only_layers, decoder_sparse_step and
# norm_topk_prob: Qwen3-VL-MoE's router always renormalises the top-K) and multimodal rope sections
# (rope_parameters' mrope_section, interleaved): rope_fields keeps them in rope_scaling, of rope_type "default".
# They split the rotary frequencies among the temporal, height and width position streams; text gives all three
# the token's position (transformers' text model expands one stream to three), so each frequency turns by that
# position: the plain partial rotary (tests/core/decoder/test_families_parity.py holds our tables to its rotary
# embedding and our logits to the vision-language model's on text).
register_family(Family(
    "qwen3_5_moe", "Qwen3_5MoeForCausalLM",
    since_transformers=5,
    brings="Qwen3-Next's hybrid with the DeltaNet projections split (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a), "
           "every layer sparse, multimodal rope sections (text: the plain partial rotary); the released files nest "
           "the text model under model.language_model. and its config under text_config",
    hub_examples=("Qwen/Qwen3.5-35B-A3B", "Qwen/Qwen3.5-122B-A10B", "Qwen/Qwen3.5-397B-A17B"),
    recipe="olmoe", lora_targets=("q", "k", "v", "o", "experts", "deltanet"), name_hints=("qwen3.5", "qwen3_5"),
    recipe_note="softmax over all experts then top-K, as OLMoE: OLMoE's recipe; LoRA as Qwen3-Next's, on the "
                "DeltaNet layers' in_proj_qkv, in_proj_z, in_proj_b, in_proj_a and out_proj too (peft names no "
                "default for it: these are its module names)",
    text_model_type="qwen3_5_moe_text", containers={"qwen3_5_moe": "qwen3_5_moe_text"},
    # transformers 5.23's save_pretrained and the qwen2_moe conversion it applies: per-expert matrices; the
    # vision-language release's keys under model.language_model. (its PrefixChange), read as ours, and its experts
    # fused ([E, 2I, D] gate rows first, [E, D, I], no .weight: Qwen3_5MoeExperts' own), read as per-expert
    layer_keys=PER_EXPERT_KEYS, key_prefixes={"model.language_model.": "model."},
    fused_banks={disk.removesuffix(".weight"): PER_EXPERT_KEYS[disk] for disk in PER_EXPERT_KEYS},
    renames={**QWEN_RENAMES, "layer_types": "mixer_types"}, layer_kinds=FAMILIES["qwen3_next"].layer_kinds,
    ignored_prefixes=("mtp.", "model.visual."),  # as Qwen3_5MoeForCausalLM's _keys_to_ignore_on_load_unexpected
    config_fields=DELTANET_FIELDS | {"router_aux_loss_coef", "attention_bias", "head_dim", "partial_rotary_factor",
                                     "shared_expert_intermediate_size", "mixer_types"},
    fixed={"qk_norm": "head", "shared_expert_gate": True, "attn_output_gate": True, "norm_zero_centred": True,
           "norm_topk_prob": True, "mlp_only_layers": [], "decoder_sparse_step": 1, "linear_in_proj": "split"},
    defaults={"router_aux_loss_coef": 0.001, "partial_rotary_factor": 0.25, "head_dim": 256,
              "shared_expert_intermediate_size": 512, "num_key_value_heads": 2, "max_position_embeddings": 32768,
              # every full_attention_interval-th layer full attention, the others DeltaNet (Qwen3_5MoeTextConfig's)
              "mixer_types": FAMILIES["qwen3_next"].defaults["mixer_types"]}))


# Kimi Linear: Kimi Delta Attention layers (core/token_mixers/kda.py) among MLA layers that turn no rope, DeepSeek-V3's
# sigmoid router with its selection-only bias and a shared expert, dense layers by mlp_layer_types. Its config.json
# names several fields its own way (KimiLinearConfig's attribute_map: num_experts_per_token, moe_renormalize,
# num_shared_experts, model_max_length, num_expert_group), and Moonshot's release gives the layer kinds and the
# linear heads inside linear_attn_config (its layers 1-indexed), which KimiLinearConfig reads when layer_types is absent.
KIMI_KEYS = {"mlp.gate.weight": "block_sparse_moe.gate.weight",
             "mlp.gate.e_score_correction_bias": "block_sparse_moe.gate.e_score_correction_bias",
             "mlp.experts.gate_up_proj.weight": ("block_sparse_moe.experts.{j}.w1.weight",
                                                 "block_sparse_moe.experts.{j}.w3.weight"),
             "mlp.experts.down_proj.weight": ("block_sparse_moe.experts.{j}.w2.weight",),
             **{f"mlp.shared_expert.{p}_proj.weight": f"block_sparse_moe.shared_experts.{p}_proj.weight"
                for p in ("gate", "up", "down")}}


def kimi_linear_option(name: str, default):
    return lambda d: (d.get("linear_attn_config") or {}).get(name, default)


def kimi_layer_kinds(d: dict) -> list[str]:
    """KimiLinearConfig's layer_types when config.json has none: from linear_attn_config's 1-indexed full_attn_layers
    and kda_layers, else every 4th layer (but the first) full attention."""
    linear = d.get("linear_attn_config") or {}
    n = d["num_hidden_layers"]
    if "full_attn_layers" in linear and "kda_layers" in linear:
        kinds = [None] * n
        for i in linear["full_attn_layers"]:
            kinds[i - 1] = "full_attention"
        for i in linear["kda_layers"]:
            kinds[i - 1] = "linear_attention"
        return kinds
    return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]


register_family(Family(
    "kimi_linear", "KimiLinearForCausalLM",
    since_transformers=5, modules_in_5={"block_sparse_moe.": "mlp."},
    brings="Kimi Delta Attention (a gated delta rule with a forget gate per key channel) among MLA layers without "
           "rope; DeepSeek-V3's sigmoid router with its selection-only bias; a shared expert; dense layers by "
           "mlp_layer_types",
    hub_examples=("moonshotai/Kimi-Linear-48B-A3B-Instruct", "moonshotai/Kimi-Linear-48B-A3B-Base"),
    recipe="olmoe", lora_targets=("q", "k", "v", "o", "experts"), name_hints=("kimi-linear", "kimi_linear"),
    recipe_note="scores every expert then takes the top-K, as OLMoE: OLMoE's recipe; q, k, v and o are the KDA "
                "layers' own projections there, MLA's as DeepSeek's elsewhere (MLA_LORA_PATHS)",
    # the release's keys, which transformers 5.23's conversion mapping reads and its save_pretrained writes back:
    # its MoE layers under block_sparse_moe, per-expert w1/w2/w3, KDA's three convs apart; a dense layer's MLP under
    # mlp. (the release's; transformers 5.23 saves it under block_sparse_moe., read as well: key_aliases)
    layer_keys=KIMI_KEYS, lora_paths=MLA_LORA_PATHS,
    key_aliases={f"block_sparse_moe.{p}_proj.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
    renames={"moe_intermediate_size": "intermediate_size", "intermediate_size": "dense_intermediate_size",
             "num_experts_per_token": "num_experts_per_tok", "moe_renormalize": "norm_topk_prob",
             "num_shared_experts": "n_shared_experts", "model_max_length": "max_position_embeddings",
             "layer_types": "mixer_types", "linear_conv_kernel_dim": "kda_conv_kernel_dim"},
    layer_kinds={"full_attention": "mla", "linear_attention": "kda"},
    config_fields=DEEPSEEK_FIELDS - {"first_k_dense_replace", "n_group", "topk_group"} | {
        "norm_topk_prob", "mixer_types", "linear_head_dim", "linear_num_heads", "kda_conv_kernel_dim"},
    fixed={"scoring_func": "sigmoid", "topk_method": "noaux_tc", "router_fp32": True, "mla_nope": True,
           "n_group": 1, "topk_group": 1},
    # KimiLinearTopkRouter masks the groups it drops with -inf where DeepSeek-V3's masks with 0: one group only
    unread={**MLA_UNREAD, "num_expert_group": 1, "topk_group": 1, "mlp_layer_types": lambda d: d["mlp_layer_types"]},
    harmless=frozenset({"head_dim"}),  # KimiLinearConfig's head_dim is qk_rope_head_dim; MLA reads its own widths
    applies_aux_loss=False,  # KimiLinearForCausalLM returns no auxiliary loss
    # what transformers reads for the layers' MLPs where config.json came from our mlp_only_layers
    write_defaults={"mlp_layer_types": lambda c: ["dense" if i in c.mlp_only_layers else "sparse"
                                                  for i in range(c.num_hidden_layers)]},
    defaults={"mixer_types": kimi_layer_kinds, "mlp_only_layers": dense_layers,
              "linear_head_dim": kimi_linear_option("head_dim", 128),
              "linear_num_heads": kimi_linear_option("num_heads", 32),
              "kda_conv_kernel_dim": kimi_linear_option("short_conv_kernel_size", 4),
              "routed_scaling_factor": 2.446, "n_shared_experts": 1, "norm_topk_prob": True, "kv_lora_rank": 512,
              "q_lora_rank": None, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
              "dense_intermediate_size": 9216, "num_key_value_heads": 32, "max_position_embeddings": 1048576,
              "rms_norm_eps": 1e-5, "pad_token_id": 163839, "bos_token_id": 163584, "eos_token_id": 163586}))


# LFM2's layer names: operator_norm before the mixer (attention, out_proj its output, q/k_layernorm its per-head norms,
# or the short conv), ffn_norm before feed_forward (SwiGLU w1/w3/w2 on the first num_dense_layers, then the MoE block,
# its selection-only bias on the block); the final norm is model.embedding_norm. The hub's files and transformers
# 5.23's save_pretrained alike (its conversion mapping fuses the per-expert w1/w3 and w2 on load, unfuses them on save).
LFM2_KEYS = {"input_layernorm.weight": "operator_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.o_proj.weight": "self_attn.out_proj.weight",
             "self_attn.q_norm.weight": "self_attn.q_layernorm.weight",
             "self_attn.k_norm.weight": "self_attn.k_layernorm.weight",
             "mlp.gate_proj.weight": "feed_forward.w1.weight", "mlp.up_proj.weight": "feed_forward.w3.weight",
             "mlp.down_proj.weight": "feed_forward.w2.weight", "mlp.gate.weight": "feed_forward.gate.weight",
             "mlp.gate.e_score_correction_bias": "feed_forward.expert_bias",
             "mlp.experts.gate_up_proj.weight": ("feed_forward.experts.{j}.w1.weight",
                                                 "feed_forward.experts.{j}.w3.weight"),
             "mlp.experts.down_proj.weight": ("feed_forward.experts.{j}.w2.weight",)}


def uses_expert_bias(d: dict) -> str:
    """LFM2's use_expert_bias as our selection: the bias added to the sigmoid scores for the choice only
    (noaux_tc, one group), or plain top-K of the sigmoid scores."""
    return "noaux_tc" if d.get("use_expert_bias", True) else "greedy"


register_family(Family(
    "lfm2_moe", "Lfm2MoeForCausalLM",
    since_transformers=5,
    brings="gated short convolutions (C * conv(B * x), no activation) among GQA layers (layer_types conv / "
           "full_attention); per-head q/k RMSNorm; sigmoid router with a selection-only expert bias "
           "(use_expert_bias), top-K renormalised; dense first layers (num_dense_layers); w1/w2/w3 names",
    hub_examples=("LiquidAI/LFM2-8B-A1B",),
    recipe="olmoe", lora_targets=("q", "k", "v", "o", "experts", "short_conv"), name_hints=("lfm2",),
    recipe_note="scores every expert then takes the top-K, as OLMoE: OLMoE's recipe. LoRA on q, k, v, out_proj, the "
                "routed experts and the short convs' in_proj and out_proj (peft 0.21 has no default for lfm2_moe; "
                "Liquid's fine-tuning guides adapt these projections); the conv kernel and the dense layers are not",
    layer_keys=LFM2_KEYS, outer_keys={"model.norm.weight": "model.embedding_norm.weight"},
    renames={**QWEN_RENAMES, "norm_eps": "rms_norm_eps", "num_dense_layers": "first_k_dense_replace",
             "layer_types": "mixer_types"},
    layer_kinds={"conv": "short_conv", "full_attention": "attention"},  # no default: transformers needs the list
    config_fields=frozenset({"conv_L_cache", "conv_bias", "first_k_dense_replace", "dense_intermediate_size",
                             "norm_topk_prob", "routed_scaling_factor", "head_dim", "mixer_types"}),
    # Lfm2MoeTopKRouter: the gate in the model dtype, sigmoid, the bias for the choice only, the K renormalised with
    # 1e-6 in the denominator, then scaled; its rope turns the whole head (the default init reads no partial factor)
    fixed={"qk_norm": "head", "scoring_func": "sigmoid", "n_group": 1, "topk_group": 1, "router_fp32": False,
           "sigmoid_norm_eps": 1e-6, "attention_bias": False, "partial_rotary_factor": 1.0},
    applies_aux_loss=False,  # Lfm2MoeForCausalLM returns no load-balancing loss
    write_defaults={"use_expert_bias": lambda config: config.topk_method == "noaux_tc"},
    # transformers pops tie_embedding (LFM2's own name) over tie_word_embeddings; both are read, and must agree
    unread={"use_expert_bias": lambda d: d["topk_method"] == "noaux_tc",
            "tie_embedding": lambda d: d["tie_word_embeddings"]},
    defaults={"topk_method": uses_expert_bias, "tie_word_embeddings": lambda d: d.get("tie_embedding", True),
              "rope_theta": 1e6, "rms_norm_eps": 1e-5, "num_key_value_heads": 8, "max_position_embeddings": 128000,
              "first_k_dense_replace": 2, "dense_intermediate_size": 7168, "norm_topk_prob": True,
              "routed_scaling_factor": 1.0, "conv_L_cache": 3, "conv_bias": False, "pad_token_id": 0,
              "bos_token_id": 1, "eos_token_id": 2}))
# Nemotron-H's config.json names each layer's block in layers_block_type, or in older files as one character
# each in hybrid_override_pattern (NemotronHConfig reads the list first, else the pattern, else its default).
NEMOTRON_BLOCKS = {"M": "linear_attention", "*": "full_attention", "E": "moe", "-": "mlp"}


def nemotron_blocks(d: dict) -> list[str]:
    if d.get("mixer_types") is not None:  # layers_block_type, renamed
        return d["mixer_types"]
    if d.get("hybrid_override_pattern") is not None:
        return [NEMOTRON_BLOCKS[c] for c in d["hybrid_override_pattern"]]
    return ["linear_attention", "moe", "full_attention", "mlp"]


def nemotron_pattern(d: dict) -> str:
    """hybrid_override_pattern as the blocks read say it: a file whose pattern and list disagree is refused."""
    back = {kind: c for c, kind in NEMOTRON_BLOCKS.items()}
    return "".join(back.get(kind, "?") for kind in nemotron_blocks(d))


# Each layer's one block is `mixer` on disk (a Mamba-2, attention, MoE or MLP block) under its `norm`.
NEMOTRON_MAMBA = ("in_proj.weight", "in_proj.bias", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D",
                  "norm.weight", "out_proj.weight", "out_proj.bias")
NEMOTRON_KEYS = {
    "input_layernorm.weight": "norm.weight", "post_attention_layernorm.weight": "norm.weight",
    **{f"mamba.{n}": f"mixer.{n}" for n in NEMOTRON_MAMBA},
    **{f"self_attn.{p}_proj.weight": f"mixer.{p}_proj.weight" for p in "qkvo"},
    "mlp.gate.weight": "mixer.gate.weight", "mlp.gate.e_score_correction_bias": "mixer.gate.e_score_correction_bias",
    "mlp.experts.up_proj.weight": ("mixer.experts.{j}.up_proj.weight",),
    "mlp.experts.down_proj.weight": ("mixer.experts.{j}.down_proj.weight",),
    "mlp.fc1_latent_proj.weight": "mixer.fc1_latent_proj.weight",
    "mlp.fc2_latent_proj.weight": "mixer.fc2_latent_proj.weight",
    **{f"mlp.shared_expert.{p}_proj.weight": f"mixer.shared_experts.{p}_proj.weight" for p in ("up", "down")},
    **{f"mlp.{p}_proj.weight": f"mixer.{p}_proj.weight" for p in ("up", "down")}}

register_family(Family(
    "nemotron_h", "NemotronHForCausalLM",
    since_transformers=5, peft_refuses_mamba_out=True,
    brings="one block per layer, each with its own norm and residual (layers_block_type or hybrid_override_pattern): "
           "Mamba-2 (gated norm per group, time step clamped at time_step_min), attention without rope, MoE or "
           "dense MLP; squared-ReLU experts without a gate; optional latent expert width (moe_latent_size); "
           "DeepSeek-V3's sigmoid router with correction bias, group top-K and scaling; a shared expert",
    hub_examples=("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-Base-BF16"),
    recipe="olmoe", lora_targets=("q", "k", "v", "o", "experts", "mamba"), name_hints=("nemotron-3", "nemotron-h", "nemotron_h"),
    recipe_note="scores every expert then takes the top-K, as OLMoE: OLMoE's recipe; LoRA on the modules peft "
                "names: the attention blocks' q/k/v/o (peft 0.21's own default for nemotron_h, and no more), plus "
                "the routed experts' up_proj and down_proj (every family's, lora_paths: up_proj for gate_up) and "
                "the Mamba-2 blocks' in_proj and out_proj (as Granite 4.0-H's: 23 of Nano's 52 layers are Mamba-2)",
    layer_keys=NEMOTRON_KEYS, layers_prefix="backbone.layers.",
    outer_keys={"model.embed_tokens.weight": "backbone.embeddings.weight", "model.norm.weight": "backbone.norm_f.weight"},
    lora_paths={"gate_up": ("mlp.experts.up_proj",)},
    ignored_prefixes=("mtp.",),  # the multi-token-prediction layers, which transformers skips on load too
    renames={"layers_block_type": "mixer_types", "n_routed_experts": "num_experts",
             "moe_intermediate_size": "intermediate_size", "intermediate_size": "dense_intermediate_size",
             "moe_shared_expert_intermediate_size": "shared_expert_intermediate_size",
             "layer_norm_epsilon": "rms_norm_eps", "mamba_num_heads": "mamba_n_heads",
             "mamba_head_dim": "mamba_d_head", "n_groups": "mamba_n_groups", "ssm_state_size": "mamba_d_state",
             "conv_kernel": "mamba_d_conv", "expand": "mamba_expand", "chunk_size": "mamba_chunk_size",
             "use_conv_bias": "mamba_conv_bias", "use_bias": "mamba_proj_bias", "time_step_min": "mamba_dt_min"},
    layer_kinds={"linear_attention": "mamba2", "full_attention": "attention", "moe": "moe", "mlp": "mlp"},
    config_fields=MAMBA2_FIELDS | {"mamba_dt_min", "mixer_types", "dense_intermediate_size", "head_dim",
                                   "shared_expert_intermediate_size", "moe_latent_size", "routed_scaling_factor",
                                   "n_group", "topk_group", "norm_topk_prob"},
    # the experts and MLPs' activation (the only one ours computes without a gate: config.json's other values
    # are refused, `unread`), NemotronHBlock, NemotronHAttention (no rope, no biases), NemotronHRMSNorm (weight times the fp32 values),
    # NemotronHTopkRouter (DeepSeek-V3's, in fp32), NemotronHRMSNormGated (per group): hard-coded there
    fixed={"single_block_layers": True, "hidden_act": "relu2", "position_embedding_type": "nope", "attention_bias": False,
           "norm_weight_in_fp32": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "router_fp32": True,
           "mamba_norm_per_group": True, "group_mask_inf": True},
    unread={"mamba_hidden_act": "silu", "mlp_hidden_act": "relu2", "hybrid_override_pattern": nemotron_pattern},
    # what its modeling file never reads: MoE's n_shared_experts (the shared expert's width is its own field),
    # init-only settings, the residual's dtype (NemotronHBlock adds in the norm weight's), the unused bias switch
    harmless=frozenset({"n_shared_experts", "moe_shared_expert_overlap", "residual_in_fp32", "rescale_prenorm_residual",
                        "time_step_max", "time_step_floor", "time_step_limit", "mamba_proj_bias", "hidden_dropout",
                        "use_mamba_kernels", "num_logits_to_keep", "mamba_ssm_cache_dtype", "mtp_layers_block_type",
                        "sliding_window"}),  # its causal mask has no window whatever the field says
    defaults={"mixer_types": nemotron_blocks, "num_hidden_layers": lambda d: len(nemotron_blocks(d)),
              "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5, "dense_intermediate_size": 21504,
              "mamba_n_heads": 128, "mamba_d_head": 64, "mamba_n_groups": 8,
              "mamba_d_state": 128, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 128,
              "mamba_conv_bias": True, "mamba_proj_bias": False, "mamba_dt_min": 0.001, "num_experts": 8,
              "intermediate_size": 7688, "shared_expert_intermediate_size": 7688, "num_experts_per_tok": 2,
              "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
              "max_position_embeddings": 4096, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}))
