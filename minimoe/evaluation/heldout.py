"""Held-out loss and perplexity of chat and completion examples, per supervised token.

loss = the summed next-token CE of every supervised token (assistant turns, completions) over their
count; perplexity = exp(loss). Each example's record keeps its own summed CE and token count, so
that two runs on the same examples compare example by example (study/compare.py's paired interval
on `loss` per example). The model runs in eval mode (no dropout), its LM head at the supervised
positions only.
"""
from __future__ import annotations

import math
from contextlib import nullcontext

import torch
from tqdm import tqdm

from minimoe.core.task.choices import pad_id
from minimoe.core.task.tokens import example_losses, forward_tokens, make_token_batch
from minimoe.evaluation.accuracy import eval_mode


def evaluate_tokens(model, rows, *, batch_size: int = 16, device=None, pad_token_id: int | None = None,
                    progress: str | None = None, pad_to: int = 1, autocast=nullcontext,
                    loss_chunk: int | None = None) -> tuple[list[dict], dict]:
    """rows: data.chat.TokenRow's with ids -> (records, metrics).
    records: {"id", "loss" (mean CE of its supervised tokens), "ce_sum", "tokens"} per row, in input order;
    metrics: n_examples, supervised_tokens, loss, perplexity. loss_chunk: the LM head's positions at once (--loss-chunk)."""
    if not rows:
        raise ValueError("evaluate_tokens: no examples")
    device = torch.device(device) if device is not None else model.device
    pad = pad_token_id if pad_token_id is not None else pad_id(model.config)
    records = []
    with eval_mode(model), torch.no_grad():
        starts = range(0, len(rows), batch_size)
        for start in tqdm(starts, desc=progress, unit="batch", disable=progress is None, leave=False):
            part = rows[start:start + batch_size]
            batch = make_token_batch(part, pad, pad_to=pad_to).to(device)
            with autocast():
                _, logp = forward_tokens(model, batch, loss_chunk)  # [n] fp32
            total, count = (t.tolist() for t in example_losses(-logp.double(), batch))
            records += [{"id": r.id, "loss": s / n, "ce_sum": s, "tokens": n} for r, s, n in zip(part, total, count)]
    tokens = sum(r["tokens"] for r in records)
    loss = sum(r["ce_sum"] for r in records) / tokens
    return records, {"n_examples": len(records), "supervised_tokens": tokens, "loss": loss,
                     "perplexity": math.exp(loss)}
