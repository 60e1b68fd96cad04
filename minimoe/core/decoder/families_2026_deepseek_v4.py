"""DeepSeek-V4 (transformers 5 only; its oracle here: 5.23), declared as families.py declares the others, whose module
docstring says what a record holds; apart from families_2026.py for its size. decoder/__init__.py imports it.

What it brings: core/token_mixers/compressed_attention.py's attention in every layer (config.json's layer_types:
sliding, CSA or HCA), hyper-connections (core/layers/hyper_connections.py), hash routing in the first MoE layers
(mlp_layer_types "hash_moe": our hash_layers), a sqrt-softplus router with a selection-only bias, SwiGLU inputs
clamped in the routed experts and the shared expert (swiglu_clamp; gpt-oss's swiglu_limit is another SwiGLU).

Decisions:
- rope_parameters holds two ropes, "main" (the sliding layers) and "compress" (the compressed ones, YaRN in the
  releases, its attention_factor 1): read into rope_theta, compress_rope_theta, compress_rope_scaling and
  partial_rotary_factor, and held to them (a top-level rope_theta or compress_rope_theta that disagrees with the
  nested one is refused by name: transformers would run the nested one). A config.json without rope_parameters
  (the release's own) gives the compress rope's YaRN as rope_scaling, as DeepseekV4Config reads it.
- Checkpoint keys in the release's names (attn.wq_a, ffn.experts.{j}.w1, hc_attn_fn, ...), which transformers 5.23's
  save_pretrained writes under model. (its conversion mapping reversed) and the release without it; the releases'
  FP8/FP4 weights with their scales are not read (refused by key name). The multi-token-prediction layers (mtp.)
  are not loaded, as transformers ignores them.
- config.json's q_lora_rank, layer_types, index_* and swiglu_limit are read under the compressed mixer's own names
  (MLA, DSA and gpt-oss own those names); num_key_value_heads, attention_bias and n_shared_experts are not read by
  its modeling file (one key/value head, no biases, one shared expert of the experts' width).
"""
from __future__ import annotations

from minimoe.core.decoder.family_record import Family, register_family

V4_KINDS = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
V4_ATTENTION = {"q_a_proj.weight": "wq_a.weight", "q_a_norm.weight": "q_norm.weight", "q_b_proj.weight": "wq_b.weight",
                "kv_proj.weight": "wkv.weight", "kv_norm.weight": "norm.weight", "o_a_proj.weight": "wo_a.weight",
                "o_b_proj.weight": "wo_b.weight", "sinks": "attn_sink"}
V4_COMPRESSOR = {"kv_proj.weight": "wkv.weight", "gate_proj.weight": "wgate.weight", "position_bias": "ape",
                 "kv_norm.weight": "norm.weight"}
V4_KEYS = {
    **{f"self_attn.{ours}": f"attn.{disk}" for ours, disk in V4_ATTENTION.items()},
    **{f"self_attn.compressor.{ours}": f"attn.compressor.{disk}" for ours, disk in V4_COMPRESSOR.items()},
    **{f"self_attn.compressor.indexer.{ours}": f"attn.indexer.compressor.{disk}" for ours, disk in V4_COMPRESSOR.items()},
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    **{f"{block}_hc.{p}": f"hc_{block}_{p}" for block in ("attn", "ffn") for p in ("fn", "base", "scale")},
    "mlp.gate.weight": "ffn.gate.weight", "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.experts.gate_up_proj.weight": ("ffn.experts.{j}.w1.weight", "ffn.experts.{j}.w3.weight"),
    "mlp.experts.down_proj.weight": ("ffn.experts.{j}.w2.weight",),
    **{f"mlp.shared_expert.{p}_proj.weight": f"ffn.shared_experts.w{n}.weight"
       for p, n in (("gate", 1), ("up", 3), ("down", 2))}}


def v4_layer_types(d: dict) -> list[str]:
    """DeepseekV4Config's layer_types when config.json has none: its legacy compress_ratios (0, 4, 128 per layer),
    else two HCA layers, then CSA and HCA in turn."""
    if d.get("compress_ratios") is not None:
        return [{0: V4_KINDS[0], 4: V4_KINDS[1], 128: V4_KINDS[2]}[r] for r in d["compress_ratios"]]
    n = d["num_hidden_layers"]
    return [V4_KINDS[2]] * min(n, 2) + [V4_KINDS[1] if i % 2 else V4_KINDS[2] for i in range(max(n - 2, 0))]


def v4_mlp_kinds(d: dict) -> list[str]:
    """mlp_layer_types as DeepseekV4Config fills it in: the first num_hash_layers (default 3) "hash_moe"."""
    n, hashed = d["num_hidden_layers"], d.get("num_hash_layers", 3)
    return d.get("mlp_layer_types") or ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)


def v4_rope(d: dict, kind: str) -> dict:
    return (d.get("rope_parameters") or {}).get(kind) or {}


def v4_compress_scaling(d: dict) -> dict | None:
    """The compress rope's scaling (YaRN): what is left of rope_parameters["compress"] but its theta and factor; in a
    config.json without rope_parameters, its rope_scaling, as DeepseekV4Config turns it into the compress rope
    (attention_factor 1: the reference does not scale cos and sin)."""
    if v4_rope(d, "compress"):
        scaling = {k: v for k, v in v4_rope(d, "compress").items() if k not in ("rope_theta", "partial_rotary_factor")}
    else:
        scaling = {"rope_type": "default", **(d.get("rope_scaling") or {})}
        scaling["rope_type"] = scaling.pop("type", scaling["rope_type"])
        if scaling["rope_type"] == "yarn":
            scaling.setdefault("attention_factor", 1.0)
    return None if scaling.get("rope_type", "default") == "default" and set(scaling) <= {"rope_type"} else scaling


def v4_rope_parameters(d: dict) -> dict:
    """rope_parameters as DeepseekV4Config writes it, from our fields (flat names)."""
    share = {"partial_rotary_factor": d["partial_rotary_factor"]}
    return {"main": {"rope_type": "default", "rope_theta": d["rope_theta"], **share},
            "compress": {**(d.get("compress_rope_scaling") or {"rope_type": "default"}),
                         "rope_theta": d["compress_rope_theta"], **share}}


# transformers 5's module names where its conversion mapping renames the release's on load (the peft export's
# targets: its LoRA targets' modules, lora_paths, among them)
DEEPSEEK_V4_MODULES_IN_5 = {"ffn.": "mlp.", "attn.wq_b.": "self_attn.q_b_proj.", "attn.wkv.": "self_attn.kv_proj.",
                            "attn.wo_b.": "self_attn.o_b_proj.", "attn.wo_a.": "self_attn.o_a_proj."}

register_family(Family(
    "deepseek_v4", "DeepseekV4ForCausalLM",
    since_transformers=5, modules_in_5=DEEPSEEK_V4_MODULES_IN_5,
    brings="compressed sparse attention: one shared key/value head with sinks over a sliding window, plus compressed "
           "entries (HCA's, and CSA's overlapping ones picked by a lightning indexer), rope on the last dims undone "
           "on the output, a grouped output projection; manifold-constrained hyper-connections (N residual streams, "
           "Sinkhorn-Knopp mixing); hash routing by token id in the first layers; a sqrt-softplus router; clamped SwiGLU",
    hub_examples=("deepseek-ai/DeepSeek-V4-Flash-Base", "deepseek-ai/DeepSeek-V4-Flash"),
    recipe="olmoe", lora_targets=("q", "k", "v", "o", "experts"), name_hints=("deepseek-v4", "deepseek_v4"),
    recipe_note="scores every expert then takes the top-K, as OLMoE: OLMoE's recipe (q: q_b_proj, k and v: the shared "
                "kv_proj, o: o_b_proj). Hash-routed layers are not routers for the methods, the indexer is not "
                "adapted (no gradient reaches it), the hyper-connections are not adapted (docs/methods.md); peft "
                "has no default targets for the family",
    layer_keys=V4_KEYS, outer_keys={"lm_head.weight": "head.weight"},
    # the release's own files: the same names without model. (embed., norm., hc_head_fn, ...)
    key_prefixes={"layers.": "model.layers.", "embed.": "model.embed_tokens.", "norm.": "model.norm.",
                  "hc_head_": "model.hc_head.hc_"},
    lora_paths={"q": ("self_attn.q_b_proj",), "k": ("self_attn.kv_proj",), "v": ("self_attn.kv_proj",),
                "o": ("self_attn.o_b_proj",)},
    renames={"n_routed_experts": "num_experts", "moe_intermediate_size": "intermediate_size",
             "q_lora_rank": "compressed_q_lora_rank", "layer_types": "compressed_layer_types",
             "index_n_heads": "compressed_index_n_heads", "index_head_dim": "compressed_index_head_dim",
             "index_topk": "compressed_index_topk", "swiglu_limit": "swiglu_clamp"},
    config_fields=frozenset({"head_dim", "compressed_q_lora_rank", "compressed_layer_types", "compress_rates",
                             "compress_rope_theta", "o_groups", "o_lora_rank", "compressed_index_n_heads",
                             "compressed_index_head_dim", "compressed_index_topk", "swiglu_clamp", "sliding_window",
                             "hc_mult", "hc_sinkhorn_iters", "hc_eps", "scoring_func", "routed_scaling_factor",
                             "partial_rotary_factor", "router_aux_loss_coef"}),
    # TopKRouter, HashRouter, MLP and RMSNorm hard-code these (and one key/value head, num_key_value_heads unread): the K always
    # renormalised, greedy top-K with the bias, one shared expert of the experts' width, norms' weights in fp32
    fixed={"topk_method": "noaux_tc", "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
           "n_shared_experts": 1, "norm_weight_in_fp32": True, "router_fp32": False, "rope_parameters": None,
           "rope_scaling": None},
    # config.json's two ropes are held to ours (unread), kept as written (MoEConfig.extra): never our rope_parameters
    unread={"rope_parameters": v4_rope_parameters, "n_shared_experts": 1,
            "mlp_layer_types": lambda d: ["hash_moe" if i in d["hash_layers"] else "moe"
                                          for i in range(d["num_hidden_layers"])],
            "qk_rope_head_dim": lambda d: round(d["head_dim"] * d["partial_rotary_factor"])},
    harmless=frozenset({"attention_bias", "num_hash_layers", "compress_ratios"}),  # never read by its modeling file
    ignored_prefixes=("mtp.",),  # the multi-token-prediction layers of the releases
    write_defaults={"mlp_layer_types": lambda c: ["hash_moe" if i in c.hash_layers else "moe"
                                                  for i in range(c.num_hidden_layers)],
                    "rope_parameters": lambda c: v4_rope_parameters(c.flat())},
    defaults={"mixer_types": lambda d: ["compressed"] * d["num_hidden_layers"],
              "compressed_layer_types": v4_layer_types,
              "hash_layers": lambda d: [i for i, k in enumerate(v4_mlp_kinds(d)) if k == "hash_moe"],
              "rope_theta": lambda d: v4_rope(d, "main").get("rope_theta", 10000.0),
              "compress_rope_theta": lambda d: v4_rope(d, "compress").get("rope_theta", 160000.0),
              "compress_rope_scaling": v4_compress_scaling,
              "partial_rotary_factor": lambda d: v4_rope(d, "main").get("partial_rotary_factor", 64 / 512),
              "head_dim": 512, "num_key_value_heads": 1, "compressed_q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
              "compressed_index_n_heads": 64, "compressed_index_head_dim": 128, "compressed_index_topk": 512,
              "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
              "swiglu_clamp": 10.0, "sliding_window": 128, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
              "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "router_aux_loss_coef": 0.001,
              "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 1,
              # DeepseekV4Config's widths, which it documents as deepseek-ai/DeepSeek-V4-Flash-Base's
              "vocab_size": 129280, "hidden_size": 4096, "intermediate_size": 2048, "num_attention_heads": 64,
              "num_experts": 256, "num_experts_per_tok": 6}))
