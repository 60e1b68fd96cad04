"""The families only transformers 5.x holds (its oracle here: 5.23, .ci/run's third environment), declared as
families.py declares the others, whose module docstring says what a record holds. decoder/__init__.py imports this
file, so that importing any of the decoder's modules registers them."""
from __future__ import annotations

from minimoe.core.decoder.families import (DEEPSEEK_FIELDS, DEEPSEEK_KEYS, DEEPSEEK_RENAMES, DELTANET_FIELDS, FAMILIES,
                                           Family, GRANITE_WRITE, MAMBA2_FIELDS, MLA_DEFAULTS, MLA_LORA_PATHS,
                                           MLA_UNREAD, PER_EXPERT_KEYS, QWEN_RENAMES, attention_kinds, register_family)
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
    brings="Qwen3-Next's hybrid with the DeltaNet projections split (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a), "
           "every layer sparse, multimodal rope sections (text: the plain partial rotary); the released files nest "
           "the text model under model.language_model. and its config under text_config",
    hub_examples=("Qwen/Qwen3.5-35B-A3B", "Qwen/Qwen3.5-122B-A10B", "Qwen/Qwen3.5-397B-A17B"),
    recipe="olmoe", lora_targets=("q", "k", "v", "o", "experts", "deltanet"), name_hints=("qwen3.5", "qwen3_5"),
    recipe_note="softmax over all experts then top-K, as OLMoE: OLMoE's recipe; LoRA as Qwen3-Next's, on the "
                "DeltaNet layers' in_proj_qkv, in_proj_z, in_proj_b, in_proj_a and out_proj too (peft names no "
                "default for it: these are its module names)",
    text_model_type="qwen3_5_moe_text", containers=("qwen3_5_moe",),
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
    containers=("gemma4",), key_prefixes={"model.language_model.": "model."},
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
