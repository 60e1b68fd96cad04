"""Answer-choice scoring: every candidate is one row, `prompt + " " + answer text`, scored by the
conditional log-probabilities of its answer tokens (paper, Experimental Configuration).

Rows of all candidates of all examples in a batch are right-padded into one [R, T] batch. Position t
of a row *predicts* token t+1, so the answer tokens' log-probabilities sit at the positions just
before them (`targets` holds the predicted token there, -100 elsewhere). The same positions carry
the routing decisions that the TES/ACS objectives supervise: the method term reads the gold row's
answer positions only (`supervised_mask`) — prompt and padding excluded, the choice this codebase
makes for "the observed next-token CE of the gold answer's tokens".

Scores per row: `sum` (total log-prob), `mean` (per answer token; the paper's ranking rule and the
training task term) and `per_char` (total / characters of the answer text). The prompt is encoded
with the tokenizer's special tokens, the answer without, and the two id lists are concatenated,
so a candidate's tokens never depend on the prompt's last word.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minimoe.data import Example, format_choice, format_prompt

IGNORE = -100


@dataclass
class ChoiceBatch:
    input_ids: torch.Tensor  # [R, T] right-padded rows, R = candidates of all examples
    attention_mask: torch.Tensor  # [R, T] 1 = real token
    targets: torch.Tensor  # [R, T] the answer token predicted at t (= input_ids[t+1]), IGNORE elsewhere
    example: torch.Tensor  # [R] index of the row's example in the batch
    choice: torch.Tensor  # [R] index of the row's candidate within its example
    chars: torch.Tensor  # [R] characters of the answer text (per-character normalisation)
    gold: torch.Tensor  # [X] gold candidate of each example

    def to(self, device):
        return ChoiceBatch(**{k: v.to(device) for k, v in vars(self).items()})

    @property
    def gold_rows(self) -> torch.Tensor:  # [R] bool
        return self.choice == self.gold[self.example]

    @property
    def supervised_mask(self) -> torch.Tensor:  # [R, T] bool: the gold answer's token positions
        return (self.targets != IGNORE) & self.gold_rows[:, None]


def make_choice_batch(examples: list[Example], tokenizer, pad_token_id: int, max_length: int | None = None) -> ChoiceBatch:
    """Tokenise every (prompt, candidate) pair of `examples` into one right-padded batch."""
    rows, spans, meta = [], [], []
    for x, ex in enumerate(examples):
        prompt = tokenizer.encode(format_prompt(ex.question))
        for c, text in enumerate(ex.choices):
            answer = tokenizer.encode(format_choice(text), add_special_tokens=False)
            if not answer:
                raise ValueError(f"example {ex.id}: choice {c} ({text!r}) encodes to no tokens")
            ids = prompt + answer
            if max_length is not None and len(ids) > max_length:  # drop the prompt's start, never the answer
                ids = ids[len(ids) - max_length:]
            rows.append(ids)
            spans.append(len(answer))
            meta.append((x, c, len(text)))
    T = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), T), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), T), dtype=torch.long)
    targets = torch.full((len(rows), T), IGNORE, dtype=torch.long)
    for r, (ids, n) in enumerate(zip(rows, spans)):
        L = len(ids)
        input_ids[r, :L] = torch.tensor(ids)
        attention_mask[r, :L] = 1
        targets[r, L - n - 1:L - 1] = input_ids[r, L - n:L]
    x, c, chars = (torch.tensor(v) for v in zip(*meta))
    gold = torch.tensor([ex.answer for ex in examples])
    return ChoiceBatch(input_ids, attention_mask, targets, x, c, chars, gold)


def answer_token_logprobs(logits, batch: ChoiceBatch):
    """logits [R, T, V] -> log p(answer token) [R, T] in fp32, 0 at non-answer positions.

    Only answer positions go through log_softmax, so the [R, T, V] fp32 tensor is never built.
    """
    where = batch.targets != IGNORE
    picked = F.log_softmax(logits[where].float(), dim=-1)  # [n, V]
    out = torch.zeros(batch.targets.shape, dtype=torch.float32, device=logits.device)
    out[where] = picked.gather(-1, batch.targets[where][:, None])[:, 0]
    return out


def choice_scores(token_logprobs, batch: ChoiceBatch) -> dict[str, torch.Tensor]:
    """Per row: summed, mean-per-token and per-character answer log-probability, each [R]."""
    total = token_logprobs.sum(-1)
    count = (batch.targets != IGNORE).sum(-1)
    return {"sum": total, "mean": total / count, "per_char": total / batch.chars.clamp(min=1)}


def by_example(row_values, batch: ChoiceBatch) -> torch.Tensor:
    """[R] row values -> [X, C_max], -inf where an example has fewer candidates."""
    X, C = batch.gold.shape[0], int(batch.choice.max()) + 1
    table = torch.full((X, C), float("-inf"), dtype=row_values.dtype, device=row_values.device)
    table[batch.example, batch.choice] = row_values
    return table


def choice_loss(mean_scores, batch: ChoiceBatch, reduction: str = "mean"):
    """Task term: cross-entropy over the candidates, each scored by its mean answer-token log-prob."""
    return F.cross_entropy(by_example(mean_scores, batch), batch.gold, reduction=reduction)


def predictions(scores, batch: ChoiceBatch) -> torch.Tensor:
    """[X] the candidate with the highest score (ties: the first)."""
    return by_example(scores, batch).argmax(-1)
