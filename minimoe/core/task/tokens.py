"""Next-token loss on chosen tokens: chat and prompt/completion rows (minimoe/data/chat.py builds them).

One row per example, right-padded; or packed (`packed=True`): whole examples laid one after another in
rows of at most max_length tokens (in order, a new row when the next example does not fit), example
k of a row as segment k + 1 (segment 0 is padding only), so that attention never crosses examples
(core/layers/masks.py's packed rule with no shared prefix), positions restart at each example, and the
recurrent mixers start each example from a fresh state (core/token_mixers/ssm_common.py). A packed example's
loss and gradients equal its own row's (tests/core/task/test_tokens.py); what packing changes is the
row count that the load-balancing term is normalised by, and LoRA dropout's draws. A row's `supervised` tokens (the assistant turns, the completion)
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

from minimoe.core.task.choices import forward_choices

CHUNK = 1024  # scored positions per head call by default (--loss-chunk): [1024, 151k] fp32 logits are 0.6 GB


@dataclass
class TokenBatch:
    input_ids: torch.Tensor  # [R, T] right-padded rows, one per example
    attention_mask: torch.Tensor  # [R, T] 1 = real token
    position_ids: torch.Tensor  # [R, T]
    row: torch.Tensor  # [n] the row ...
    col: torch.Tensor  # [n] ... and position whose hidden state predicts ...
    target: torch.Tensor  # [n] ... this supervised token
    example: torch.Tensor  # [n] its example in the batch (in the order given)
    segment_ids: torch.Tensor | None = None  # [R, T] packed: example k of a row is k + 1, padding 0; else None
    n_examples: int = 0
    supervised_tokens: int = 0  # n, host-side (no device sync)
    real_tokens: int = 0
    placeholder: bool = False  # a rank's stand-in micro-batch, weight zero (ChoiceBatch's)

    def to(self, device):
        return TokenBatch(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(self).items()})

    @property
    def scored_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.row, self.col

    @property
    def supervised_mask(self) -> torch.Tensor:  # [R, T] bool: the positions that predict a supervised token
        mask = torch.zeros(self.input_ids.shape, dtype=torch.bool, device=self.input_ids.device)
        return mask.index_put((self.row, self.col), torch.ones_like(self.row, dtype=torch.bool))

    def at_supervised(self, values) -> torch.Tensor:
        """[n] per-token values -> [R, T] at their predicting positions, 0 elsewhere (differentiable)."""
        return values.new_zeros(self.input_ids.shape).index_put((self.row, self.col), values)


def make_token_batch(rows, pad_token_id: int, *, pad_to: int = 1, packed: bool = False,
                     max_length: int | None = None) -> TokenBatch:
    """data.chat.TokenRow's (ids, supervised) -> one right-padded batch, one row per example or packed into
    rows of at most max_length (module docstring); pad_to as choices.pack_choices'."""
    if not (isinstance(pad_to, int) and pad_to >= 1):
        raise ValueError(f"pad_to={pad_to!r}; expected a positive int (1: no rounding)")
    if packed and max_length is None:
        raise ValueError("packed rows need max_length, the most tokens a row holds")
    layout = [[]]  # rows of example indices
    for x, row in enumerate(rows):
        if not packed or (layout[-1] and sum(len(rows[i].ids) for i in layout[-1]) + len(row.ids) > max_length):
            layout.append([])
        layout[-1].append(x)
    layout = [r for r in layout if r]
    R = len(layout)
    T = -(-max(sum(len(rows[x].ids) for x in xs) for xs in layout) // pad_to) * pad_to
    input_ids = torch.full((R, T), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((R, T), dtype=torch.long)
    position_ids = torch.zeros((R, T), dtype=torch.long)
    segment_ids = torch.zeros((R, T), dtype=torch.long) if packed else None
    tokens = []
    for r, xs in enumerate(layout):
        at = 0
        for k, x in enumerate(xs):
            ids, n = rows[x].ids, len(rows[x].ids)
            input_ids[r, at:at + n] = torch.tensor(ids)
            attention_mask[r, at:at + n] = 1
            position_ids[r, at:at + n] = torch.arange(n)  # restart at each example
            if packed:
                segment_ids[r, at:at + n] = k + 1
            tokens += [(r, at + t - 1, ids[t], x) for t in range(1, n) if rows[x].supervised[t]]
            at += n
    if not tokens:
        raise ValueError("make_token_batch: no supervised token in the batch")
    row, col, target, example = (torch.tensor(v) for v in zip(*tokens))
    return TokenBatch(input_ids, attention_mask, position_ids, row, col, target, example, segment_ids,
                      n_examples=len(rows), supervised_tokens=len(tokens), real_tokens=sum(len(r.ids) for r in rows))


def example_losses(token_ce, batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """[n] per-token CE -> ([X] summed CE of each example, [X] its supervised tokens)."""
    X = batch.n_examples
    total = token_ce.new_zeros(X).index_add(0, batch.example, token_ce)
    count = torch.zeros(X, dtype=torch.long, device=token_ce.device).index_add(0, batch.example,
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


def forward_tokens(model, batch, chunk: int | None = None):
    """One forward, the LM head at the scored positions a chunk at a time -> (output, log-probs [n] fp32),
    as choices.forward_choices returns them; `batch` a TokenBatch or a ChoiceBatch (its candidates' answer tokens
    are the positions; training runs both kinds here, so --loss-chunk bounds either's logits). chunk: the run's
    --loss-chunk, else CHUNK, read at the call. Up to `chunk` scored positions the head runs inside the forward,
    as forward_choices runs it. Past it the head runs after the forward: under
    --shard fsdp its weight is then still gathered, since the root unit keeps its parameters unsharded from
    its forward to the end of the backward (runs/sharding.py; tests/runs/test_sharded_chat.py)."""
    chunk = CHUNK if chunk is None else chunk
    if batch.target.shape[0] <= chunk:  # a ChoiceBatch's supervised_tokens are the gold answer's alone
        return forward_choices(model, batch)
    out = model(batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                segment_ids=batch.segment_ids, logits_at=batch.scored_positions, head=False)
    return out, -chunked_token_ce(getattr(model, "module", model).head, out.hidden, batch.target, chunk)
