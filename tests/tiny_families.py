"""Tiny random DeepSeek-V2, DeepSeek-V3 and gpt-oss checkpoints saved by transformers 4.57, one per
switch the families bring, and a gpt-oss checkpoint whose experts are stored in MXFP4 as the official
one stores them. The reference model returned is the one the files hold (the MXFP4 one: with the
values its bits stand for, decoded in tests/loading/test_mxfp4.py from the format's definition)."""
import json

import pytest
import torch
pytest.importorskip("transformers")  # the oracle: a plain install skips these tests
import transformers
from safetensors.torch import save_file

from minimoe.core.decoder.family_record import TEXT_MODEL_TYPES
from tests.conftest import by_oracle
from tests.core.decoder.test_model import reference_model
from tests.loading.test_mxfp4 import quantise_by_spec

COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, rms_norm_eps=1e-6,
              pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=False)
MLA = dict(kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, num_key_value_heads=4,
           intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
           max_position_embeddings=64)
VARIANTS = {
    # V2-Lite's switches: plain q_proj, greedy top-K, YaRN with mscale = mscale_all_dim, one dense layer.
    "deepseek_v2-lite": dict(model_type="deepseek_v2", q_lora_rank=None, topk_method="greedy", n_shared_experts=2,
                             first_k_dense_replace=1, routed_scaling_factor=1.0,
                             rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                           "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}),
    # V2's: low-rank q, group-limited greedy top-K, routed_scaling_factor, no rope scaling.
    "deepseek_v2-group": dict(model_type="deepseek_v2", q_lora_rank=32, topk_method="group_limited_greedy", n_group=4,
                              topk_group=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.0),
    # V3 (Moonlight's kind): sigmoid scores, correction bias, noaux_tc group limits, normalised and scaled.
    "deepseek_v3": dict(model_type="deepseek_v3", q_lora_rank=32, n_group=4, topk_group=2, n_shared_experts=1,
                        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                      "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}),
    "deepseek_v3-plain": dict(model_type="deepseek_v3", q_lora_rank=32, n_group=2, topk_group=1, n_shared_experts=2,
                              first_k_dense_replace=0, routed_scaling_factor=1.0, norm_topk_prob=False,
                              rope_interleave=False),
    # gpt-oss-20b's switches at a tiny width: sliding and full layers, sinks, biases, YaRN (truncate false).
    "gpt_oss": dict(model_type="gpt_oss", intermediate_size=32, head_dim=16, num_key_value_heads=2,
                    num_local_experts=8, num_experts_per_tok=2, sliding_window=4, max_position_embeddings=64,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                  "truncate": False, "original_max_position_embeddings": 16}),
    # Granite 4.0-H's switches: Mamba-2 layers (several scan chunks per row, two groups) among NoPE attention
    # layers, a shared expert, every multiplier away from 1.
    "granitemoehybrid": dict(model_type="granitemoehybrid", layer_types=["mamba", "attention", "mamba"],
                             num_key_value_heads=2, intermediate_size=32, shared_intermediate_size=40,
                             num_local_experts=8, num_experts_per_tok=2, position_embedding_type="nope",
                             embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=6.0,
                             attention_multiplier=0.1, mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16,
                             mamba_chunk_size=8, mamba_d_conv=4),
    "granitemoehybrid-rope": dict(model_type="granitemoehybrid", layer_types=["attention", "mamba", "mamba"],
                                  num_key_value_heads=4, intermediate_size=32, shared_intermediate_size=24,
                                  num_local_experts=8, num_experts_per_tok=3, position_embedding_type="rope",
                                  mamba_n_heads=4, mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=16,
                                  mamba_d_conv=3, max_position_embeddings=64),
    # Qwen3-Next's: Gated DeltaNet layers (two value heads per key head) beside a gated attention layer with
    # partial rotary and zero-centred norms, a gated shared expert, a dense layer, renormalised top-K.
    "qwen3_next": dict(model_type="qwen3_next", layer_types=["linear_attention", "full_attention", "linear_attention"],
                       num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.25, intermediate_size=48,
                       moe_intermediate_size=32, shared_expert_intermediate_size=40, num_experts=8,
                       num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[2], linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                       linear_conv_kernel_dim=4, max_position_embeddings=64),
    # Granite MoE with a shared expert: every multiplier away from 1, GQA.
    "granitemoeshared": dict(model_type="granitemoeshared", intermediate_size=32, num_local_experts=8,
                             num_experts_per_tok=2, shared_intermediate_size=40, num_key_value_heads=2,
                             embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=6.0,
                             attention_multiplier=0.1),
    # FlexOlmo: norms after each branch, q/k norm over the projection width, GQA, top-K not renormalised.
    "flex_olmo": dict(model_type="flex_olmo", intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                      num_key_value_heads=2, norm_topk_prob=False),
    # GLM-4.5: partial rotary, per-head q/k norm, q/k/v biases, V3's router with groups, a dense first layer.
    "glm4_moe": dict(model_type="glm4_moe", intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
                     num_experts_per_tok=2, num_key_value_heads=2, head_dim=24, partial_rotary_factor=0.5,
                     use_qk_norm=True, attention_bias=True, n_group=4, topk_group=2, n_shared_experts=1,
                     first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True),
    # GLM-4.5-Air's switches off: no q/k norm, no biases, one group, not renormalised, every layer MoE.
    "glm4_moe-plain": dict(model_type="glm4_moe", intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
                           num_experts_per_tok=2, num_key_value_heads=2, partial_rotary_factor=0.25,
                           use_qk_norm=False, attention_bias=False, n_shared_experts=2, first_k_dense_replace=0,
                           routed_scaling_factor=1.0, norm_topk_prob=False),
    # Llama 4: top-1 sigmoid scaling the input, a shared expert, MoE every second layer, a NoPE layer with
    # temperature tuning (floor_scale small enough to bite), chunked attention (chunk 4), L2 q/k norm, llama3 rope.
    "llama4_text": dict(model_type="llama4_text", num_hidden_layers=4, intermediate_size=32, intermediate_size_mlp=48,
                        num_local_experts=8, num_experts_per_tok=1, num_key_value_heads=2, head_dim=16,
                        interleave_moe_layer_step=2, no_rope_layers=[1, 1, 0, 1], attention_chunk_size=4,
                        attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5, use_qk_norm=True,
                        max_position_embeddings=64,
                        rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    # Llama 4 at top-2, every layer MoE, no q/k norm, no temperature tuning, NoPE by the interval rule.
    "llama4_text-top2": dict(model_type="llama4_text", num_hidden_layers=4, intermediate_size=32,
                             intermediate_size_mlp=48, num_local_experts=8, num_experts_per_tok=2,
                             num_key_value_heads=2, head_dim=16, interleave_moe_layer_step=1, no_rope_layer_interval=2,
                             attention_chunk_size=6, attn_temperature_tuning=False, use_qk_norm=False),
    # MiniMax-M2 (transformers 5 only): its released config's names (num_local_experts, rotary_dim for the partial
    # rotary), q/k norms over the projection width, the sigmoid router with its correction bias.
    "minimax_m2": dict(model_type="minimax_m2", intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                       num_key_value_heads=2, head_dim=24, rotary_dim=12, max_position_embeddings=64),
    # GLM-4.7-Flash (transformers 5 only): MLA with low-rank q and interleaved rope, GLM's router with groups and
    # scaling, a shared expert, a dense layer placed by mlp_layer_types.
    "glm4_moe_lite": dict(model_type="glm4_moe_lite", q_lora_rank=32, n_group=4, topk_group=2, n_shared_experts=1,
                          routed_scaling_factor=1.8, norm_topk_prob=True, mlp_layer_types=["sparse", "dense", "sparse"]),
    # Mistral 4 (transformers 5 only): MLA under YaRN with Llama 4's query scaling from position 4 on (a small
    # original_max_position_embeddings, so that it bites), the softmax router's noaux_tc groups, scaled; a dense layer.
    "mistral4": dict(model_type="mistral4", q_lora_rank=32, n_group=4, topk_group=2, n_shared_experts=1,
                     first_k_dense_replace=1, routed_scaling_factor=1.5, norm_topk_prob=True,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 4, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.5,
                                      "partial_rotary_factor": 8 / 24}),
    # Qwen3.5-MoE's text model (transformers 5 only; its text config's model_type): Qwen3-Next's variant with the
    # DeltaNet projections split, every layer sparse, mrope sections on a partial rotary as its releases give them.
    "qwen3_5_moe": dict(model_type="qwen3_5_moe_text", layer_types=["linear_attention", "full_attention",
                                                                    "linear_attention"],
                        num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=40,
                        num_experts=8, num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=4,
                        linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
                        max_position_embeddings=64,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                         "mrope_section": [2, 1, 1], "mrope_interleaved": True}),
    # Kimi Linear (transformers 5 only): KDA layers around an MLA layer without rope, a plain q_proj, the sigmoid
    # router with its correction bias, scaled and renormalised, a shared expert; every layer sparse (the dense layer,
    # whose keys transformers 5.23 saves otherwise than the release, is tiny:kimi_linear's: test_config_keys).
    "kimi_linear": dict(model_type="kimi_linear", num_key_value_heads=4, kv_lora_rank=24, q_lora_rank=None,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, intermediate_size=96,
                        moe_intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                        routed_scaling_factor=2.5, linear_head_dim=8, linear_num_heads=4,
                        layer_types=["linear_attention", "full_attention", "linear_attention"],
                        mlp_layer_types=["sparse", "sparse", "sparse"], max_position_embeddings=64),
    # LFM2-8B-A1B (transformers 5 only): its config's names (norm_eps, num_dense_layers, conv_L_cache), short conv
    # layers with biases around an attention layer, a dense first layer, the expert bias scaled, the head tied.
    "lfm2_moe": dict(model_type="lfm2_moe", layer_types=["conv", "full_attention", "conv"], num_key_value_heads=2,
                     intermediate_size=48, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                     num_dense_layers=1, norm_eps=1e-6, conv_L_cache=3, conv_bias=True, use_expert_bias=True,
                     routed_scaling_factor=1.5, norm_topk_prob=True, tie_word_embeddings=True,
                     max_position_embeddings=64),
    # Nemotron-H (transformers 5 only): one block per layer, its released names; Mamba-2 with two groups (the
    # gated norm per group), biases, several scan chunks and a time step clamp that bites; NoPE attention; V3's
    # router with groups and scaling over squared-ReLU experts; a shared expert; a dense MLP block.
    "nemotron_h": dict(model_type="nemotron_h", layers_block_type=["linear_attention", "moe", "full_attention", "mlp",
                                                                   "moe", "linear_attention"],
                       layer_norm_epsilon=1e-6, num_key_value_heads=2, head_dim=16, intermediate_size=48,
                       moe_intermediate_size=32, moe_shared_expert_intermediate_size=40, n_routed_experts=8,
                       num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                       mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=16, chunk_size=8,
                       conv_kernel=4, use_bias=True, time_step_min=0.4, max_position_embeddings=64),
    # Nemotron-H's latent MoE (the experts in a narrower width between two projections), top-K not renormalised.
    "nemotron_h-latent": dict(model_type="nemotron_h", layers_block_type=["full_attention", "moe", "linear_attention",
                                                                          "moe"],
                              layer_norm_epsilon=1e-6, num_key_value_heads=4, head_dim=16, moe_intermediate_size=32,
                              moe_shared_expert_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=3,
                              moe_latent_size=24, norm_topk_prob=False, mamba_num_heads=4, mamba_head_dim=16,
                              n_groups=1, ssm_state_size=8, chunk_size=16, conv_kernel=3),
    # DeepSeek-V3.2 (transformers 5 only): V3's MLA (interleaved rope, YaRN) and router, plus the DSA indexer keeping
    # 5 keys per query of the 16-token rows, so that most queries attend to fewer keys than causal attention gives
    # them (16 indexer heads: with 4, two keys of score exactly 0, every head's ReLU at 0, tie in most rows); a dense
    # first layer by first_k_dense_replace.
    "deepseek_v32": dict(model_type="deepseek_v32", q_lora_rank=32, n_group=4, topk_group=2, n_shared_experts=1,
                         first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, index_topk=5,
                         index_n_heads=16, index_head_dim=16,
                         rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                       "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}),
    # GLM-5 (transformers 5 only): DSA with rope on interleaved pairs in the indexer, a shared layer reusing the first
    # layer's top-k, then a full one; dense layers by mlp_layer_types.
    "glm_moe_dsa": dict(model_type="glm_moe_dsa", q_lora_rank=32, n_group=1, topk_group=1, n_shared_experts=1,
                        routed_scaling_factor=2.5, norm_topk_prob=True, index_topk=5, index_n_heads=16,
                        index_head_dim=16, indexer_types=["full", "shared", "full"],
                        mlp_layer_types=["dense", "sparse", "sparse"]),
    # Gemma 4 26B-A4B's switches (transformers 5 only): sliding layers (window 4) and global ones with their own head
    # width and one KV head, keys = values, proportional rope on half the pairs; the dense MLP beside the experts;
    # logits softcapped low enough to bite; tied embeddings.
    "gemma4_text": dict(model_type="gemma4_text", num_hidden_layers=4, intermediate_size=48, moe_intermediate_size=32,
                        num_experts=8, top_k_experts=2, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                        num_global_key_value_heads=1, attention_k_eq_v=True, enable_moe_block=True,
                        hidden_size_per_layer_input=0, sliding_window=4, final_logit_softcapping=5.0,
                        tie_word_embeddings=True, max_position_embeddings=64,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                         "full_attention": {"rope_type": "proportional",
                                                            "partial_rotary_factor": 0.5, "rope_theta": 1000.0}}),
    # Granite MoE with sliding windows (transformers 5 only): sliding and full layers, sinks, a NoPE layer by its
    # rope theta 0, every multiplier away from 1, a fused shared expert.
    "granitemoe_swa": dict(model_type="granitemoe_swa", intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                           num_key_value_heads=2, shared_intermediate_size=40, sliding_window=4,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                           layer_rope_theta=[10000.0, 0, 10000.0], embedding_multiplier=12.0, residual_multiplier=0.22,
                           logits_scaling=6.0, attention_multiplier=0.1, max_position_embeddings=64),
    # MiMo-V2-Flash (transformers 5 only): a full layer, then sliding ones with twice the KV heads and sinks; values
    # narrower than keys and scaled; each layer type's own rope theta and partial rotary (the sliding one by
    # MiMo's 0.334 default: 8 of 24 dims); a dense middle layer; the sigmoid router's groups, bias and scaling.
    "mimo_v2_flash": dict(model_type="mimo_v2_flash", num_key_value_heads=1, head_dim=24, v_head_dim=16,
                          intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                          n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                          attention_value_scale=0.6, sliding_window=4, max_position_embeddings=64,
                          layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                          mlp_layer_types=["sparse", "dense", "sparse"],
                          rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000.0,
                                                              "partial_rotary_factor": 0.5},
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
    # DeepSeek-V4 (transformers 5 only): a sliding, a CSA (windows of 4, the indexer keeping 2 of them) and an HCA layer
    # (windows of 5) over 16-token rows, a window of 6, YaRN on the compressed layers' rope, 3 hyper-connection streams,
    # a hash-routed first layer, the SwiGLU clamp low enough to bite.
    "deepseek_v4": dict(model_type="deepseek_v4", head_dim=16, q_lora_rank=24, o_groups=2, o_lora_rank=16,
                        moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, index_n_heads=8,
                        index_head_dim=16, index_topk=2, sliding_window=6, hc_mult=3, swiglu_limit=1.0,
                        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
                        mlp_layer_types=["hash_moe", "moe", "moe"], max_position_embeddings=64,
                        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 5},
                        rope_theta=10000.0, compress_rope_theta=40000.0, partial_rotary_factor=0.5,
                        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                         "beta_fast": 32.0, "beta_slow": 1.0}),
}
# COMMON's fields a family's config names otherwise (Nemotron-H's layer_norm_epsilon): left out of its variants.
NOT_COMMON = {"nemotron_h": ("rms_norm_eps", "num_hidden_layers")}


def declared(variants) -> list:
    """`variants` as pytest params, a transformers-5-only family's marked tf5 (.ci/run's third environment)."""
    return by_oracle(variants, family_of)


def family_of(variant: str) -> str:
    model_type = VARIANTS[variant]["model_type"]
    return TEXT_MODEL_TYPES.get(model_type, model_type)  # Qwen3.5's text config names its family's text model


def variant_config(variant: str) -> dict:
    """`variant`'s transformers config fields at the tiny width (tests/core/decoder/test_model.py's reference_model
    builds and saves its model)."""
    mla = variant.startswith("deepseek") and variant != "deepseek_v4" or variant in ("glm4_moe_lite", "mistral4", "glm_moe_dsa")
    common = {k: v for k, v in COMMON.items() if k not in NOT_COMMON.get(family_of(variant), ())}
    return {**common, **(MLA if mla else {}), **VARIANTS[variant]}


def mxfp4_reference_model(folder, seed: int = 0):
    """gpt-oss with its experts' gate_up_proj and down_proj written as `_blocks` and `_scales` (uint8), as
    openai/gpt-oss-20b stores them, and a quantization_config saying so. The returned model holds the
    values the bits stand for."""
    ref = reference_model(variant_config("gpt_oss"), folder, seed)
    path = folder / "model.safetensors"
    from safetensors.torch import load_file
    tensors = load_file(path)
    with torch.no_grad():
        for i, layer in enumerate(ref.model.layers):
            experts, prefix = layer.mlp.experts, f"model.layers.{i}.mlp.experts."
            for proj in ("gate_up_proj", "down_proj"):
                w = getattr(experts, proj)  # transformers' [E, in, out]; on disk [E, out, in] in blocks of 32 along in
                blocks, scales, values = quantise_by_spec(w.transpose(1, 2))
                w.copy_(values.transpose(1, 2).float())
                del tensors[prefix + proj]
                tensors[prefix + proj + "_blocks"], tensors[prefix + proj + "_scales"] = blocks, scales
    save_file(tensors, str(path), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return ref
