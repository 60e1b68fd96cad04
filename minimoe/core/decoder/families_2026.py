"""The families only transformers 5.x holds (its oracle here: 5.23, .ci/run's third environment), declared as
families.py declares the others, whose module docstring says what a record holds; the hybrids among them are in
families_2026_hybrids.py. decoder/__init__.py imports both, so that importing any of the decoder's modules registers
them."""
from __future__ import annotations

from minimoe.core.decoder.families import (DEEPSEEK_FIELDS, DEEPSEEK_KEYS, DEEPSEEK_RENAMES, GRANITE_WRITE,
                                           MLA_DEFAULTS, MLA_LORA_PATHS, MLA_UNREAD, PER_EXPERT_KEYS, attention_kinds)
from minimoe.core.decoder.family_record import Family, register_family
from minimoe.core.token_mixers.attention import gemma_layer_types, mimo_layer_types


# MiniMax-M2's released config.json gives its partial rotary as rotary_dim (dims per head), transformers 5's
# as partial_rotary_factor (inside rope_parameters); MiniMaxM2Config turns the one into the other.
def rotary_dim_factor(d: dict) -> float:
    return d["rotary_dim"] / d["head_dim"] if d.get("rotary_dim") is not None else 1.0


register_family(Family(
    "minimax_m2", "MiniMaxM2ForCausalLM",
    since_transformers=5, modules_in_5={"block_sparse_moe.": "mlp."},
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
    since_transformers=5,
    brings="DeepSeek-V3's Multi-head Latent Attention (optional q LoRA, interleaved rope pairs) with GLM-4.5's "
           "router (sigmoid scores, selection-only bias, group top-K, routed_scaling_factor) and shared expert; "
           "dense layers by mlp_layer_types",
    hub_examples=("zai-org/GLM-4.7-Flash",),
    recipe="olmoe", lora_targets=("q", "k", "v", "o", "experts"), name_hints=("glm-4.7-flash", "glm4_moe_lite"),
    recipe_note="scores every expert then takes the top-K, as OLMoE: OLMoE's recipe (q: q_b_proj or q_proj, "
                "k and v: kv_b_proj; MLA_LORA_PATHS)",
    layer_keys=DEEPSEEK_KEYS, renames=DEEPSEEK_RENAMES, lora_paths=MLA_LORA_PATHS,
    config_fields=DEEPSEEK_FIELDS - {"first_k_dense_replace"} | {"norm_topk_prob", "rope_interleave"},
    fixed={"scoring_func": "sigmoid", "topk_method": "noaux_tc", "router_fp32": True, "group_mask_inf": True},
    never_null=frozenset({"rope_interleave"}),  # as DeepSeek-V3's: null would be no interleave to transformers
    # mlp_layer_types is read through mlp_only_layers' default and kept (config.extra) as the file gives it
    unread={**MLA_UNREAD, "mlp_layer_types": lambda d: d["mlp_layer_types"]}, harmless=frozenset({"head_dim"}),
    defaults={"mlp_only_layers": dense_layers, "routed_scaling_factor": 1.8, "n_group": 1, "topk_group": 1,
              "n_shared_experts": 1, "norm_topk_prob": True, "rope_interleave": True, "kv_lora_rank": 512,
              "q_lora_rank": 768, "qk_rope_head_dim": 64, "v_head_dim": 256, "qk_nope_head_dim": 192,
              "dense_intermediate_size": 10240, "rms_norm_eps": 1e-5, "max_position_embeddings": 202752,
              "bos_token_id": 0, "eos_token_id": 1}))


# Mistral 4 (Mistral Small 4): DeepSeek-V3's MLA and shared expert, a softmax router grouped as noaux_tc ranks groups
# (the sum of each group's two best scores) with no correction bias, Llama 4's query scaling by position, and the
# experts fused on disk as transformers 5 stores them ([E, 2I, D] gate rows then up rows; [E, D, I]).
def mistral4_rope(d: dict) -> dict:
    """Mistral4Config's rope when config.json gives none: YaRN from 8k to its max_position_embeddings."""
    return {"type": "yarn", "rope_type": "yarn", "factor": 128.0, "original_max_position_embeddings": 8192,
            "max_position_embeddings": d.get("max_position_embeddings", 1048576), "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}


def mistral4_query_beta(d: dict):
    return (d.get("rope_scaling") or mistral4_rope(d)).get("llama_4_scaling_beta")


def mla_rotary_factor(d: dict) -> float:
    return d["qk_rope_head_dim"] / (d["qk_nope_head_dim"] + d["qk_rope_head_dim"])


register_family(Family(
    "mistral4", "Mistral4ForCausalLM",
    since_transformers=5,
    brings="MLA (low-rank q, interleaved rope pairs) under YaRN with Llama 4's query scaling by position; a softmax "
           "router ranking expert groups by their two best scores, no correction bias; a shared expert; fused experts",
    hub_examples=("mistralai/Mistral-Small-4-119B-2603",),
    recipe="olmoe", lora_targets=("q", "k", "v", "o", "experts"), name_hints=("mistral-small-4", "mistral4"),
    recipe_note="softmax over all experts then top-K, as OLMoE: OLMoE's recipe (q: q_b_proj or q_proj, "
                "k and v: kv_b_proj; MLA_LORA_PATHS)",
    layer_keys={"mlp.experts.gate_up_proj.weight": "mlp.experts.gate_up_proj",
                "mlp.experts.down_proj.weight": "mlp.experts.down_proj",
                **{k: v for k, v in DEEPSEEK_KEYS.items() if k.startswith("mlp.shared_expert.")}},
    renames=DEEPSEEK_RENAMES, lora_paths=MLA_LORA_PATHS,
    config_fields=DEEPSEEK_FIELDS | {"norm_topk_prob", "rope_interleave"},
    # the release: Mistral3ForConditionalGeneration's config.json (model_type mistral3, this as its text_config) and
    # its text model's keys as transformers 5.23 holds them (model.language_model., lm_head.) or as its llava
    # conversion reads and its save_pretrained writes them (language_model.model., language_model.lm_head.); the
    # vision tower and projector are not loaded
    containers={"mistral3": "mistral"},
    key_prefixes={"model.language_model.": "model.", "language_model.model.": "model.",
                  "language_model.lm_head.": "lm_head."},
    ignored_prefixes=("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector."),
    # Mistral4TopkRouter: the gate in the model's dtype, softmax scores, noaux_tc's group ranking without a bias
    fixed={"scoring_func": "softmax", "topk_method": "noaux_tc", "correction_bias": False},
    never_null=frozenset({"rope_interleave"}),
    # rope turns the r rope dims of each n + r wide head: transformers derives its rope width from this factor
    unread={**MLA_UNREAD, "partial_rotary_factor": mla_rotary_factor}, harmless=frozenset({"head_dim"}),
    applies_aux_loss=False,  # Mistral4ForCausalLM returns no auxiliary loss
    # which transformers 5 reads into rope_parameters; without it the rope turns all n + r dims of a head
    write_defaults={"partial_rotary_factor": lambda c: c.mixers["mla"].qk_rope_head_dim / (
        c.mixers["mla"].qk_rope_head_dim + c.mixers["mla"].qk_nope_head_dim)},
    defaults={"rope_scaling": mistral4_rope, "llama_4_scaling_beta": mistral4_query_beta, "first_k_dense_replace": 0, "routed_scaling_factor": 1.0,
              "n_group": 1, "topk_group": 1, "n_shared_experts": 1, "norm_topk_prob": True, "rope_interleave": True,
              "kv_lora_rank": 256, "q_lora_rank": 1024, "qk_rope_head_dim": 64, "v_head_dim": 128,
              "qk_nope_head_dim": 64, "dense_intermediate_size": 12288, "num_key_value_heads": 32,
              "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6, "pad_token_id": 11, "bos_token_id": 1,
              "eos_token_id": 2}))
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
             "first_k_dense_replace": 0, "group_mask_inf": True}

register_family(Family(
    "deepseek_v32", "DeepseekV32ForCausalLM",
    since_transformers=5,
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
    since_transformers=5,
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


# Gemma 4's MoE text model (Gemma4TextConfig, model_type gemma4_text; the released checkpoints nest it as the
# text_config of a gemma4 config.json, docs/families.md). Its full_attention ("global") layers have their own head
# width and, where keys are values, key/value heads: config.json gives them as global_head_dim and
# num_global_key_value_heads, or, as transformers 5.23 saves them, as per_layer_config (layer -> its overrides).
def gemma4_global(d: dict, name: str, default):
    """A global layer's head_dim or num_key_value_heads as per_layer_config gives it (its first full layer's), else
    `default`; per_layer_config is then held equal to what our fields give (Family.unread)."""
    layers = [v for v in (d.get("per_layer_config") or {}).values() if isinstance(v, dict)]
    return layers[0].get(name, default) if layers else default


def gemma4_per_layer_config(d: dict) -> dict:
    """per_layer_config as Gemma4TextConfig builds it from global_head_dim and num_global_key_value_heads."""
    override = {"head_dim": d["global_head_dim"]}
    if d.get("attention_k_eq_v") and d.get("num_global_key_value_heads") is not None:
        override["num_key_value_heads"] = d["num_global_key_value_heads"]
    kinds = d.get("layer_types") or gemma_layer_types(d["num_hidden_layers"])  # AttentionConfig.resolve's default
    return {str(i): override for i, kind in enumerate(kinds) if kind == "full_attention"}


register_family(Family(
    "gemma4_text", "Gemma4ForCausalLM",
    since_transformers=5,
    brings="a dense MLP beside the routed experts in every layer, each branch normed before and after; a router on "
           "its own weightless norm with a learned input scale and per-expert scale; sliding and global layers "
           "with their own head width and KV heads, keys = values and a rope per layer type (proportional, "
           "partial) on the global ones; q/k/v norms, attention scale 1; layer scalars; the embedding times "
           "sqrt(hidden); logits softcapped; GELU (tanh) experts stored fused",
    hub_examples=("google/gemma-4-26B-A4B", "google/gemma-4-26B-A4B-it"),
    recipe="olmoe", lora_targets=("q", "k", "v", "o", "experts"), name_hints=("gemma-4", "gemma4"),
    recipe_note="softmax over all experts then top-K, as OLMoE: OLMoE's recipe (the paper trains no Gemma); v on "
                "the sliding layers only (the global layers' keys are values: no v_proj, as peft finds none)",
    # save_pretrained's names (transformers 5.23 has no conversion for gemma4: the hub's are these, under
    # model.language_model. in the released multimodal checkpoints)
    layer_keys={"mlp.gate.weight": "router.proj.weight", "parallel.gate_input_scale": "router.scale",
                "mlp.experts.per_expert_scale": "router.per_expert_scale",
                "mlp.experts.gate_up_proj.weight": "experts.gate_up_proj",
                "mlp.experts.down_proj.weight": "experts.down_proj",
                **{f"parallel.dense.{p}_proj.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
                **{f"parallel.{n}.weight": f"{n}.weight" for n in (
                    "pre_feedforward_layernorm", "post_feedforward_layernorm_1", "pre_feedforward_layernorm_2",
                    "post_feedforward_layernorm_2")}},
    renames={"hidden_activation": "hidden_act", "intermediate_size": "dense_intermediate_size",
             "moe_intermediate_size": "intermediate_size", "top_k_experts": "num_experts_per_tok"},
    config_fields=frozenset({"head_dim", "attention_bias", "sliding_window", "layer_types", "final_logit_softcapping",
                             "rope_parameters", "global_head_dim", "num_global_key_value_heads", "attention_k_eq_v",
                             "dense_intermediate_size"}),
    # Gemma4TextDecoderLayer, Gemma4TextAttention and Gemma4TextRouter hard-code these
    fixed={"qk_norm": "head", "v_norm": True, "norm_after": True, "sandwich_norm": True, "norm_weight_in_fp32": True,
           "parallel_dense": True, "per_expert_scale": True, "layer_scalar": True, "embedding_sqrt_scale": True,
           "attention_multiplier": 1.0, "norm_topk_prob": True, "use_sliding_window": True, "scoring_func": "softmax"},
    applies_aux_loss=False,  # Gemma4ForCausalLM returns no load-balancing loss
    # the released checkpoints: Gemma4ForConditionalGeneration's config.json (model_type gemma4, this as its
    # text_config), the text model under model.language_model.; its vision and audio towers are not loaded
    containers={"gemma4": "gemma4_text"}, key_prefixes={"model.language_model.": "model."},
    ignored_prefixes=("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio."),
    # what a config built here must say for transformers to build this model (its defaults build another)
    write_defaults={"enable_moe_block": lambda config: True, "hidden_size_per_layer_input": lambda config: 0,
                    "num_kv_shared_layers": lambda config: 0},
    unread={"enable_moe_block": True,  # false: the dense Gemma 4, not an MoE
            "hidden_size_per_layer_input": 0,  # per-layer embeddings (the small Gemma 4s): not implemented
            "num_kv_shared_layers": 0,  # layers reusing an earlier layer's keys and values: not implemented
            # text only: "vision" changes nothing without image tokens; "all" (bidirectional) is not supported
            "use_bidirectional_attention": lambda d: d["use_bidirectional_attention"] if d[
                "use_bidirectional_attention"] == "vision" else None,
            "per_layer_config": gemma4_per_layer_config},
    unread_defaults={"enable_moe_block": False, "hidden_size_per_layer_input": 256},  # Gemma4TextConfig's
    # the per-layer embeddings' vocabulary (none here); the double-wide MLP of KV-shared layers (none here)
    harmless=frozenset({"vocab_size_per_layer_input", "use_double_wide_mlp"}),
    defaults={"vocab_size": 262144, "hidden_size": 2304, "dense_intermediate_size": 9216, "num_hidden_layers": 30,
              "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
              "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "pad_token_id": 0, "eos_token_id": 1,
              "bos_token_id": 2, "tie_word_embeddings": True, "attention_bias": False, "sliding_window": 512,
              "final_logit_softcapping": None, "attention_k_eq_v": False,
              "global_head_dim": lambda d: gemma4_global(d, "head_dim", 512),
              "num_global_key_value_heads": lambda d: gemma4_global(d, "num_key_value_heads", None),
              "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                  "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                     "rope_theta": 1000000.0}}}))


# Granite's MoE with sliding-window layers and attention sinks (IBM's granite-swash): Granite's router, multipliers and
# fused shared expert, gpt-oss's sinks and sliding/full layer_types, and a rope theta per layer (0: no rope), which we
# run as one theta and NoPE layers (no_rope_layers); a file with two different non-zero thetas, or one unlike
# rope_parameters' rope_theta, is refused by name. transformers 5.23 has no conversion mapping for it: its
# save_pretrained names (fused 3-D experts, router.weight) are the ones read.
def granite_swa_no_rope(d: dict):
    thetas = d.get("layer_rope_theta")
    return None if thetas is None else [int(t != 0) for t in thetas]


def granite_swa_theta(d: dict) -> float:
    return next((t for t in d.get("layer_rope_theta") or () if t), 10000.0)


def granite_swa_layer_thetas(d: dict) -> list:
    """The per-layer thetas our model runs: rope_theta where a layer turns, 0 where it does not."""
    return [d["rope_theta"] if rope else 0 for rope in d.get("no_rope_layers") or [1] * d["num_hidden_layers"]]


def granite_swa_kinds(d: dict) -> list[str]:
    """GraniteMoeSWAConfig's layer_types when config.json has none: every fourth layer (the first) full."""
    return ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(d.get("num_hidden_layers") or 0)]


register_family(Family(
    "granitemoe_swa", "GraniteMoeSWAForCausalLM",
    since_transformers=5,
    brings="Granite MoE with sliding-window layers (layer_types), attention sinks and a rope theta per layer (0: no "
           "rope); Granite's multipliers and optional fused shared expert; experts fused on disk",
    hub_examples=("ibm-granite/granite-swash-3b-a600m",),
    recipe="granite", lora_targets=("q", "k", "v", "experts"), name_hints=("granite-swash", "granitemoe_swa"),
    recipe_note="Granite's router (top-K on logits, softmax over the K): Granite's recipe and LoRA targets (Q/K/V and "
                "the routed experts; the shared expert is neither routed nor adapted)",
    layer_keys={"mlp.gate.weight": "block_sparse_moe.router.weight",
                "mlp.experts.gate_up_proj.weight": "block_sparse_moe.experts.gate_up_proj",
                "mlp.experts.down_proj.weight": "block_sparse_moe.experts.down_proj",
                "mlp.shared_expert.gate_up_proj.weight": "shared_mlp.input_linear.weight",
                "mlp.shared_expert.down_proj.weight": "shared_mlp.output_linear.weight"},
    renames={"shared_intermediate_size": "shared_expert_intermediate_size"},
    config_fields=frozenset({"attention_bias", "router_aux_loss_coef", "embedding_multiplier", "residual_multiplier",
                             "logits_scaling", "attention_multiplier", "shared_expert_intermediate_size",
                             "sliding_window", "layer_types"}),
    fixed={"norm_topk_prob": True, "topk_on_logits": True, "shared_expert_fused": True, "attention_sinks": True,
           "use_sliding_window": True},  # the window applies on layer_types' sliding layers
    # the per-layer thetas are read into rope_theta and no_rope_layers, and held to them
    unread={"layer_rope_theta": granite_swa_layer_thetas},
    write_defaults={**GRANITE_WRITE, "layer_types": attention_kinds, "layer_rope_theta": lambda c: [
        c.rope_theta if c.mixers["attention"].no_rope_layers is None or c.mixers["attention"].no_rope_layers[i] else 0
        for i in range(c.num_hidden_layers)]},
    defaults={"no_rope_layers": granite_swa_no_rope, "rope_theta": granite_swa_theta, "layer_types": granite_swa_kinds,
              "sliding_window": 128, "attention_multiplier": 1.0, "max_position_embeddings": 2048,
              "router_aux_loss_coef": 0.001, "bos_token_id": 1, "eos_token_id": 2}))


# Xiaomi's MiMo-V2-Flash: GQA whose sliding layers have twice the key/value heads and the attention sinks, values
# narrower than keys (v_head_dim) and scaled (attention_value_scale), a rope per layer type turning each head's first
# partial_rotary_factor (0.334 where an entry gives none); DeepSeek-V3's sigmoid router without shared experts; dense
# layers by mlp_layer_types. Keys: the hub's (transformers 5.23's conversion mapping: Qwen2-MoE's per-expert
# matrices, the sinks as attention_sink_bias), which its save_pretrained writes too; the MTP layers are not loaded.
def mimo_sliding_window(d: dict) -> int:
    """MiMoV2FlashConfig's window: sliding_window_size + 1 where config.json gives that (SGLang's size counts the
    keys before the query), else 129."""
    return d["sliding_window_size"] + 1 if d.get("sliding_window_size") is not None else 129


def mimo_layers(d: dict) -> dict:
    """config.json's fields with MiMoV2FlashConfig's layer count (48) where it gives none, for the defaults by layer."""
    return {"num_hidden_layers": 48, **d}


register_family(Family(
    "mimo_v2_flash", "MiMoV2FlashForCausalLM",
    since_transformers=5,
    brings="sliding layers with twice the KV heads and attention sinks; values narrower than keys (v_head_dim) and "
           "scaled; a rope theta per layer type on a partial rotary; DeepSeek-V3's sigmoid router, no shared expert",
    hub_examples=("XiaomiMiMo/MiMo-V2-Flash", "XiaomiMiMo/MiMo-V2-Flash-Base"),
    recipe="olmoe", lora_targets=("q", "k", "v", "o", "experts"), name_hints=("mimo-v2-flash", "mimo_v2_flash"),
    recipe_note="scores every expert then takes the top-K, as OLMoE: OLMoE's recipe (the paper trains no MiMo); the "
                "sinks are neither routed nor adapted",
    layer_keys={**PER_EXPERT_KEYS, "self_attn.sinks": "self_attn.attention_sink_bias"},
    ignored_prefixes=("model.mtp.",),  # as MiMoV2FlashPreTrainedModel's _keys_to_ignore_on_load_unexpected
    renames={**DEEPSEEK_RENAMES, "attention_bias": "qkv_bias", "v_head_dim": "value_head_dim"},
    config_fields=frozenset({"qkv_bias", "head_dim", "value_head_dim", "attention_value_scale", "sliding_window",
                             "layer_types", "rope_parameters", "dense_intermediate_size", "routed_scaling_factor",
                             "n_group", "topk_group", "norm_topk_prob"}),
    # MiMoV2FlashAttention, MiMoV2FlashTopkRouter (DeepSeek-V3's) and MiMoV2FlashMoE hard-code these
    # (its groups not kept mask to -inf, where transformers 4.57's DeepSeek-V3 router masked them to 0)
    fixed={"scoring_func": "sigmoid", "topk_method": "noaux_tc", "router_fp32": True, "group_mask_inf": True,
           "n_shared_experts": 0, "attention_sinks": True, "sinks_sliding_only": True, "sliding_kv_factor": 2,
           "use_sliding_window": True, "layer_rope_partial": 0.334},
    null_defaults=frozenset({"routed_scaling_factor"}),
    write_defaults={"mlp_layer_types": mlp_kinds},
    # sliding_window_size is read into sliding_window's default, and held to it; mlp_layer_types into mlp_only_layers'
    unread={"sliding_window_size": lambda d: d["sliding_window"] - 1,
            "mlp_layer_types": lambda d: d["mlp_layer_types"]},
    defaults={"vocab_size": 152576, "hidden_size": 4096, "dense_intermediate_size": 16384, "num_hidden_layers": 48,
              "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 192, "value_head_dim": 128,
              "intermediate_size": 2048, "num_experts": 256, "num_experts_per_tok": 8, "rms_norm_eps": 1e-5,
              "max_position_embeddings": 131072, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
              "norm_topk_prob": True, "qkv_bias": False, "bos_token_id": 1, "attention_value_scale": 0.707,
              "sliding_window": mimo_sliding_window, "mlp_only_layers": lambda d: dense_layers(mimo_layers(d)),
              "layer_types": lambda d: mimo_layer_types(mimo_layers(d)["num_hidden_layers"]),
              "rope_parameters": {kind: {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.334}
                                  for kind, theta in (("full_attention", 5000000.0), ("sliding_attention", 10000.0))}}))
