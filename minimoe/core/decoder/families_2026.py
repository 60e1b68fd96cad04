"""The families only transformers 5.x holds (its oracle here: 5.23, .ci/run's third environment), declared as
families.py declares the others, whose module docstring says what a record holds. decoder/__init__.py imports this
file, so that importing any of the decoder's modules registers them."""
from __future__ import annotations

from minimoe.core.decoder.families import (DEEPSEEK_FIELDS, DEEPSEEK_KEYS, DEEPSEEK_RENAMES, MLA_LORA_PATHS,
                                           MLA_UNREAD, Family, register_family)
from minimoe.core.token_mixers.attention import gemma_layer_types


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
    containers=("gemma4",),
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
