"""Tiny random models of every family: `python train.py --model tiny:<model_type>`, and the tests' models.

`tiny_config(model_type)` is the one builder: toy widths (multiples of 8, so that grouped_mm applies in
fp32 and bf16) plus the switches that make the family what it is (`FAMILY_SWITCHES`: Qwen3's dense layer,
DeepSeek's MLA and shared experts, gpt-oss's sinks and YaRN, ...), so that a test of it exercises each.
The tests build their models from it (tests/conftest.py); `tiny_checkpoint(model_type)` writes one as a
checkpoint folder for the command lines.

`--model tiny` (= `tiny:olmoe`) is the offline smoke run's checkpoint, weights/tiny-olmoe, as it has been
since the first release: wider and deeper than the tests' OLMoE (`SMOKE_OLMOE`), so that its runs and the
figures docs quote stay. Every other family's is weights/tiny-<model_type>.

A checkpoint is written by our own `save_pretrained` in the official layout (config.json,
model.safetensors, tokenizer.json), so every code path that reads a real checkpoint reads it too. Its
tokenizer is a byte-level BPE trained with `tokenizers` on the offline benchmarks' question and answer
text (built once, for tiny-olmoe; the other families' copy it); its weights are random (seeded): it is a
pipeline check, not a language model. Built on first use.
"""
from __future__ import annotations

from pathlib import Path

import torch

from minimoe.core.decoder.family_record import FAMILIES, Converted, family_of
from minimoe.core.decoder.model import MoEConfig, MoEForCausalLM, init_weights
from minimoe.data.benchmarks import EOS_TOKEN, PAD_TOKEN, load_examples, train_tokenizer
from minimoe.loading.checkpoint import atomic_directory, checkpoint_layout, write_checkpoint
from minimoe.loading.config_json import read_config
from minimoe.loading.hub import default_weights_dir
from minimoe.loading.mxfp4 import quantize_mxfp4
from minimoe.loading.layouts import layout_of

TOKENIZER_TEXTS = ("arc_challenge", "arc_easy", "openbookqa", "sciq")
PREFIX = "tiny:"  # --model tiny:<model_type>

# Each family's switches at toy widths, on top of `tiny_config`'s common ones.
FAMILY_SWITCHES = {
    # Granite: every multiplier away from 1, tied head, GQA.
    "granitemoe": dict(tie_word_embeddings=True, embedding_multiplier=12.0, residual_multiplier=0.22,
                       logits_scaling=6.0, attention_multiplier=0.1, pad_token_id=0, eos_token_id=0),
    # OLMoE: q/k norms (always), clip_qkv low enough to bite, renormalised top-K, GQA.
    "olmoe": dict(clip_qkv=0.5, norm_topk_prob=True, pad_token_id=1, eos_token_id=2),
    # Qwen3-MoE: per-head q/k norms (always), head_dim apart from hidden/heads, biases, a dense layer between
    # MoE layers, renormalised top-K, a sliding window short enough to bite.
    "qwen3_moe": dict(head_dim=24, attention_bias=True, num_hidden_layers=3, mlp_only_layers=[1],
                      dense_intermediate_size=48, norm_topk_prob=True, use_sliding_window=True, sliding_window=5,
                      pad_token_id=0, eos_token_id=1),
    # Qwen2-MoE: a gated shared expert, q/k/v biases, top-K not renormalised (decoder_sparse_step: test_model).
    "qwen2_moe": dict(qkv_bias=True, shared_expert_intermediate_size=40, norm_topk_prob=False, pad_token_id=0,
                      eos_token_id=1),
    # Mixtral: per-expert w1/w2/w3, renormalised top-2 (always), a sliding window.
    "mixtral": dict(sliding_window=6, head_dim=12, pad_token_id=0, eos_token_id=1),
    # gpt-oss: sinks, biases and top-K on logits (fixed by the family), a sliding layer then a full one,
    # YaRN, the clamped experts.
    "gpt_oss": dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"], swiglu_limit=7.0,
                    rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                  "truncate": False, "original_max_position_embeddings": 16},
                    max_position_embeddings=64, pad_token_id=0, eos_token_id=1),
    # DeepSeek: MLA (low-rank q, rope and no-rope parts, v narrower), a dense first layer, shared experts,
    # group-limited top-K scaled (V2); sigmoid scores, correction bias, noaux_tc, renormalised (V3).
    "deepseek_v2": dict(kv_lora_rank=24, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                        num_key_value_heads=4, num_hidden_layers=3, first_k_dense_replace=1, dense_intermediate_size=96,
                        n_shared_experts=2, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                        routed_scaling_factor=2.0, pad_token_id=0, eos_token_id=1),
    "deepseek_v3": dict(kv_lora_rank=24, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                        num_key_value_heads=4, num_hidden_layers=3, first_k_dense_replace=1, dense_intermediate_size=96,
                        n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                        pad_token_id=0, eos_token_id=1),
    # Granite with a shared expert (fused gate and up rows), every multiplier away from 1.
    "granitemoeshared": dict(tie_word_embeddings=True, embedding_multiplier=12.0, residual_multiplier=0.22,
                             logits_scaling=6.0, attention_multiplier=0.1, shared_expert_intermediate_size=40,
                             pad_token_id=0, eos_token_id=0),
    # FlexOlmo: norms after each branch (in fp32 with their weight), q/k norms over the projection width.
    "flex_olmo": dict(norm_topk_prob=True, pad_token_id=1, eos_token_id=2),
    # GLM-4.5: partial rotary, per-head q/k norms, q/k/v biases, V3's router with groups, a dense first layer.
    "glm4_moe": dict(head_dim=24, partial_rotary_factor=0.5, use_qk_norm=True, qkv_bias=True, num_hidden_layers=3,
                     first_k_dense_replace=1, dense_intermediate_size=96, n_shared_experts=1, n_group=4, topk_group=2,
                     routed_scaling_factor=2.5, norm_topk_prob=True, pad_token_id=0, eos_token_id=1),
    # MiniMax-M2: q/k norms over the projection width, partial rotary, head_dim apart from hidden/heads, the
    # sigmoid router with its correction bias (fixed by the family).
    "minimax_m2": dict(head_dim=24, partial_rotary_factor=0.5, pad_token_id=0, eos_token_id=1),
    # GLM-4.7-Flash: MLA (low-rank q, interleaved rope), GLM's router with groups, a shared expert, its default dense
    # first layer (mlp_layer_types).
    "glm4_moe_lite": dict(kv_lora_rank=24, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                          num_key_value_heads=4, num_hidden_layers=3, mlp_only_layers=[0], dense_intermediate_size=96,
                          n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=1.8, norm_topk_prob=True,
                          pad_token_id=0, eos_token_id=1),
    # Mistral 4: MLA under YaRN with Llama 4's query scaling from position 4 on, the softmax router's noaux_tc groups
    # without a bias, a shared expert, a dense first layer.
    "mistral4": dict(kv_lora_rank=24, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                     num_key_value_heads=4, num_hidden_layers=3, first_k_dense_replace=1, dense_intermediate_size=96,
                     n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=1.5, norm_topk_prob=True,
                     llama_4_scaling_beta=0.5, max_position_embeddings=64,
                     rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4,
                                   "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                   "llama_4_scaling_beta": 0.5}, pad_token_id=0, eos_token_id=1),
    # Llama 4: top-1 sigmoid scaling the input, a shared expert, a dense layer first, a NoPE layer with temperature
    # tuning that bites, chunked attention on the rope layers, L2 q/k norm, interleaved rope pairs.
    "llama4_text": dict(num_hidden_layers=3, num_experts_per_tok=1, head_dim=16, decoder_sparse_step=2,
                        dense_intermediate_size=48, no_rope_layers=[1, 0, 1], attention_chunk_size=4,
                        attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5, pad_token_id=0, eos_token_id=1),
    # The hybrids (their parity: tests/core/decoder/test_families_parity.py): a Mamba-2 layer and a NoPE attention
    # layer, a fused shared expert (Granite 4.0-H); a Gated DeltaNet layer and a gated attention layer with
    # partial rotary and zero-centred norms, a gated shared expert (Qwen3-Next).
    "granitemoehybrid": dict(mixer_types=["mamba2", "attention"], shared_expert_intermediate_size=40,
                             position_embedding_type="nope", mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16,
                             mamba_chunk_size=8, embedding_multiplier=12.0, residual_multiplier=0.22,
                             logits_scaling=6.0, attention_multiplier=0.1, pad_token_id=0, eos_token_id=1),
    "qwen3_next": dict(mixer_types=["gated_deltanet", "attention"], head_dim=16, partial_rotary_factor=0.25,
                       shared_expert_intermediate_size=40, norm_topk_prob=True, linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                       pad_token_id=0, eos_token_id=1),
    # Qwen3.5-MoE: Qwen3-Next's with the DeltaNet projections split (fixed by the family), every layer sparse, the
    # rope sections of its releases on a partial rotary.
    "qwen3_5_moe": dict(mixer_types=["gated_deltanet", "attention"], head_dim=16, partial_rotary_factor=0.5,
                        shared_expert_intermediate_size=40, linear_num_key_heads=2, linear_num_value_heads=4,
                        linear_key_head_dim=8, linear_value_head_dim=12, pad_token_id=0, eos_token_id=1,
                        rope_scaling={"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True}),
    # Kimi Linear: KDA layers around an MLA layer without rope, the sigmoid router with its bias, scaled, a shared
    # expert, a dense first layer (its default).
    "kimi_linear": dict(mixer_types=["kda", "mla", "kda"], num_hidden_layers=3, kv_lora_rank=24, q_lora_rank=None,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, num_key_value_heads=4,
                        linear_head_dim=8, linear_num_heads=4, n_shared_experts=1, routed_scaling_factor=2.5,
                        norm_topk_prob=True, mlp_only_layers=[0], dense_intermediate_size=96, pad_token_id=0,
                        eos_token_id=1),
    # LFM2-8B-A1B: a gated short conv layer (biases on) beside an attention layer with per-head q/k norms, a dense
    # first layer, the sigmoid router with its expert bias scaled, the head tied to the embedding.
    "lfm2_moe": dict(num_hidden_layers=3, mixer_types=["short_conv", "attention", "short_conv"], conv_L_cache=3,
                     conv_bias=True, first_k_dense_replace=1, dense_intermediate_size=48, topk_method="noaux_tc",
                     routed_scaling_factor=1.5, norm_topk_prob=True, tie_word_embeddings=True, pad_token_id=0,
                     eos_token_id=1),
    # Nemotron-H: one block per layer (Mamba-2 with the gated norm per group and the time step clamp that bites,
    # NoPE attention, MoE, a dense MLP), squared-ReLU experts in a latent width, V3's router with groups and
    # scaling, a shared expert.
    "nemotron_h": dict(num_hidden_layers=5, mixer_types=["mamba2", "moe", "attention", "mlp", "moe"], head_dim=16,
                       dense_intermediate_size=48, shared_expert_intermediate_size=40, moe_latent_size=32,
                       mamba_n_heads=8, mamba_d_head=8, mamba_proj_bias=True,
                       mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=8, mamba_dt_min=0.4, n_group=4,
                       topk_group=2, routed_scaling_factor=2.5, pad_token_id=0, eos_token_id=1),
    # DeepSeek-V3.2: V3's MLA and router, a dense first layer, the DSA indexer keeping 4 keys per query (fewer than
    # a benchmark question's tokens, so that the selection bites).
    "deepseek_v32": dict(kv_lora_rank=24, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                         num_key_value_heads=4, num_hidden_layers=3, mlp_only_layers=[0], dense_intermediate_size=96,
                         n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                         index_topk=4, index_n_heads=4, index_head_dim=16, pad_token_id=0, eos_token_id=1),
    # GLM-5: as DeepSeek-V3.2's, rope on interleaved pairs in the indexer, the second layer reusing the first's top-k.
    "glm_moe_dsa": dict(kv_lora_rank=24, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                        num_key_value_heads=4, num_hidden_layers=3, mlp_only_layers=[0], dense_intermediate_size=96,
                        n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, index_topk=4,
                        index_n_heads=4, index_head_dim=16, indexer_types=["full", "shared", "full"],
                        pad_token_id=0, eos_token_id=1),
    # Gemma 4's MoE: a sliding then a global layer (its own head width, one KV head, keys = values, proportional rope
    # on half its pairs), the dense MLP beside the experts, logits softcapped low enough to bite.
    "gemma4_text": dict(head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                        dense_intermediate_size=48, layer_types=["sliding_attention", "full_attention"],
                        sliding_window=4, final_logit_softcapping=5.0, hidden_act="gelu_pytorch_tanh",
                        tie_word_embeddings=True, pad_token_id=0, eos_token_id=1,
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                                            "rope_theta": 1000.0}}),
    # Granite with sliding windows: sliding and full layers, sinks, a NoPE layer (its rope theta 0), Granite's
    # multipliers, a fused shared expert.
    "granitemoe_swa": dict(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                           sliding_window=4, no_rope_layers=[1, 0, 1], shared_expert_intermediate_size=40,
                           embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=6.0,
                           attention_multiplier=0.1, pad_token_id=0, eos_token_id=1),
    # MiMo-V2-Flash: a full layer, then sliding ones with twice the KV heads and sinks; values narrower than keys and
    # scaled; a rope per layer type on a partial rotary; a dense middle layer; the sigmoid router's groups and bias.
    "mimo_v2_flash": dict(num_hidden_layers=3, num_key_value_heads=1, head_dim=24, value_head_dim=16,
                          layer_types=["full_attention", "sliding_attention", "sliding_attention"], sliding_window=4,
                          mlp_only_layers=[1], dense_intermediate_size=96, n_group=2, topk_group=1,
                          routed_scaling_factor=2.5, norm_topk_prob=True, attention_value_scale=0.6,
                          rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000.0,
                                                              "partial_rotary_factor": 0.5},
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
                          pad_token_id=0, eos_token_id=1),
    # DeepSeek-V4: a sliding, a CSA (windows of 4, its indexer keeping 2 entries) and an HCA layer (windows of 8), a
    # window of 6, hyper-connections of 3 streams, a hash-routed first layer, the clamp low enough to bite.
    "deepseek_v4": dict(num_hidden_layers=3, mixer_types=["compressed"] * 3, head_dim=16, partial_rotary_factor=0.5,
                        compressed_layer_types=["sliding_attention", "compressed_sparse_attention",
                                                "heavily_compressed_attention"],
                        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                        compress_rope_theta=40000.0, compressed_q_lora_rank=24, o_groups=2, o_lora_rank=16,
                        compressed_index_n_heads=8, compressed_index_head_dim=16, compressed_index_topk=2,
                        sliding_window=6, hc_mult=3, hash_layers=[0], swiglu_clamp=1.0, scoring_func="sqrtsoftplus",
                        routed_scaling_factor=1.5, n_shared_experts=1, pad_token_id=0, eos_token_id=1),
}

# --model tiny's OLMoE (module docstring): 4 layers, experts 64 wide, no GQA, no clip_qkv, top-K as drawn.
SMOKE_OLMOE = dict(intermediate_size=64, num_hidden_layers=4, num_key_value_heads=4, rms_norm_eps=1e-5,
                   clip_qkv=None, norm_topk_prob=False)


def tiny_config(family: str, **overrides) -> MoEConfig:
    """A toy-width MoEConfig of the family (a model_type), with its switches (`FAMILY_SWITCHES`), then `overrides`."""
    family_of(family, "tiny model")  # an unknown one names the families there are
    if family not in FAMILY_SWITCHES:
        raise ValueError(f"tiny model: {family!r} has no tiny switches; add its entry to FAMILY_SWITCHES in "
                         f"minimoe/making/tiny.py (families with one: {sorted(FAMILY_SWITCHES)})")
    kw = dict(model_type=family, vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
              rms_norm_eps=1e-6, rope_theta=10000.0)
    kw.update(FAMILY_SWITCHES[family])
    kw.update(overrides)
    return MoEConfig.from_flat(kw)  # the mixers' options (mamba_*, kv_lora_rank, clip_qkv, ...) to their configs


def tiny_model(family: str, seed: int = 0, std: float = 0.2, **overrides) -> MoEForCausalLM:
    """The tests' model: `tiny_config`'s, weights N(0, std) (large enough that numerical differences show in
    the logits) and norm weights moved off 1, so that a misplaced norm weight shows."""
    g = torch.Generator().manual_seed(seed)
    model = init_weights(MoEForCausalLM(tiny_config(family, **overrides)), std=std, generator=g)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def tiny_model_type(name: str) -> str | None:
    """--model's 'tiny' -> 'olmoe', 'tiny:<model_type>' -> the model_type (an unknown one is an error naming
    the families there are); anything else -> None (a folder or a hub id)."""
    if name == "tiny":
        return "olmoe"
    if not name.startswith(PREFIX):
        return None
    model_type = name[len(PREFIX):]
    if model_type not in FAMILIES:
        raise ValueError(f"--model {name}: no family {model_type!r}; expected tiny or tiny:<model_type>, one of "
                         + ", ".join(f"tiny:{t}" for t in FAMILIES))
    return model_type


def smoke_tokenizer(vocab_size: int = 2048):
    texts = [t for name in TOKENIZER_TEXTS for ex in load_examples(name) for t in (ex.question, *ex.choices)]
    return train_tokenizer(texts, vocab_size=vocab_size)


def build_tiny_checkpoint(folder, model_type: str = "olmoe", *, seed: int = 0) -> Path:
    """A checkpoint folder of the family's tiny model (OLMoE: --model tiny's), weights init_weights(seed)."""
    folder = Path(folder)
    if model_type == "olmoe":
        tokenizer = smoke_tokenizer()
    else:  # the smoke checkpoint's tokenizer, built once
        from tokenizers import Tokenizer
        tokenizer = Tokenizer.from_file(str(tiny_checkpoint() / "tokenizer.json"))
    widths = checkpoint_widths(model_type)
    vocab = -(-tokenizer.get_vocab_size() // 64) * 64  # rows padded to a multiple of 64, as the releases do
    config = tiny_config(model_type, vocab_size=vocab, eos_token_id=tokenizer.token_to_id(EOS_TOKEN),
                         pad_token_id=tokenizer.token_to_id(PAD_TOKEN), torch_dtype="float32", **widths)
    model = init_weights(MoEForCausalLM(config), generator=torch.Generator().manual_seed(seed))
    with atomic_directory(folder, "model") as tmp:
        write_checkpoint(model, tmp)
        if family_of(model_type).packed_release == "mxfp4":
            store_experts_as_mxfp4(tmp)
        tokenizer.save(str(tmp / "tokenizer.json"))
    return folder


def store_experts_as_mxfp4(folder: Path):
    """Rewrite a written checkpoint's expert banks as MXFP4 `_blocks` and `_scales` of their [E, out, in]
    matrices, with the quantization_config, as the family's release stores them (openai/gpt-oss-20b), so
    that `--quantize mxfp4` and the dequantise-on-load path run on the tiny model too."""
    import json
    from safetensors.torch import load_file, save_file
    tensors = load_file(folder / "model.safetensors")
    for disk in checkpoint_layout(read_config(folder)).values():
        if isinstance(disk, Converted) and layout_of(disk).from_packed is not None and disk.key in tensors:
            matrix = tensors.pop(disk.key).transpose(1, 2)  # stored as x @ W [E, in, out] -> [E, out, in]
            tensors[f"{disk.key}_blocks"], tensors[f"{disk.key}_scales"] = quantize_mxfp4(matrix)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))


def checkpoint_widths(model_type: str) -> dict:
    """The tiny checkpoint's widths beyond tiny_config's: --model tiny's smoke OLMoE; room for benchmark
    prompts and lm_eval's context in every family."""
    return dict(SMOKE_OLMOE if model_type == "olmoe" else {}, max_position_embeddings=1024)


def planned_config(name: str) -> MoEConfig:
    """--model tiny or tiny:<model_type> -> the config its checkpoint has, without building it (the
    tokenizer's vocabulary and ids aside): the commands check their settings against it before anything
    is written (a refusal leaves no weights/tiny-* behind)."""
    model_type = tiny_model_type(name)
    return tiny_config(model_type, **checkpoint_widths(model_type))


def tiny_checkpoint(model_type: str = "olmoe") -> Path:
    """weights/tiny-olmoe (--model tiny) or weights/tiny-<model_type>, built on first use."""
    folder = Path(default_weights_dir()) / f"tiny-{model_type}"
    if not (folder / "config.json").is_file():
        build_tiny_checkpoint(folder, model_type)
    return folder
