"""The families only transformers 5.x holds (its oracle here: 5.23, .ci/run's third environment), declared as
families.py declares the others, whose module docstring says what a record holds. decoder/__init__.py imports this
file, so that importing any of the decoder's modules registers them."""
from __future__ import annotations

from minimoe.core.decoder.families import (DEEPSEEK_FIELDS, DEEPSEEK_KEYS, DEEPSEEK_RENAMES, MAMBA2_FIELDS, MLA_LORA_PATHS,
                                           MLA_UNREAD, Family, register_family)


# MiniMax-M2's released config.json gives its partial rotary as rotary_dim (dims per head), transformers 5's
# as partial_rotary_factor (inside rope_parameters); MiniMaxM2Config turns the one into the other.
def rotary_dim_factor(d: dict) -> float:
    return d["rotary_dim"] / d["head_dim"] if d.get("rotary_dim") is not None else 1.0


register_family(Family(
    "minimax_m2", "MiniMaxM2ForCausalLM",
    brings="q/k RMSNorm over the whole projection width, partial rotary (rotary_dim); sigmoid router with a "
           "selection-only correction bias, top-K renormalised; per-expert w1/w2/w3 on disk",
    hub_examples=("MiniMaxAI/MiniMax-M2", "MiniMaxAI/MiniMax-M2.1"),
    recipe="olmoe", lora_targets=("q", "k", "v", "o", "experts"), name_hints=("minimax-m2", "minimax_m2"),
    recipe_note="scores every expert then takes the top-K, as OLMoE: OLMoE's recipe (the paper trains no MiniMax)",
    # the hub's and transformers 5.23's save_pretrained alike (its conversion mapping: mixtral's, plus the bias)
    layer_keys={"mlp.gate.weight": "block_sparse_moe.gate.weight",
                "mlp.gate.e_score_correction_bias": "block_sparse_moe.e_score_correction_bias",
                "mlp.experts.gate_up_proj.weight": ("block_sparse_moe.experts.{j}.w1.weight",
                                                    "block_sparse_moe.experts.{j}.w3.weight"),
                "mlp.experts.down_proj.weight": ("block_sparse_moe.experts.{j}.w2.weight",)},
    renames={"num_local_experts": "num_experts"},
    config_fields=frozenset({"router_aux_loss_coef", "head_dim", "partial_rotary_factor"}),
    # MiniMaxM2SparseMoeBlock: sigmoid scores plus the bias choose, the unbiased scores renormalised weigh;
    # no groups, no scaling; its modeling file hard-codes every one of these
    fixed={"qk_norm": "full", "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
           "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "attention_bias": False},
    unread={"rotary_dim": lambda d: round(d["partial_rotary_factor"] * d["head_dim"])},
    defaults={"rope_theta": 5e6, "partial_rotary_factor": rotary_dim_factor, "head_dim": 128, "rms_norm_eps": 1e-6,
              "router_aux_loss_coef": 0.001, "num_key_value_heads": 8, "max_position_embeddings": 196608,
              "bos_token_id": 200034, "eos_token_id": 200020}))


def dense_layers(d: dict) -> list[int]:
    """GLM-4.7-Flash's mlp_layer_types ("dense" / "sparse" per layer) as our mlp_only_layers; when config.json has
    none, Glm4MoeLiteConfig's: the first layer dense, the others sparse."""
    kinds = d.get("mlp_layer_types") or ["dense"] + ["sparse"] * (d["num_hidden_layers"] - 1)
    return [i for i, kind in enumerate(kinds) if kind == "dense"]


register_family(Family(
    "glm4_moe_lite", "Glm4MoeLiteForCausalLM",
    brings="DeepSeek-V3's Multi-head Latent Attention (optional q LoRA, interleaved rope pairs) with GLM-4.5's "
           "router (sigmoid scores, selection-only bias, group top-K, routed_scaling_factor) and shared expert; "
           "dense layers by mlp_layer_types",
    hub_examples=("zai-org/GLM-4.7-Flash",),
    recipe="olmoe", lora_targets=("q", "k", "v", "o", "experts"), name_hints=("glm-4.7-flash", "glm4_moe_lite"),
    recipe_note="scores every expert then takes the top-K, as OLMoE: OLMoE's recipe (q: q_b_proj or q_proj, "
                "k and v: kv_b_proj; MLA_LORA_PATHS)",
    layer_keys=DEEPSEEK_KEYS, renames=DEEPSEEK_RENAMES, lora_paths=MLA_LORA_PATHS,
    config_fields=DEEPSEEK_FIELDS - {"first_k_dense_replace"} | {"norm_topk_prob", "rope_interleave"},
    fixed={"scoring_func": "sigmoid", "topk_method": "noaux_tc", "router_fp32": True},
    never_null=frozenset({"rope_interleave"}),  # as DeepSeek-V3's: null would be no interleave to transformers
    # mlp_layer_types is read through mlp_only_layers' default and kept (config.extra) as the file gives it
    unread={**MLA_UNREAD, "mlp_layer_types": lambda d: d["mlp_layer_types"]}, harmless=frozenset({"head_dim"}),
    defaults={"mlp_only_layers": dense_layers, "routed_scaling_factor": 1.8, "n_group": 1, "topk_group": 1,
              "n_shared_experts": 1, "norm_topk_prob": True, "rope_interleave": True, "kv_lora_rank": 512,
              "q_lora_rank": 768, "qk_rope_head_dim": 64, "v_head_dim": 256, "qk_nope_head_dim": 192,
              "dense_intermediate_size": 10240, "rms_norm_eps": 1e-5, "max_position_embeddings": 202752,
              "bos_token_id": 0, "eos_token_id": 1}))


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
           "mamba_norm_per_group": True},
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
