"""The families only transformers 5.x holds (its oracle here: 5.23, .ci/run's third environment), declared as
families.py declares the others, whose module docstring says what a record holds. decoder/__init__.py imports this
file, so that importing any of the decoder's modules registers them."""
from __future__ import annotations

from minimoe.core.decoder.families import (DEEPSEEK_FIELDS, DEEPSEEK_KEYS, DEEPSEEK_RENAMES, MLA_LORA_PATHS,
                                           MLA_UNREAD, Family, register_family)
from minimoe.core.decoder.families import QWEN_RENAMES


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
    brings="gated short convolutions (C * conv(B * x), no activation) among GQA layers (layer_types conv / "
           "full_attention); per-head q/k RMSNorm; sigmoid router with a selection-only expert bias "
           "(use_expert_bias), top-K renormalised; dense first layers (num_dense_layers); w1/w2/w3 names",
    hub_examples=("LiquidAI/LFM2-8B-A1B",),
    recipe="olmoe", lora_targets=("q", "k", "v", "o", "experts", "short_conv"), name_hints=("lfm2",),
    recipe_note="scores every expert then takes the top-K, as OLMoE: OLMoE's recipe. LoRA on q, k, v, out_proj, the "
                "routed experts and the short convs' in_proj and out_proj (peft 0.21 has no default for lfm2_moe; "
                "Liquid's fine-tuning guides adapt these projections); the conv kernel and the dense layers are not",
    layer_keys=LFM2_KEYS, model_keys={"model.norm.weight": "model.embedding_norm.weight"},
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
