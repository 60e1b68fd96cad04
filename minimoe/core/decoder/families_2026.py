"""The families only transformers 5.x holds (its oracle here: 5.23, .ci/run's third environment), declared as
families.py declares the others, whose module docstring says what a record holds. decoder/__init__.py imports this
file, so that importing any of the decoder's modules registers them."""
from __future__ import annotations

from minimoe.core.decoder.families import (DEEPSEEK_FIELDS, DEEPSEEK_KEYS, DEEPSEEK_RENAMES, MLA_DEFAULTS, MLA_LORA_PATHS,
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


def dense_first_k(d: dict) -> list[int]:
    """DeepSeek-V3.2's and GLM-5's dense layers as their transformers 5 configs place them: mlp_layer_types
    ("dense" / "sparse" per layer) where config.json gives it, else the first first_k_dense_replace (default 3)."""
    if d.get("mlp_layer_types"):
        return dense_layers(d)
    return list(range(min(d.get("first_k_dense_replace", 3), d["num_hidden_layers"])))


def mlp_kinds(config) -> list[str]:
    """mlp_layer_types for a config built in code: each layer as our model runs it (transformers would otherwise
    make the first first_k_dense_replace layers dense, 3 by default)."""
    return ["sparse" if i in config.sparse_layers else "dense" for i in range(config.num_hidden_layers)]


# DeepSeek Sparse Attention on DeepSeek-V3's MLA and router (core/token_mixers/dsa_indexer.py says what the indexer
# computes and why it has no gradient). The dense layers come from mlp_layer_types, or first_k_dense_replace when it
# is absent: first_k_dense_replace is read into that default only (fixed at 0 for our rule, kept in config.extra).
# layer_types ("indexed_attention" in every layer) picks transformers' cache classes and nothing it computes.
DSA_FIELDS = DEEPSEEK_FIELDS - {"first_k_dense_replace"} | {"norm_topk_prob", "index_topk", "index_head_dim",
                                                             "index_n_heads"}
DSA_NOTE = ("scores every expert then takes the top-K, as OLMoE: OLMoE's recipe (q: q_b_proj, k and v: kv_b_proj; "
            "MLA_LORA_PATHS). The DSA indexer is not a router and is not adapted: transformers computes its top-k "
            "under no_grad, so no gradient would reach a LoRA there (peft has no default targets for the family; "
            "all-linear would wrap wq_b, wk and weights_proj, which then never train)")
# What both DSA records hold alike: V3's keys, renames, LoRA paths and router, MLA's rope always interleaved
# (DeepseekV32Attention; its config has no rope_interleave), the dense layers' rule above
DSA_COMMON = dict(
    recipe="olmoe", lora_targets=("q", "k", "v", "o", "experts"), recipe_note=DSA_NOTE,
    layer_keys=DEEPSEEK_KEYS, renames=DEEPSEEK_RENAMES, lora_paths=MLA_LORA_PATHS,
    write_defaults={"mlp_layer_types": mlp_kinds},
    unread={**MLA_UNREAD, "mlp_layer_types": lambda d: d["mlp_layer_types"]},
    harmless=frozenset({"head_dim", "layer_types"}))
DSA_FIXED = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "router_fp32": True, "rope_interleave": True,
             "first_k_dense_replace": 0}

register_family(Family(
    "deepseek_v32", "DeepseekV32ForCausalLM",
    brings="DeepSeek-V3 plus DeepSeek Sparse Attention: a lightning indexer (its own query and key projections, "
           "LayerNorm'd key, rope on halves, ReLU head scores weighed per query) keeps each query's index_topk keys, "
           "and MLA attends to those only",
    hub_examples=("deepseek-ai/DeepSeek-V3.2-Exp", "deepseek-ai/DeepSeek-V3.2"),
    name_hints=("deepseek-v3.2", "deepseek_v32"), **DSA_COMMON, config_fields=DSA_FIELDS,
    fixed={**DSA_FIXED, "index_rope_interleave": False},  # the indexer's rope on halves
    defaults={"mlp_only_layers": dense_first_k, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
              "n_shared_experts": 1, "norm_topk_prob": True, **MLA_DEFAULTS, "dense_intermediate_size": 18432,
              "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64, "max_position_embeddings": 163840,
              "bos_token_id": 0, "eos_token_id": 1}))


def glm5_indexer_types(d: dict) -> list[str]:
    """GLM-5's indexer_types when config.json has none, as GlmMoeDsaConfig derives them: index_topk_pattern ("F"
    full, "S" shared per layer), else a full layer every index_topk_freq layers from index_skip_topk_offset on."""
    pattern = d.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = max(d.get("index_topk_freq", 1), 1), d.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(d["num_hidden_layers"])]


register_family(Family(
    "glm_moe_dsa", "GlmMoeDsaForCausalLM",
    brings="DeepSeek-V3.2's sparse attention with GLM's widths: rope on interleaved pairs in the indexer, and "
           "\"shared\" layers (indexer_types) that reuse the top-k of the full layer before them, with no indexer",
    hub_examples=("zai-org/GLM-5",),
    name_hints=("glm-5", "glm_moe_dsa"), **DSA_COMMON, config_fields=DSA_FIELDS | {"indexer_types"},
    fixed={**DSA_FIXED, "index_rope_interleave": True},  # the indexer's rope on interleaved pairs
    defaults={"mlp_only_layers": dense_first_k, "indexer_types": glm5_indexer_types, "routed_scaling_factor": 2.5,
              "n_group": 1, "topk_group": 1, "n_shared_experts": 1, "norm_topk_prob": True, "kv_lora_rank": 512,
              "q_lora_rank": 2048, "qk_rope_head_dim": 64, "v_head_dim": 256, "qk_nope_head_dim": 192,
              "dense_intermediate_size": 12288, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
              "rms_norm_eps": 1e-5, "max_position_embeddings": 202752, "bos_token_id": 0, "eos_token_id": 1}))
