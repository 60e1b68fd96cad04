"""Next-token loss on chosen tokens: chat and prompt/completion rows (minimoe/data/chat.py builds them).

One row per example, right-padded. A row's `supervised` tokens (the assistant turns, the completion)
are the ones the loss falls on; the rest is context. Position t predicts token t+1, so supervised
token t is predicted at (`row`, t - 1): the model runs its LM head at those n positions only
(`logits_at`), never building [rows, T, V] logits.

The task term is the mean cross-entropy per supervised token over the whole optimizer step (the
paper's per-token CE, as TRL's SFT loss averages it): a long answer weighs more than a short one.
The batch has ChoiceBatch's surface (scored_positions, target, supervised_mask, at_supervised,
supervised_tokens), so the routing methods (TES, ACS, Dual Affinity) and the diagnostics read the
supervised tokens' CE here as they read the gold answer's there.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from minimoe.core.choices import forward_choices

CHUNK = 1024  # supervised positions per head call: [1024, 151k] fp32 logits are 0.6 GB


@dataclass
class TokenBatch:
    input_ids: torch.Tensor  # [R, T] right-padded rows, one per example
    attention_mask: torch.Tensor  # [R, T] 1 = real token
    position_ids: torch.Tensor  # [R, T]
    row: torch.Tensor  # [n] the row ...
    col: torch.Tensor  # [n] ... and position whose hidden state predicts ...
    target: torch.Tensor  # [n] ... this supervised token
    example: torch.Tensor  # [n] its example (row) in the batch
    supervised_tokens: int = 0  # n, host-side (no device sync)
    real_tokens: int = 0
    placeholder: bool = False  # a rank's stand-in micro-batch, weight zero (ChoiceBatch's)
    segment_ids: None = None  # one example a row: no block mask

    def to(self, device):
        return TokenBatch(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(self).items()})

    @property
    def scored_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.row, self.col

    @property
    def examples(self) -> int:
        return self.input_ids.shape[0]

    @property
    def supervised_mask(self) -> torch.Tensor:  # [R, T] bool: the positions that predict a supervised token
        mask = torch.zeros(self.input_ids.shape, dtype=torch.bool, device=self.input_ids.device)
        return mask.index_put((self.row, self.col), torch.ones_like(self.row, dtype=torch.bool))

    def at_supervised(self, values) -> torch.Tensor:
        """[n] per-token values -> [R, T] at their predicting positions, 0 elsewhere (differentiable)."""
        return values.new_zeros(self.input_ids.shape).index_put((self.row, self.col), values)


def make_token_batch(rows, pad_token_id: int, *, pad_to: int = 1) -> TokenBatch:
    """data.chat.TokenRow's (ids, supervised) -> one right-padded batch; pad_to as choices.pack_choices'."""
    if not (isinstance(pad_to, int) and pad_to >= 1):
        raise ValueError(f"pad_to={pad_to!r}; expected a positive int (1: no rounding)")
    R, T = len(rows), -(-max(len(r.ids) for r in rows) // pad_to) * pad_to
    input_ids = torch.full((R, T), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((R, T), dtype=torch.long)
    tokens = []
    for r, row in enumerate(rows):
        input_ids[r, :len(row.ids)] = torch.tensor(row.ids)
        attention_mask[r, :len(row.ids)] = 1
        tokens += [(r, t - 1, row.ids[t]) for t in range(1, len(row.ids)) if row.supervised[t]]
    if not tokens:
        raise ValueError("make_token_batch: no supervised token in the batch")
    row, col, target = (torch.tensor(v) for v in zip(*tokens))
    position_ids = torch.arange(T).expand(R, T).clone() * attention_mask
    return TokenBatch(input_ids, attention_mask, position_ids, row, col, target, row.clone(),
                      supervised_tokens=len(tokens), real_tokens=sum(len(r.ids) for r in rows))


def example_losses(token_ce, batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """[n] per-token CE -> ([R] summed CE of each example, [R] its supervised tokens)."""
    R = batch.input_ids.shape[0]
    total = token_ce.new_zeros(R).index_add(0, batch.example, token_ce)
    count = torch.zeros(R, dtype=torch.long, device=token_ce.device).index_add(0, batch.example,
                                                                               torch.ones_like(batch.example))
    return total, count


def token_ce(head, hidden, target) -> torch.Tensor:
    """hidden [n, D] (final-normed), target [n] -> CE [n] in fp32: the plain path, [n, V] logits at once."""
    return F.cross_entropy(head(hidden).float(), target, reduction="none")


def chunked_token_ce(head, hidden, target, chunk: int = CHUNK) -> torch.Tensor:
    """token_ce, CHUNK positions at a time, each chunk's logits recomputed in the backward (module docstring)."""
    if hidden.shape[0] <= chunk:
        return token_ce(head, hidden, target)
    if not torch.is_grad_enabled():
        return torch.cat([token_ce(head, h, t) for h, t in zip(hidden.split(chunk), target.split(chunk))])
    return torch.cat([checkpoint(token_ce, head, h, t, use_reentrant=False)
                      for h, t in zip(hidden.split(chunk), target.split(chunk))])


def forward_tokens(model, batch: TokenBatch, chunk: int = CHUNK):
    """One forward, the LM head at the supervised positions a chunk at a time -> (output, log-probs [n] fp32),
    as choices.forward_choices returns them. Up to `chunk` supervised tokens the head runs inside the
    forward, as for answer choices (FSDP2 gathers the head's weight only there)."""
    if batch.supervised_tokens <= chunk:
        return forward_choices(model, batch)
    out = model(batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                segment_ids=batch.segment_ids, logits_at=batch.scored_positions, head=False)
    return out, -chunked_token_ce(getattr(model, "module", model).head, out.hidden, batch.target, chunk)
