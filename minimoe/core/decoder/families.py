"""The records of the families transformers 4.57 holds, one `register_family(Family(...))` each (family_record.py
says what a record holds and why; families_2026*.py declare those only transformers 5.x holds)."""
from __future__ import annotations

import math

from minimoe.core.decoder.family_record import FAMILIES, Converted, Family, register_family

# Granite's router and routed experts, as transformers' GraniteMoe (and its shared and hybrid kin) stores them.
GRANITE_KEYS = {"mlp.gate.weight": "block_sparse_moe.router.layer.weight",
                "mlp.experts.gate_up_proj.weight": "block_sparse_moe.input_linear.weight",
                "mlp.experts.down_proj.weight": "block_sparse_moe.output_linear.weight"}
# Granite's attention_multiplier left None is our 1/sqrt(head_dim), which its config would read as 1.0.
GRANITE_WRITE = {"attention_multiplier": lambda config: config.attention_scale}

register_family(Family(
    "granitemoe", "GraniteMoeForCausalLM",
    modules_in_5={"block_sparse_moe.router.layer.": "block_sparse_moe.router."},
    brings="top-K on logits then softmax over the K; embedding, residual, attention and logits multipliers",
    hub_examples=("ibm-granite/granite-3.1-1b-a400m-base", "ibm-granite/granite-3.1-3b-a800m-base"),
    recipe="granite", lora_targets=("q", "k", "v", "experts"), name_hints=("granite",),
    layer_keys=GRANITE_KEYS,
    renames={"num_local_experts": "num_experts"},
    config_fields=frozenset({"attention_bias", "router_aux_loss_coef", "embedding_multiplier", "residual_multiplier",
                             "logits_scaling", "attention_multiplier"}),
    fixed={"norm_topk_prob": True, "topk_on_logits": True}, write_defaults=GRANITE_WRITE,
    unread={"position_embedding_type": "rope"},  # its modeling file has no NoPE branch (granitemoehybrid reads it)
    defaults={"attention_multiplier": 1.0, "max_position_embeddings": 2048, "router_aux_loss_coef": 0.001,
              "bos_token_id": 1, "eos_token_id": 2}))

# Per-expert gate, up and down matrices, as transformers 4.57 stores Qwen's and OLMoE's experts.
PER_EXPERT_KEYS = {"mlp.experts.gate_up_proj.weight": ("mlp.experts.{j}.gate_proj.weight", "mlp.experts.{j}.up_proj.weight"),
                   "mlp.experts.down_proj.weight": ("mlp.experts.{j}.down_proj.weight",)}

register_family(Family(
    "olmoe", "OlmoeForCausalLM",
    brings="softmax over all experts, then top-K (renormalised with norm_topk_prob); q/k RMSNorm over the "
           "full projection width; clip_qkv",
    hub_examples=("allenai/OLMoE-1B-7B-0924", "allenai/OLMoE-1B-7B-0125"),
    recipe="olmoe", lora_targets=("q", "k", "v", "o", "experts"), name_hints=("olmoe",),
    layer_keys=PER_EXPERT_KEYS,
    config_fields=frozenset({"attention_bias", "router_aux_loss_coef", "norm_topk_prob", "clip_qkv"}),
    fixed={"qk_norm": "full"},
    defaults={"rms_norm_eps": 1e-5, "pad_token_id": 1, "eos_token_id": 50279}))

# Qwen's config.json: moe_intermediate_size is the expert width (ours: intermediate_size), intermediate_size
# the dense layers' MLP (ours: dense_intermediate_size); mlp_only_layers and decoder_sparse_step place them.
QWEN_RENAMES = {"moe_intermediate_size": "intermediate_size", "intermediate_size": "dense_intermediate_size"}
QWEN_FIELDS = frozenset({"router_aux_loss_coef", "norm_topk_prob", "mlp_only_layers", "decoder_sparse_step",
                         "dense_intermediate_size", "use_sliding_window", "sliding_window"})
register_family(Family(
    "qwen3_moe", "Qwen3MoeForCausalLM",
    brings="per-head q/k RMSNorm; head_dim as its own field; norm_topk_prob; dense MLP layers among the MoE "
           "layers (mlp_only_layers, decoder_sparse_step)",
    hub_examples=("Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-235B-A22B"),
    recipe="olmoe", lora_targets=("q", "k", "v", "o", "experts"), name_hints=("qwen3",),
    recipe_note="softmax over all experts then top-K, as OLMoE: OLMoE's recipe (the paper trains no Qwen)",
    layer_keys=PER_EXPERT_KEYS, renames=QWEN_RENAMES,
    config_fields=QWEN_FIELDS | {"attention_bias", "head_dim"},
    fixed={"qk_norm": "head"},
    defaults={"norm_topk_prob": False, "router_aux_loss_coef": 0.001, "num_key_value_heads": 4,
              "max_position_embeddings": 32768, "dense_intermediate_size": 6144}))

register_family(Family(
    "qwen2_moe", "Qwen2MoeForCausalLM",
    brings="a shared expert beside the routed ones, scaled by its own sigmoid gate; q/k/v biases; dense MLP "
           "layers (mlp_only_layers, decoder_sparse_step)",
    hub_examples=("Qwen/Qwen1.5-MoE-A2.7B", "Qwen/Qwen2-57B-A14B"),
    recipe="olmoe", lora_targets=("q", "k", "v", "o", "experts"), name_hints=("qwen2", "qwen1.5-moe"),
    recipe_note="softmax over all experts then top-K, as OLMoE: OLMoE's recipe (the paper trains no Qwen)",
    layer_keys=PER_EXPERT_KEYS, renames=QWEN_RENAMES,
    config_fields=QWEN_FIELDS | {"qkv_bias", "shared_expert_intermediate_size"},
    fixed={"shared_expert_gate": True},
    # transformers slides the layers from max_window_layers on (layer_types); our window, every layer or none,
    # which a config.json we write says with 0 (transformers' default 28 would slide none of a smaller model)
    write_defaults={"max_window_layers": lambda config: 0},
    unread={"max_window_layers": lambda d: 0 if d.get("use_sliding_window") else d["max_window_layers"],
            "layer_types": lambda d: ["sliding_attention" if d.get("use_sliding_window") else "full_attention"]
            * d["num_hidden_layers"]},
    defaults={"qkv_bias": True, "norm_topk_prob": False, "router_aux_loss_coef": 0.001, "num_key_value_heads": 16,
              "max_position_embeddings": 32768, "dense_intermediate_size": 5632,
              "shared_expert_intermediate_size": 5632}))

register_family(Family(
    "mixtral", "MixtralForCausalLM",
    modules_in_5={"block_sparse_moe.": "mlp."},
    brings="top-2 of the softmax, renormalised; per-expert w1/w2/w3 on disk; optional sliding-window attention",
    hub_examples=("mistralai/Mixtral-8x7B-v0.1", "mistralai/Mixtral-8x22B-v0.1"),
    recipe="olmoe", lora_targets=("q", "k", "v", "o", "experts"), name_hints=("mixtral",),
    recipe_note="softmax over all experts then top-K, as OLMoE: OLMoE's recipe (the paper trains no Mixtral)",
    layer_keys={"mlp.gate.weight": "block_sparse_moe.gate.weight",
                "mlp.experts.gate_up_proj.weight": ("block_sparse_moe.experts.{j}.w1.weight",
                                                    "block_sparse_moe.experts.{j}.w3.weight"),
                "mlp.experts.down_proj.weight": ("block_sparse_moe.experts.{j}.w2.weight",)},
    renames={"num_local_experts": "num_experts"},
    config_fields=frozenset({"router_aux_loss_coef", "head_dim", "sliding_window"}),
    fixed={"norm_topk_prob": True, "use_sliding_window": True},  # a window applies whenever sliding_window is set
    defaults={"rope_theta": 1e6, "rms_norm_eps": 1e-5, "router_aux_loss_coef": 0.001, "num_key_value_heads": 8,
              "max_position_embeddings": 4096 * 32, "bos_token_id": 1, "eos_token_id": 2}))

def sliding_then_full(d: dict) -> list[str]:
    """gpt-oss's layer_types when config.json has none, as GptOssConfig's: sliding, full, sliding, ..."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(d.get("num_hidden_layers") or 0)]


def attention_kinds(config) -> list[str]:
    """layer_types as our model runs the layers (MoEConfig.window), written for a config that holds none:
    transformers' config would fill in its own (GptOssConfig's alternate)."""
    return ["sliding_attention" if config.window(i) else "full_attention" for i in range(config.num_hidden_layers)]


register_family(Family(
    "gpt_oss", "GptOssForCausalLM",
    experts_transposed_in_5=True,
    brings="attention sinks; sliding and full layers alternating (layer_types); biases on attention, router and "
           "experts; top-K on logits then softmax over the K; clamped SwiGLU, gate and up interleaved on disk; "
           "YaRN; experts in MXFP4 in the official checkpoint, dequantised on load",
    hub_examples=("openai/gpt-oss-20b", "openai/gpt-oss-120b"),
    recipe="granite", recipe_note="top-K on logits then softmax over the K, as Granite's router: its recipe, "
                                  "and Granite's LoRA targets (Q/K/V and the routed experts)",
    lora_targets=("q", "k", "v", "experts"), name_hints=("gpt-oss", "gpt_oss"),
    layer_keys={"mlp.gate.weight": "mlp.router.weight", "mlp.gate.bias": "mlp.router.bias",
                "mlp.experts.gate_up_proj.weight": Converted("mlp.experts.gate_up_proj", "gate_up_interleaved"),
                "mlp.experts.gate_up_proj_bias": Converted("mlp.experts.gate_up_proj_bias", "bias_interleaved"),
                "mlp.experts.down_proj.weight": Converted("mlp.experts.down_proj", "transposed")},
    packed_release="mxfp4", write_defaults={"layer_types": attention_kinds},
    unread={"swiglu_alpha": 1.702},  # transformers 5's name for clamped_experts.py's constant
    renames={"num_local_experts": "num_experts"},
    config_fields=frozenset({"router_aux_loss_coef", "head_dim", "sliding_window", "layer_types", "swiglu_limit"}),
    # transformers' GptOssConfig sets attention_bias itself, and its modeling file hard-codes the rest
    fixed={"attention_bias": True, "attention_sinks": True, "router_bias": True, "topk_on_logits": True,
           "norm_topk_prob": True, "use_sliding_window": True, "norm_weight_in_fp32": True, "router_fp32": True},  # the window applies on layer_types' sliding layers
    defaults={"swiglu_limit": 7.0, "sliding_window": 128, "rope_theta": 150000.0, "num_key_value_heads": 8,
              "head_dim": 64, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "router_aux_loss_coef": 0.9,
              "layer_types": sliding_then_full,
              "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                               "truncate": False, "original_max_position_embeddings": 4096}}))

# DeepSeek's config.json, as Qwen's: moe_intermediate_size is the expert width, intermediate_size the dense
# layers' (the first first_k_dense_replace); n_shared_experts un-gated shared experts (mlp.shared_experts).
DEEPSEEK_RENAMES = {"n_routed_experts": "num_experts", "moe_intermediate_size": "intermediate_size",
                    "intermediate_size": "dense_intermediate_size"}
DEEPSEEK_FIELDS = frozenset({"kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                             "attention_bias", "first_k_dense_replace", "dense_intermediate_size", "n_shared_experts",
                             "routed_scaling_factor", "n_group", "topk_group"})
# transformers' DeepseekV2Config and DeepseekV3Config agree on these (DeepSeek-V2's and V3's own widths)
MLA_DEFAULTS = {"kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
# LoRA on Multi-head Latent Attention (core/token_mixers/mla.py), which has no k_proj or v_proj: its queries come from
# q_b_proj (q_proj without a query low rank, as DeepSeek-V2-Lite) and every head's key and value from
# kv_b_proj, so "k" and "v" both name kv_b_proj (adapted once). The down-projections q_a_proj and
# kv_a_proj_with_mqa are compressions already, and the latter carries the rope key all heads share: not
# adapted (docs/families.md).
MLA_LORA_PATHS = {"q": ("self_attn.q_b_proj",), "k": ("self_attn.kv_b_proj",), "v": ("self_attn.kv_b_proj",)}
# transformers 5 writes the query-key width MLA computes from its parts
MLA_UNREAD = {"qk_head_dim": lambda d: d["qk_nope_head_dim"] + d["qk_rope_head_dim"]}
DEEPSEEK_KEYS = {**PER_EXPERT_KEYS, **{f"mlp.shared_expert.{p}_proj.weight": f"mlp.shared_experts.{p}_proj.weight"
                                       for p in ("gate", "up", "down")}}

register_family(Family(
    "deepseek_v2", "DeepseekV2ForCausalLM",
    brings="Multi-head Latent Attention (low-rank q and kv, rope and no-rope head parts); YaRN; shared experts; "
           "dense first layers (first_k_dense_replace); greedy or group-limited top-K; routed_scaling_factor",
    hub_examples=("deepseek-ai/DeepSeek-V2-Lite", "deepseek-ai/DeepSeek-V2-Lite-Chat"),
    recipe="olmoe", lora_targets=("q", "k", "v", "o", "experts"), name_hints=("deepseek-v2",),
    recipe_note="softmax over all experts then top-K, as OLMoE: OLMoE's recipe (q: q_b_proj or q_proj, "
                "k and v: kv_b_proj; MLA_LORA_PATHS)",
    layer_keys=DEEPSEEK_KEYS, renames=DEEPSEEK_RENAMES, config_fields=DEEPSEEK_FIELDS | {"topk_method"},
    unread=MLA_UNREAD, harmless=frozenset({"head_dim"}),  # MLA's widths are its own fields
    lora_paths=MLA_LORA_PATHS,
    # transformers 4.57's V2 gate scores in fp32 and never renormalises the K (DeepSeek-V2's releases say false)
    fixed={"scoring_func": "softmax", "router_fp32": True, "norm_topk_prob": False},
    defaults={"topk_method": "greedy", "first_k_dense_replace": 0, "routed_scaling_factor": 1.0, "n_shared_experts": 2,
              **MLA_DEFAULTS, "max_position_embeddings": 2048, "dense_intermediate_size": 11008,
              "bos_token_id": 1, "eos_token_id": 2}))

register_family(Family(
    "deepseek_v3", "DeepseekV3ForCausalLM",
    brings="as DeepSeek-V2, plus sigmoid scores with e_score_correction_bias for selection only and noaux_tc "
           "group-limited top-K (n_group, topk_group); norm_topk_prob",
    hub_examples=("moonshotai/Moonlight-16B-A3B", "deepseek-ai/DeepSeek-V3"),
    recipe="olmoe", lora_targets=("q", "k", "v", "o", "experts"), name_hints=("deepseek-v3", "moonlight"),
    recipe_note="scores every expert then takes the top-K, as OLMoE: OLMoE's recipe (q: q_b_proj or q_proj, "
                "k and v: kv_b_proj; MLA_LORA_PATHS)",
    layer_keys=DEEPSEEK_KEYS, renames=DEEPSEEK_RENAMES, lora_paths=MLA_LORA_PATHS,
    unread=MLA_UNREAD, harmless=frozenset({"head_dim"}),  # MLA's widths are its own fields
    config_fields=DEEPSEEK_FIELDS | {"norm_topk_prob", "rope_interleave"},
    fixed={"scoring_func": "sigmoid", "topk_method": "noaux_tc", "router_fp32": True},
    # a null rope_interleave is no interleave to transformers, interleaved pairs to us (None: V2's always): left out
    never_null=frozenset({"rope_interleave"}),
    defaults={"first_k_dense_replace": 3, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
              "n_shared_experts": 1, "norm_topk_prob": True, "rope_interleave": True, **MLA_DEFAULTS,
              "dense_intermediate_size": 18432, "bos_token_id": 0, "eos_token_id": 1}))

# The hybrids: a token mixer per layer (core/token_mixers/mixers.py), named by config.json's layer_types (`layer_kinds`).
MAMBA2_FIELDS = frozenset({"mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv",
                           "mamba_expand", "mamba_chunk_size", "mamba_conv_bias", "mamba_proj_bias"})
DELTANET_FIELDS = frozenset({"linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                             "linear_num_key_heads", "linear_num_value_heads"})

register_family(Family(
    "granitemoehybrid", "GraniteMoeHybridForCausalLM",
    modules_in_5={"block_sparse_moe.router.layer.": "block_sparse_moe.router."},
    brings="Mamba-2 layers (in_proj, causal conv1d, chunked SSD scan, gated RMSNorm) among attention layers "
           "(layer_types); attention without rope (position_embedding_type nope) or with it; a shared expert "
           "beside the routed ones; Granite's multipliers and top-K on logits",
    hub_examples=("ibm-granite/granite-4.0-h-tiny", "ibm-granite/granite-4.0-h-small"),
    recipe="granite", recipe_note="top-K on logits, as Granite's router: Granite's recipe; LoRA on the attention "
                                  "layers' Q/K/V, the routed experts and the Mamba-2 layers' in_proj and out_proj",
    lora_targets=("q", "k", "v", "experts", "mamba"), name_hints=("granite-4.0-h", "granitemoehybrid"),
    layer_keys={**GRANITE_KEYS,
                "mlp.shared_expert.gate_up_proj.weight": "shared_mlp.input_linear.weight",
                "mlp.shared_expert.down_proj.weight": "shared_mlp.output_linear.weight"},
    renames={"num_local_experts": "num_experts", "shared_intermediate_size": "shared_expert_intermediate_size",
             "layer_types": "mixer_types"},
    layer_kinds={"mamba": "mamba2", "attention": "attention"},
    unread={"time_step_limit": (0.0, math.inf)},  # core/token_mixers/mamba2.py clamps no time step
    config_fields=FAMILIES["granitemoe"].config_fields | MAMBA2_FIELDS | {
        "shared_expert_intermediate_size", "position_embedding_type", "mixer_types"},
    fixed={"norm_topk_prob": True, "topk_on_logits": True, "shared_expert_fused": True}, write_defaults=GRANITE_WRITE,
    defaults={"position_embedding_type": None, "attention_multiplier": 1.0, "router_aux_loss_coef": 0.001,
              "shared_expert_intermediate_size": 1024, "max_position_embeddings": 2048, "bos_token_id": 1,
              "eos_token_id": 2, "mixer_types": lambda d: ["mamba"] * d["num_hidden_layers"]}))  # its config's layers_block_type

register_family(Family(
    "qwen3_next", "Qwen3NextForCausalLM",
    brings="Gated DeltaNet layers (causal conv1d, the gated delta rule in chunks) among full-attention layers "
           "(layer_types); the attention output scaled by a sigmoid gate from q_proj; partial rotary; "
           "zero-centred RMSNorm (1 + w); a gated shared expert",
    hub_examples=("Qwen/Qwen3-Next-80B-A3B-Instruct", "Qwen/Qwen3-Next-80B-A3B-Thinking"),
    recipe="olmoe", lora_targets=("q", "k", "v", "o", "experts", "deltanet"), name_hints=("qwen3-next", "qwen3_next"),
    recipe_note="softmax over all experts then top-K, as OLMoE: OLMoE's recipe; LoRA also on the DeltaNet "
                "layers' in_proj_qkvz, in_proj_ba and out_proj",
    layer_keys=PER_EXPERT_KEYS, renames={**QWEN_RENAMES, "layer_types": "mixer_types"},
    layer_kinds={"linear_attention": "gated_deltanet", "full_attention": "attention"},
    ignored_prefixes=("mtp.",),  # the multi-token-prediction head of the hub files, unused by the causal LM
    config_fields=DELTANET_FIELDS | {"router_aux_loss_coef", "norm_topk_prob", "mlp_only_layers", "decoder_sparse_step",
                                     "dense_intermediate_size", "attention_bias", "head_dim", "partial_rotary_factor",
                                     "shared_expert_intermediate_size", "mixer_types"},
    fixed={"qk_norm": "head", "shared_expert_gate": True, "attn_output_gate": True, "norm_zero_centred": True},
    defaults={"norm_topk_prob": True, "router_aux_loss_coef": 0.001, "partial_rotary_factor": 0.25, "head_dim": 256,
              "shared_expert_intermediate_size": 512, "num_key_value_heads": 2, "max_position_embeddings": 32768,
              "dense_intermediate_size": 5632,
              # every full_attention_interval-th layer full attention, the others DeltaNet (Qwen3NextConfig's rule)
              "mixer_types": lambda d: ["full_attention" if (i + 1) % d.get("full_attention_interval", 4) == 0
                                        else "linear_attention" for i in range(d["num_hidden_layers"])]}))

register_family(Family(
    "granitemoeshared", "GraniteMoeSharedForCausalLM",
    modules_in_5={"block_sparse_moe.router.layer.": "block_sparse_moe.router."},
    brings="Granite MoE plus a shared expert beside the routed ones (shared_intermediate_size), its gate and up "
           "rows stored as one matrix as the routed experts'",
    hub_examples=("ibm-research/moe-7b-1b-active-shared-experts",),
    recipe="granite", lora_targets=("q", "k", "v", "experts"), name_hints=("active-shared-experts", "granitemoeshared"),
    recipe_note="Granite 3.1's router with a shared expert: Granite's recipe (LoRA on Q/K/V and the routed experts; "
                "the shared expert is neither routed nor adapted)",
    layer_keys={**GRANITE_KEYS, "mlp.shared_expert.gate_up_proj.weight": "shared_mlp.input_linear.weight",
                "mlp.shared_expert.down_proj.weight": "shared_mlp.output_linear.weight"},
    renames={"num_local_experts": "num_experts", "shared_intermediate_size": "shared_expert_intermediate_size"},
    config_fields=frozenset({"attention_bias", "router_aux_loss_coef", "embedding_multiplier", "residual_multiplier",
                             "logits_scaling", "attention_multiplier", "shared_expert_intermediate_size"}),
    unread={"position_embedding_type": "rope"},  # its modeling file has no NoPE branch
    fixed={"norm_topk_prob": True, "topk_on_logits": True, "shared_expert_fused": True}, write_defaults=GRANITE_WRITE,
    defaults={"attention_multiplier": 1.0, "max_position_embeddings": 2048, "router_aux_loss_coef": 0.001,
              "bos_token_id": 1, "eos_token_id": 2}))

register_family(Family(
    "flex_olmo", "FlexOlmoForCausalLM",
    brings="OLMo-2's norm placement (each branch's output normed: post_attention_layernorm, post_feedforward_layernorm; "
           "no input norm), q/k RMSNorm over the full projection width, norms multiplying their weight in fp32; "
           "OLMoE's softmax router",
    hub_examples=("allenai/FlexOlmo-7x7B-1T", "allenai/FlexOlmo-7x7B-1T-RT"),
    recipe="olmoe", lora_targets=("q", "k", "v", "o", "experts"), name_hints=("flexolmo",),
    recipe_note="softmax over all experts then top-K, as OLMoE: OLMoE's recipe (the paper trains no FlexOlmo)",
    layer_keys=PER_EXPERT_KEYS,
    config_fields=frozenset({"attention_bias", "router_aux_loss_coef", "norm_topk_prob"}),
    fixed={"qk_norm": "full", "norm_after": True, "norm_weight_in_fp32": True},
    defaults={"rope_theta": 500000.0, "norm_topk_prob": False, "router_aux_loss_coef": 0.01,
              "pad_token_id": 100277, "eos_token_id": 100257}))

register_family(Family(
    "glm4_moe", "Glm4MoeForCausalLM",
    brings="GQA with partial rotary (partial_rotary_factor), optional per-head q/k RMSNorm (use_qk_norm), biases on "
           "q, k, v; DeepSeek-V3's router (sigmoid scores, selection-only correction bias, noaux_tc group top-K, "
           "routed_scaling_factor), shared experts and dense first layers",
    hub_examples=("zai-org/GLM-4.5-Air", "zai-org/GLM-4.5"),
    recipe="olmoe", lora_targets=("q", "k", "v", "o", "experts"), name_hints=("glm-4.5", "glm4"),
    recipe_note="scores every expert then takes the top-K, as OLMoE: OLMoE's recipe (the paper trains no GLM)",
    layer_keys=DEEPSEEK_KEYS, renames={**DEEPSEEK_RENAMES, "attention_bias": "qkv_bias"},
    config_fields=frozenset({"qkv_bias", "head_dim", "partial_rotary_factor", "use_qk_norm", "first_k_dense_replace",
                             "dense_intermediate_size", "n_shared_experts", "routed_scaling_factor", "n_group",
                             "topk_group", "norm_topk_prob"}),
    fixed={"scoring_func": "sigmoid", "topk_method": "noaux_tc", "router_fp32": True, "qk_norm": "head"},
    defaults={"partial_rotary_factor": 0.5, "use_qk_norm": False, "qkv_bias": False, "rms_norm_eps": 1e-5,
              "first_k_dense_replace": 1, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
              "n_shared_experts": 1, "norm_topk_prob": True, "dense_intermediate_size": 10944,
              "max_position_embeddings": 131072, "num_key_value_heads": 8}))

# Llama 4's layer holds its MLP as `feed_forward`: the router, the experts stored as x @ W ([E, D, 2I] with
# the gate columns first, [E, I, D]: `Converted` "transposed"), the shared expert, and a dense layer's MLP.
LLAMA4_KEYS = {"mlp.gate.weight": "feed_forward.router.weight",
               "mlp.experts.gate_up_proj.weight": Converted("feed_forward.experts.gate_up_proj", "transposed"),
               "mlp.experts.down_proj.weight": Converted("feed_forward.experts.down_proj", "transposed"),
               **{f"mlp.shared_expert.{p}_proj.weight": f"feed_forward.shared_expert.{p}_proj.weight"
                  for p in ("gate", "up", "down")},
               **{f"mlp.{p}_proj.weight": f"feed_forward.{p}_proj.weight" for p in ("gate", "up", "down")}}
register_family(Family(
    "llama4_text", "Llama4ForCausalLM",
    brings="top-K on the logits, the sigmoid of the K scaling each expert's input (top-1 in the releases); a shared "
           "expert; MoE every interleave_moe_layer_step layers, dense between; NoPE layers (no_rope_layers) with "
           "attention temperature tuning; chunked local attention on rope layers; L2 q/k norm after rope; rope on "
           "interleaved pairs",
    hub_examples=("meta-llama/Llama-4-Scout-17B-16E", "meta-llama/Llama-4-Maverick-17B-128E"),
    recipe="granite", lora_targets=("q", "k", "v", "experts"), name_hints=("llama-4", "llama4"),
    recipe_note="top-K on the logits, as Granite's router: Granite's recipe, and its LoRA targets (Q/K/V and the "
                "routed experts); the shared expert and the dense layers are neither routed nor adapted",
    layer_keys=LLAMA4_KEYS, write_defaults={"layer_types": attention_kinds},  # None: chunks off, every layer full
    applies_aux_loss=False,  # transformers 4.57's Llama4ForCausalLM returns no aux loss whatever its config says
    renames={"num_local_experts": "num_experts", "interleave_moe_layer_step": "decoder_sparse_step",
             "intermediate_size_mlp": "dense_intermediate_size"},
    config_fields=frozenset({"head_dim", "router_aux_loss_coef", "use_qk_norm", "no_rope_layers",
                             "no_rope_layer_interval", "attention_chunk_size",
                             "layer_types", "attn_temperature_tuning", "floor_scale", "attn_scale", "moe_layers",
                             "decoder_sparse_step", "dense_intermediate_size"}),
    # transformers' Llama4TextConfig hard-codes attention_bias False and its modeling file the rest
    fixed={"scoring_func": "sigmoid", "topk_on_logits": True, "norm_topk_prob": False, "expert_input_scaled": True,
           "n_shared_experts": 1, "qk_norm": "l2", "rope_interleave": True, "rope_in_fp32": True,
           "attention_bias": False},
    defaults={"use_qk_norm": True, "no_rope_layer_interval": 4, "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1,
              "attention_chunk_size": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "head_dim": 128,
              "router_aux_loss_coef": 0.001, "decoder_sparse_step": 1, "num_key_value_heads": 8,
              "max_position_embeddings": 131072, "dense_intermediate_size": 16384, "bos_token_id": 1, "eos_token_id": 2},
    never_null=frozenset({"no_rope_layer_interval"})))
