"""One training step: answer-choice or token batches -> the paper's total loss (Eq. total_loss) -> backward.

    task CE over the candidates (each scored by its mean answer-token log-prob); on chat and
    completion rows (core/task/tokens.py) the next-token CE per supervised token instead
  + lambda * L_m (the method's prediction, e_hat or C_t, fitted with IS or ENLL to the gold answer's
    next-token CE at its answer positions; supervised methods only)
  + aux_coef * the family's load-balancing loss.

Each term is normalised by its count over the *whole* optimizer step (`counts`: all micro-batches of
the gradient accumulation and all data-parallel ranks), so that N processes, or N micro-batches, give
the gradient of one process with the whole batch (DDP averages gradients, hence the world factor).
Rows are packed (choices.py): each example's prompt runs once, so the load-balancing loss counts its
tokens once. The method is the run's `methods.Method`, resolved once by train.py: nothing is looked up here.
"""
from __future__ import annotations

from contextlib import nullcontext

from minimoe.core.task.choices import choice_loss, choice_scores
from minimoe.core.routing_methods.objectives import load_balancing_loss, supervision_loss
from minimoe.core.task.tokens import TokenBatch, forward_tokens


def step_loss(model, batches, method, counts: dict, world_size: int, *, is_eps: float = 1e-8,
              depth_scaled_lambda: bool = False, aux_coef: float = 0.0, autocast=nullcontext, stats=None,
              loss_chunk: int | None = None) -> dict:
    """Forward + backward of one optimizer step's micro-batches (this rank's); returns the step's
    logged terms as device scalars (the caller reads them back once). `method`: a configured
    methods.Method (its prediction, objective and lambda_); `counts`: the step's examples, supervised tokens
    and rows over every micro-batch and rank; `autocast`: makes the context each forward runs in;
    `stats` (tracking.RoutingStats), when given, gets each real micro-batch's routing; `loss_chunk`: the most
    scored positions the LM head runs at at once (--loss-chunk; default core/task/tokens.py's CHUNK), answer
    choices and chat rows alike (tokens.forward_tokens).

    A placeholder micro-batch (a rank without an example in the epoch's last step, training.micro_batches)
    runs with weight zero: DDP all-reduces every backward, and it must add nothing."""
    logs = {"task": 0.0, "method": 0.0, "aux": 0.0}
    supervised = method.prediction is not None
    for i, batch in enumerate(batches):
        sync = i == len(batches) - 1 or not hasattr(model, "no_sync")  # DDP: all-reduce on the last only
        weight = 0.0 if batch.placeholder else 1.0
        with nullcontext() if sync else model.no_sync(), autocast():
            out, logp = forward_tokens(model, batch, loss_chunk)  # logp [n]: candidates' answer tokens, or supervised
            if stats is not None and not batch.placeholder:
                stats.add(out.routings, batch, batch.at_supervised(-logp.detach()))
            if isinstance(batch, TokenBatch):  # per supervised token over the step, as the method term
                task = -logp.sum() * weight / counts["tokens"]
            else:
                task = choice_loss(choice_scores(logp, batch)["mean"], batch, reduction="sum") * weight / counts["examples"]
            loss = task
            logs["task"] += task.detach()
            if supervised and batch.supervised_tokens:  # host-side count: no device sync
                share = weight * batch.supervised_tokens / counts["tokens"]  # this micro-batch's part of the step's tokens
                term = supervision_loss(out.routings, batch.at_supervised(-logp), batch.supervised_mask,
                                        method.objective, eps=is_eps, depth_scaled=depth_scaled_lambda,
                                        tokens=batch.supervised_tokens) * share
                loss = loss + method.lambda_ * term
                logs["method"] += term.detach()
            if aux_coef > 0:  # packed rows: each prompt token counts once, not once per candidate
                aux = load_balancing_loss(out.routings, batch.attention_mask)
                aux = aux * weight * batch.input_ids.shape[0] / counts["rows"]
                loss = loss + aux_coef * aux
                logs["aux"] += aux.detach()
            (loss * world_size).backward()  # DDP averages over ranks; the counts are global already
    return logs
