"""Greedy and sampled generation with a preallocated KV cache.

Rows may be left-padded (attention_mask 0 on the left), as `transformers` pads for generation;
positions then count real tokens only, so a padded row decodes exactly like the unpadded one.
"""
from __future__ import annotations

import torch

from minimoe.core.token_mixers.mixers import KVCache
from minimoe.core.decoder.model import MoEForCausalLM


@torch.no_grad()
def generate(model: MoEForCausalLM, input_ids, max_new_tokens: int, *, attention_mask=None,
             temperature: float = 0.0, top_k: int | None = None, eos_token_id: int | None = None,
             generator: torch.Generator | None = None):
    """input_ids [B, T] -> [B, T + new] token ids. temperature 0 is greedy; rows stop at eos."""
    B, T = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    cache = KVCache(model.config, B, T + max_new_tokens, model.dtype, input_ids.device)
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, T]
    tokens, step_ids = input_ids, input_ids
    done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
    for _ in range(max_new_tokens):
        logits = model(step_ids, attention_mask=attention_mask, position_ids=positions, cache=cache).logits[:, -1].float()
        if temperature > 0:
            logits = logits / temperature
            if top_k is not None:
                kth = logits.topk(top_k, dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_ids = torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]
        else:
            next_ids = logits.argmax(-1)
        if eos_token_id is not None:
            next_ids = torch.where(done, torch.full_like(next_ids, eos_token_id), next_ids)
            done |= next_ids == eos_token_id
        tokens = torch.cat([tokens, next_ids[:, None]], dim=1)
        step_ids = next_ids[:, None]
        attention_mask = torch.cat([attention_mask, torch.ones_like(step_ids)], dim=1)
        positions = positions[:, -1:] + 1
        if eos_token_id is not None and done.all():
            break
    return tokens
