"""The offline smoke-run checkpoint: a tiny OLMoE-architecture model that `python train.py --model tiny` runs anywhere.

It is written by our own `save_pretrained` in the official layout (config.json, model.safetensors,
tokenizer.json), so every code path that reads a real checkpoint reads it too. Its tokenizer is a
byte-level BPE trained with `tokenizers` on the offline benchmarks' question and answer text; its
weights are random (seeded): it is a pipeline check, not a language model. Built on first use.
"""
from __future__ import annotations

from pathlib import Path

import torch

from minimoe.core.model import MoEConfig, MoEForCausalLM, init_weights
from minimoe.data.benchmarks import EOS_TOKEN, PAD_TOKEN, load_examples, train_tokenizer
from minimoe.loading.checkpoint import atomic_directory, default_weights_dir, write_checkpoint

TINY_NAME = "tiny-olmoe"
TOKENIZER_TEXTS = ("arc_challenge", "arc_easy", "openbookqa", "sciq")


def tiny_config(vocab_size: int, eos: int, pad: int) -> MoEConfig:
    # Real OLMoE switches (q/k norms, 8 experts top-2 here instead of 64 top-8), toy widths.
    return MoEConfig(model_type="olmoe", vocab_size=vocab_size, hidden_size=64, intermediate_size=64,
                     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, num_experts=8,
                     num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=1024,
                     eos_token_id=eos, pad_token_id=pad, torch_dtype="float32")


def build_tiny_checkpoint(folder, *, seed: int = 0, vocab_size: int = 2048) -> Path:
    folder = Path(folder)
    texts = [t for name in TOKENIZER_TEXTS for ex in load_examples(name) for t in (ex.question, *ex.choices)]
    tokenizer = train_tokenizer(texts, vocab_size=vocab_size)
    vocab = -(-tokenizer.get_vocab_size() // 64) * 64  # rows padded to a multiple of 64, as the releases do
    config = tiny_config(vocab, tokenizer.token_to_id(EOS_TOKEN), tokenizer.token_to_id(PAD_TOKEN))
    model = init_weights(MoEForCausalLM(config), generator=torch.Generator().manual_seed(seed))
    with atomic_directory(folder, "model") as tmp:
        write_checkpoint(model, tmp)
        tokenizer.save(str(tmp / "tokenizer.json"))
    return folder


def tiny_checkpoint() -> Path:
    """weights/tiny-olmoe, built on first use."""
    root = Path(default_weights_dir())
    folder = root / TINY_NAME
    if not (folder / "config.json").is_file():
        build_tiny_checkpoint(folder)
    return folder
