"""Answer-choice scoring: every candidate is scored by the conditional log-probabilities of its answer
tokens after the prompt, `prompt + " " + answer text` (paper, Experimental Configuration).

Two row layouts, one meaning (tests hold them equal):
- packed (the default): one row per example, the prompt once, then every candidate, right-padded.
  A block-causal mask (`segment_ids`: 0 = prompt, c+1 = candidate c) lets a candidate see the prompt
  and its own earlier tokens, never another candidate; position ids restart at the prompt's end for
  each candidate, so a candidate's positions equal those of its own per-candidate row. The prompt
  runs once instead of once per candidate (it is most of the tokens).
- per-candidate rows (`packed=False`, the readable reference): one row per (prompt, candidate).

Answer tokens are listed flat, n in all: the hidden state at (`row`, `col`) predicts `target`, the
token of candidate `cand`. Position t predicts token t+1, so a candidate's first answer token is
predicted at the prompt's last position; in a packed row that one position predicts the first
token of *every* candidate. The model runs its LM head only at these n positions (`logits_at`),
so no [rows, T, V] tensor is built.

Routing supervision (the supervised methods) and the diagnostics read the gold candidate's answer positions only
(`supervised_mask`): prompt tokens other than its last, padding and the other candidates are
excluded, the choice this codebase makes for "the observed next-token CE of the gold answer's
tokens". In both layouts these positions are distinct and hold the same hidden states.

max_length bounds what one candidate sees: prompt + that candidate <= max_length. The prompt of an
example is cut from the left to max_length minus its longest answer, once for all its candidates
(answers are never cut), so a packed row holds at most max_length - longest + sum of the answers.

Packing changes two things in training, both written down here and in docs/data.md: LoRA dropout
draws one mask for the prompt, shared by all candidates (per-candidate rows draw one per row);
and the load-balancing loss counts each prompt token once, not once per candidate. In eval mode
(no dropout) and without the load-balancing term the two layouts agree to rounding.

Scores per candidate: `sum` (total log-prob), `mean` (per answer token; the paper's ranking rule and
the training task term) and `per_char` (total / characters of the answer text). The prompt is
encoded with the tokenizer's special tokens, the answer without, and the two id lists are
concatenated, so a candidate's tokens never depend on the prompt's last word.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Example:  # one multiple-choice question; minimoe/data/benchmarks.py builds them
    id: str  # "<name>:<partition>:<source_id>", unique across the pooled partitions
    question: str
    choices: list[str]
    answer: int  # index into choices
    source: dict  # {"dataset": HF dataset id, "partition": "train"|"validation"|"test", "source_id": str}; {}: none
    prompt: str | None = None  # the whole prompt (own data with --prompt-template); None: format_prompt(question)

    def prompt_text(self) -> str:
        return format_prompt(self.question) if self.prompt is None else self.prompt


# The prompt and the answer text (paper, Experimental Configuration): `prompt + " " + answer`.
def format_prompt(question: str) -> str:
    return f"Question: {question}\nAnswer:"


def format_choice(text: str) -> str:
    return " " + text


@dataclass
class ChoiceBatch:
    input_ids: torch.Tensor  # [R, T] right-padded rows: one per example (packed) or per candidate
    attention_mask: torch.Tensor  # [R, T] 1 = real token
    position_ids: torch.Tensor  # [R, T] restart at the prompt's end for each packed candidate
    segment_ids: torch.Tensor | None  # [R, T] packed: 0 = prompt (and padding), c+1 = candidate c; else None
    # answer tokens of all candidates, n in all
    row: torch.Tensor  # [n] the row ...
    col: torch.Tensor  # [n] ... and position whose hidden state predicts the token
    target: torch.Tensor  # [n] the answer token
    cand: torch.Tensor  # [n] its candidate (index into the [C] fields)
    # candidates of all examples, C in all
    example: torch.Tensor  # [C] index of the candidate's example in the batch
    choice: torch.Tensor  # [C] index of the candidate within its example
    chars: torch.Tensor  # [C] characters of the answer text (per-character normalisation)
    n_tokens: torch.Tensor  # [C] answer tokens
    gold: torch.Tensor  # [X] gold candidate of each example
    # Host-side sizes, read without a device sync: the most candidates of one example (C_max), the
    # gold answer tokens (supervised_mask's count) and the real tokens (attention_mask's count).
    max_choices: int = 0
    supervised_tokens: int = 0
    real_tokens: int = 0
    # Training under DDP: a rank whose share of a micro-batch is empty still runs forward and backward
    # (every rank must join the same gradient all-reduces), on a stand-in batch whose loss counts zero.
    placeholder: bool = False

    def to(self, device):
        return ChoiceBatch(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(self).items()})

    @property
    def scored_positions(self) -> tuple[torch.Tensor, torch.Tensor]:  # the model's `logits_at`
        return self.row, self.col

    @property
    def gold_tokens(self) -> torch.Tensor:  # [n] bool: the token belongs to its example's gold candidate
        return (self.choice == self.gold[self.example])[self.cand]

    @property
    def supervised_mask(self) -> torch.Tensor:  # [R, T] bool: the gold answer's token positions
        hits = torch.zeros(self.input_ids.shape, dtype=torch.long, device=self.input_ids.device)
        return hits.index_put((self.row, self.col), self.gold_tokens.long(), accumulate=True) > 0

    def at_supervised(self, values) -> torch.Tensor:
        """[n] per-token values -> [R, T], the gold tokens' values at their positions, 0 elsewhere.

        Differentiable; the layout of `Routing`'s tokens (rows flattened), for the method term.
        Every answer token is put, the others as zeros, so that no boolean index syncs the device;
        accumulate, because a packed row's prompt end predicts every candidate's first token (one
        position, C tokens, one of them gold): there the sum is the gold value exactly."""
        out = values.new_zeros(self.input_ids.shape)
        return out.index_put((self.row, self.col), torch.where(self.gold_tokens, values, 0), accumulate=True)


def pad_id(config_or_tokenizer) -> int:
    """The checkpoint's pad id, else its eos id, else 0: padded positions are masked out of attention
    and scores, so any id serves."""
    for i in (config_or_tokenizer.pad_token_id, config_or_tokenizer.eos_token_id):
        if i is not None:
            return i
    return 0


def check_max_length(examples: list[Example], tokenizer, max_length: int, where: str):
    """Refuse a max_length that leaves no prompt token before some example's longest answer (the
    error make_choice_batch would raise mid-run), naming the first such example."""
    for ex in examples:
        longest = max(len(tokenizer.encode(format_choice(text), add_special_tokens=False)) for text in ex.choices)
        if max_length <= longest:
            raise ValueError(f"{where}: example {ex.id}: max_length={max_length} leaves no prompt token before its "
                             f"longest answer ({longest} tokens); expected max_length > {longest}")


def make_choice_batch(examples: list[Example], tokenizer, pad_token_id: int, max_length: int | None = None,
                      *, packed: bool = True, pad_to: int = 1) -> ChoiceBatch:
    """Tokenise every (prompt, candidate) pair of `examples` into one right-padded batch (`pack_choices`)."""
    groups, chars = [], []
    for ex in examples:
        prompt = tokenizer.encode(ex.prompt_text())
        answers = [tokenizer.encode(format_choice(text), add_special_tokens=False) for text in ex.choices]
        for c, (text, answer) in enumerate(zip(ex.choices, answers)):
            if not answer:
                raise ValueError(f"example {ex.id}: choice {c} ({text!r}) encodes to no tokens")
            chars.append(len(text))
        if max_length is not None:
            keep = max_length - max(map(len, answers))  # drop the prompt's start, never an answer
            if keep < 1:
                raise ValueError(f"example {ex.id}: max_length={max_length} leaves no prompt token before its "
                                 f"longest answer ({max(map(len, answers))} tokens); expected max_length > that")
            prompt = prompt[-keep:]
        groups.append((prompt, answers))
    return pack_choices(groups, pad_token_id, packed=packed, chars=chars, gold=[ex.answer for ex in examples],
                        pad_to=pad_to)


def pack_choices(groups: list[tuple[list[int], list[list[int]]]], pad_token_id: int, *, packed: bool = True,
                 chars: list[int] | None = None, gold: list[int] | None = None, pad_to: int = 1) -> ChoiceBatch:
    """(prompt ids, [answer ids of each candidate]) per example -> one right-padded batch, in either layout.
    chars: the answer texts' lengths, in candidate order (default: their token counts); gold: each
    example's gold candidate (default 0); pad_to: the row length is rounded up to a multiple of it
    (compiled models and CUDA graphs see a few shapes instead of one per batch; padding is masked,
    so scores do not change). Prompts must be non-empty: the first answer token is predicted at the
    prompt's last position."""
    if not (isinstance(pad_to, int) and pad_to >= 1):
        raise ValueError(f"pad_to={pad_to!r}; expected a positive int (1: no rounding)")
    rows, positions, segments, tokens, cands = [], [], [], [], []
    for x, (prompt, answers) in enumerate(groups):
        if not prompt:
            raise ValueError(f"example {x}: an empty prompt; the first answer token needs a position to be predicted at")
        P = len(prompt)
        first = len(cands)  # this example's first candidate index
        cands += [(x, c, len(answer)) for c, answer in enumerate(answers)]
        if packed:
            ids, pos, seg, r = list(prompt), list(range(P)), [0] * P, len(rows)
            for c, answer in enumerate(answers):
                start = len(ids)  # column of the candidate's first token
                for j, t in enumerate(answer):  # token j is predicted at the prompt's end (j = 0) or at j-1
                    tokens.append((r, P - 1 if j == 0 else start + j - 1, t, first + c))
                ids += answer
                pos += range(P, P + len(answer))
                seg += [c + 1] * len(answer)
            rows.append(ids), positions.append(pos), segments.append(seg)
        else:
            for c, answer in enumerate(answers):
                r = len(rows)
                tokens += [(r, P - 1 + j, t, first + c) for j, t in enumerate(answer)]
                rows.append(list(prompt) + list(answer)), positions.append(list(range(P + len(answer))))
    R, T = len(rows), -(-max(len(r) for r in rows) // pad_to) * pad_to
    input_ids = torch.full((R, T), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((R, T), dtype=torch.long)
    position_ids = torch.zeros((R, T), dtype=torch.long)
    segment_ids = torch.zeros((R, T), dtype=torch.long) if packed else None
    for r, ids in enumerate(rows):
        input_ids[r, :len(ids)] = torch.tensor(ids)
        attention_mask[r, :len(ids)] = 1
        position_ids[r, :len(ids)] = torch.tensor(positions[r])
        if packed:
            segment_ids[r, :len(ids)] = torch.tensor(segments[r])
    row, col, target, cand = (torch.tensor(v) for v in zip(*tokens))
    example, choice, n_tokens = (torch.tensor(v) for v in zip(*cands))
    chars = torch.tensor(chars) if chars is not None else n_tokens.clone()
    gold = gold if gold is not None else [0] * len(groups)
    gold_tokens = sum(n for x, c, n in cands if c == gold[x])
    return ChoiceBatch(input_ids, attention_mask, position_ids, segment_ids, row, col, target, cand,
                       example, choice, chars, n_tokens, torch.tensor(gold), max_choices=max(len(a) for _, a in groups),
                       supervised_tokens=gold_tokens, real_tokens=sum(map(len, rows)))


def forward_choices(model, batch: ChoiceBatch):
    """One forward over the batch's rows, LM head at the answer positions -> (output, log-probs [n] fp32)."""
    out = model(batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                segment_ids=batch.segment_ids, logits_at=batch.scored_positions)
    return out, answer_token_logprobs(out.logits, batch)


def answer_token_logprobs(logits, batch: ChoiceBatch):
    """logits [n, V] at the answer positions -> log p(answer token) [n] in fp32."""
    return F.log_softmax(logits.float(), dim=-1).gather(-1, batch.target[:, None])[:, 0]


def choice_scores(token_logprobs, batch: ChoiceBatch) -> dict[str, torch.Tensor]:
    """Per candidate: summed, mean-per-token and per-character answer log-probability, each [C]."""
    total = token_logprobs.new_zeros(batch.choice.shape).index_add(0, batch.cand, token_logprobs)
    return {"sum": total, "mean": total / batch.n_tokens, "per_char": total / batch.chars.clamp(min=1)}


def by_example(values, batch: ChoiceBatch) -> torch.Tensor:
    """[C] candidate values -> [X, C_max], -inf where an example has fewer candidates."""
    X, C = batch.gold.shape[0], batch.max_choices
    table = torch.full((X, C), float("-inf"), dtype=values.dtype, device=values.device)
    table[batch.example, batch.choice] = values
    return table


def choice_loss(mean_scores, batch: ChoiceBatch, reduction: str = "mean"):
    """Task term: cross-entropy over the candidates, each scored by its mean answer-token log-prob."""
    return F.cross_entropy(by_example(mean_scores, batch), batch.gold, reduction=reduction)


def predictions(scores, batch: ChoiceBatch) -> torch.Tensor:
    """[X] the candidate with the highest score (ties: the first)."""
    return by_example(scores, batch).argmax(-1)
