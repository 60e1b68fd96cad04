"""The adaptation loop behind train.py: LoRA + a routing method, batches, optimizer steps, epochs.

The step's loss (task CE + lambda * the method's term + aux_coef * load balancing, each normalised
over the whole optimizer step) is minimoe/core/task/step.py's `step_loss`; the method it trains is the run's
configured `methods.Method`, resolved once by train.py and held by its TrainConfig (`cfg.method`), which
`install_method`, `make_optimizer`, `optimizer_step` and `train` read. Rows are packed
(minimoe/core/task/choices.py; `--per-candidate-rows` for the reference layout): each example's prompt runs
once, so its LoRA dropout mask is shared by the candidates.

Reproducibility: every random draw comes from the seed (LoRA init, dropout, data order: epoch e
shuffles with seed + e), and the RNG state is saved with each checkpoint (on CUDA the device's
generator too, which dropout draws from there), so `--resume` after a kill ends on the same bits as
the uninterrupted run on CPU, and within CUDA's kernel nondeterminism on a GPU (tests/test_cuda.py)
(`load_latest` and `restore` put the checkpoint back; `train` is the loop). A mid-epoch checkpoint
(--save-every-steps) resumes by skipping the epoch's first `epoch_step` steps of that same order, not
by reshuffling. The run folder's rules (lock, log truncation, safe state files, fallback past a corrupt checkpoint) are in
minimoe/runs/run_folder.py.

Configuration: minimoe/runs/config.py (`TrainConfig`), recipes.py (the recipes), naming.py (run names).

Several processes (torchrun): DDP wraps the model here; with --shard fsdp the model arrives sharded
(minimoe/runs/sharding.py, built by cli/train.py), every rank takes part in gathering each checkpoint,
rank 0 writes it, and a resume puts each rank's rows back (docs/distributed.md).

Optimisation decisions (paper, Experimental Configuration table):
- Warmup steps are ceil(warmup * total steps), transformers' Trainer rule for a warmup ratio
  (`TrainingArguments.get_warmup_steps`): Granite ARC warms up 19 of its 375 steps, not 18.
- Learning-rate groups (`make_optimizer`): LoRA at `lr`, each head of the method at the rate its
  record names (methods.METHODS: the paper's 1e-5 for the TES error head, 1e-3 for the Dual
  Affinity copy; --error-head-lr, i.e. --method-option error_head_lr=..., sets another). A native
  gate unfrozen by --tune-router trains at the LoRA rate unless `router_lr` is given: the paper
  gives no rate of its own for it, and it is an adapted pretrained weight like the LoRA-wrapped ones.
"""
from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from tqdm import tqdm

from minimoe.atomic import atomic_file
from minimoe.core.task.choices import ChoiceBatch, make_choice_batch
from minimoe.core.routing_methods.routing import Scoring
from minimoe.core.task.step import step_loss
from minimoe.core.task.tokens import make_token_batch
from minimoe.data.chat import TokenRow
from minimoe.evaluation.accuracy import diagnosed_layers, evaluate_split
from minimoe.runs.adapters import load_adapter, load_adapter_rows, save_adapter
from minimoe.core.adaptation.trainable import trainable_parameters
from minimoe.runs.config import TrainConfig
from minimoe.runs.device import autocast_for
from minimoe.runs.install import aux_coefficient, install_method, optimizer_class, optimizer_options  # noqa: F401 (training.install_method: its callers' name)
from minimoe.runs.ranks import full, global_sum, world
from minimoe.runs.run_folder import (STATE, append_metrics, drop_later_checkpoints, drop_step_checkpoints,
                                 latest_checkpoint, params_device, read_json, read_metrics, remove_orphans, save_state,
                                 set_rng_state, truncate_metrics)
from minimoe.runs.sharding import full_optimizer_state, load_optimizer_rows
from minimoe.runs.tracking import RoutingStats, Tracker


def steps_per_epoch(n_examples: int, cfg: TrainConfig) -> int:
    """Optimizer steps per epoch; a partial last step is kept, so every example is seen once."""
    return math.ceil(n_examples / (cfg.batch_size * cfg.grad_accum))


def warmup_steps(total: int, fraction: float) -> int:
    """transformers' Trainer rule (TrainingArguments.get_warmup_steps): ceil(total * warmup_ratio)."""
    return math.ceil(total * fraction)


def make_optimizer(model, cfg: TrainConfig):
    method = cfg.method
    # A tuned native gate has no rate of its own in the paper: the LoRA rate unless --router-lr.
    heads = {group: method.values[lr] for group, (_, lr) in method.head_groups.items()}
    lrs = {"lora": cfg.lr, **heads, "router": cfg.router_lr or cfg.lr}
    groups = [{"params": [p for _, p in params], "lr": lrs[name], "name": name}  # grouped by `method`, as its rates
              for name, params in trainable_parameters(model, method).items() if params]
    return optimizer_class(cfg.optim)(groups, weight_decay=cfg.weight_decay, **optimizer_options(cfg.optim))



def lr_factor(step: int, total: int, warmup: int, schedule: str) -> float:
    """Linear warmup to the peak, then cosine or linear decay to zero (transformers' get_cosine_/
    get_linear_schedule_with_warmup, for `warmup` = `warmup_steps(total, fraction)`)."""
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else max(0.0, 1 - progress)


def loss_settings(cfg: TrainConfig, model_config=None) -> dict:
    """step_loss's keywords from the run's settings: the loss coefficients and the autocast to run in."""
    return dict(is_eps=cfg.is_eps, depth_scaled_lambda=cfg.depth_scaled_lambda,
                aux_coef=aux_coefficient(cfg, model_config), autocast=lambda: autocast(cfg), loss_chunk=cfg.loss_chunk)


# A compiled model's rows are padded to a multiple of this many tokens: torch.compile then sees one
# shape per bucket (at most max_length / 64 of them) instead of one per batch length.
COMPILE_BUCKET = 64


def length_bucket(cfg: TrainConfig) -> int:
    return COMPILE_BUCKET if cfg.compile else 1


def training_routings(model, examples, tokenizer, cfg: TrainConfig, rank: int, world_size: int):
    """The untrained model's routings over this rank's share of the training examples, without gradient
    (Method.prepare: ESFT's expert choice) -> yields (routings, attention_mask) per micro-batch."""
    with torch.no_grad():
        for b in micro_batches(examples, tokenizer, cfg, rank, world_size):
            if not b.placeholder:
                with autocast(cfg):
                    out = model(b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids,
                                segment_ids=b.segment_ids, logits_at=b.scored_positions)
                yield out.routings, b.attention_mask


def micro_batches(examples, tokenizer, cfg: TrainConfig, rank: int, world_size: int) -> list[ChoiceBatch]:
    """One optimizer step's examples -> this rank's micro-batches: every world_size-th example of each.
    A micro-batch smaller than the world (the epoch's last) leaves some ranks without an example:
    those get a placeholder, its first example, which step_loss runs with weight zero."""
    def batch(part, placeholder=False):
        if isinstance(part[0], TokenRow):  # chat and completion rows (core/task/tokens.py)
            b = make_token_batch(part, cfg.pad_token_id, pad_to=length_bucket(cfg), packed=cfg.pack,
                                 max_length=cfg.max_length).to(cfg.device)
        else:
            b = make_choice_batch(part, tokenizer, cfg.pad_token_id, cfg.max_length, packed=cfg.packed,
                                  pad_to=length_bucket(cfg)).to(cfg.device)
        b.placeholder = placeholder
        return b
    size = cfg.batch_size
    return [batch(mine) if (mine := examples[i:i + size][rank::world_size]) else batch(examples[i:i + 1], True)
            for i in range(0, len(examples), size)]


class NonFiniteTraining(ValueError):
    """A step's loss or gradient is not finite, or its clipped update is all zeros: training stops."""


def check_step(logs: dict, trainable, step: int, largest: float | None = None):
    """Stop before the optimizer applies a step that cannot train: a non-finite loss term or gradient
    norm (clipping would turn it into a NaN or an all-zero update), or a clipped gradient that is
    exactly zero everywhere (an update that changes nothing, e.g. a norm so large that clipping
    underflows). `step` is the global step being taken; the error names it and the bad terms.
    largest: the largest |gradient| (`largest_gradient`), read back already; None reads it here (a sync)."""
    bad = {k: v for k, v in logs.items() if isinstance(v, float) and not math.isfinite(v)}  # not "routing"
    if bad:
        raise NonFiniteTraining(f"step {step}: non-finite {', '.join(f'{k}={v}' for k, v in bad.items())}; "
                                f"training stopped before applying it (check lambda, tau, is_eps, aux_coef, "
                                f"lora_alpha, lr: a value that large or small overflows)")
    if largest is None:
        largest = float(largest_gradient(trainable))
    if largest == 0:
        raise NonFiniteTraining(f"step {step}: the clipped update is all zeros (gradient norm {logs['grad_norm']:g} "
                                f"before clipping); training stopped rather than take steps that change nothing")


def largest_gradient(trainable):
    """The largest |gradient| entry over `trainable` as a device scalar (0.0 when none has a gradient);
    under FSDP each rank holds its rows of a gradient, and the ranks' largest are all-reduced."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in trainable if p.grad is not None]
    if not grads:
        return 0.0
    peak = torch.stack([g.abs().max().float() if g.numel() else g.new_zeros((), dtype=torch.float32)
                        for g in grads]).max()
    if dist.is_initialized() and any(isinstance(p.grad, DTensor) for p in trainable):
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return peak


def optimizer_step(model, batches, n_examples: int, optimizer, scheduler, cfg: TrainConfig, world_size: int,
                   step: int = 0) -> dict:
    """Optimizer step number `step` over this rank's micro-batches of the step's `n_examples` (all
    ranks); returns its loss terms summed over ranks, the gradient norm before clipping, and per-layer
    routing statistics (minimoe/runs/tracking.py). A step that cannot train raises NonFiniteTraining before
    it is applied (`check_step`)."""
    real = [b for b in batches if not b.placeholder]
    counts = {"examples": n_examples, "tokens": global_sum(sum(b.supervised_tokens for b in real)),
              "rows": global_sum(sum(b.input_ids.shape[0] for b in real))}
    core = getattr(model, "module", model)  # under DDP, the model it wraps
    stats = RoutingStats(diagnosed_layers(core), core.config.num_experts, Scoring.of(core.config))
    terms = step_loss(model, batches, cfg.method, counts, world_size, stats=stats, **loss_settings(cfg, core.config))
    trainable = [p for g in optimizer.param_groups for p in g["params"]]
    grad_norm = full(torch.nn.utils.clip_grad_norm_(trainable, cfg.clip))  # FSDP: a replicated DTensor
    stats.sum_over_ranks()  # under torchrun: every rank's micro-batches (tracking.py)
    # the step's one read-back: loss terms, gradient norm, check_step's largest gradient, routing statistics
    *values, largest, routing = read_back([*terms.values(), grad_norm, largest_gradient(trainable), stats.flat()])
    logs = dict(zip([*terms, "grad_norm"], values))
    logs = {k: global_sum(v) if k in terms else v for k, v in logs.items()}
    logs["routing"] = stats.summary(cfg.method.predicts_error, routing)
    check_step(logs, trainable, step, largest)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return logs


def read_back(values) -> list:
    """Device scalars (or plain numbers) -> floats, 1-D device tensors -> lists of floats, with one transfer
    to the host (in float64, which holds every fp32 value exactly)."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        return [float(v) for v in values]
    host = torch.cat([t.double().reshape(-1) for t in tensors]).tolist()
    out, at = [], 0
    for v in values:
        if not isinstance(v, torch.Tensor):
            out.append(float(v))
            continue
        n = v.numel()
        out.append(host[at] if v.dim() == 0 else host[at:at + n])
        at += n
    return out


def autocast(cfg: TrainConfig):
    return autocast_for(cfg.device, cfg.dtype)  # evaluation's too (runs/eval_run.py)


def score_split(model, tokenizer, examples, cfg: TrainConfig) -> dict:
    """Validation: length-normalised answer-choice NLL (the selection rule's quantity) and accuracy,
    scored by the same code as evaluate.py, so validation and test numbers are comparable. Chat and
    completion rows: the loss and perplexity per supervised token (evaluation/heldout.py)."""
    quiet = cfg.quiet or world()[0] != 0
    if isinstance(examples[0], TokenRow):
        from minimoe.evaluation.heldout import evaluate_tokens
        _, metrics = evaluate_tokens(model, examples, batch_size=cfg.eval_batch_size, device=cfg.device,
                                     pad_token_id=cfg.pad_token_id, progress=None if quiet else "validation",
                                     pad_to=length_bucket(cfg), autocast=lambda: autocast(cfg),
                                     loss_chunk=cfg.loss_chunk)
        return {"loss": metrics["loss"], "perplexity": metrics["perplexity"]}
    _, metrics, _ = evaluate_split(model, tokenizer, examples, batch_size=cfg.eval_batch_size, device=cfg.device,
                                   diagnostics=False, max_length=cfg.max_length, packed=cfg.packed,
                                   progress=None if quiet else "validation", pad_to=length_bucket(cfg),
                                   autocast=lambda: autocast(cfg))
    return {"choice_nll": metrics["choice_nll"], "accuracy": metrics["accuracy"]}


def save_checkpoint(folder: Path, model, optimizer, scheduler, epoch: int, step: int, epoch_step: int,
                    base_model: str, sharded: bool):
    """The adapter (atomic folder), then training_state.pt, which marks the checkpoint complete. Sharded
    (FSDP): every rank calls it, the adapter and the optimizer state are gathered, and rank 0 writes
    (minimoe/runs/sharding.py); else rank 0 alone calls it."""
    save_adapter(model, folder, base_model=base_model)
    optimizer_state = full_optimizer_state(model, optimizer) if sharded else None
    if world()[0] == 0:
        save_state(folder / STATE, optimizer, scheduler, epoch, step, epoch_step, optimizer_state=optimizer_state)


def save_epoch(run: Path, model, optimizer, scheduler, epoch: int, step: int, base_model: str, sharded: bool = False):
    """checkpoints/epoch-N (save_checkpoint); then the mid-epoch checkpoint it supersedes goes."""
    save_checkpoint(run / "checkpoints" / f"epoch-{epoch}", model, optimizer, scheduler, epoch, step, 0, base_model,
                    sharded)
    if world()[0] == 0:
        drop_step_checkpoints(run)


def save_step(run: Path, model, optimizer, scheduler, epoch: int, epoch_step: int, step: int, base_model: str,
              sharded: bool = False):
    """checkpoints/step-G (G = global step) after `epoch_step` steps of epoch `epoch` + 1, as save_epoch;
    then the previous step checkpoint goes (only the latest is kept)."""
    save_checkpoint(run / "checkpoints" / f"step-{step}", model, optimizer, scheduler, epoch, step, epoch_step,
                    base_model, sharded)
    if world()[0] == 0:
        drop_step_checkpoints(run, keep=step)


@dataclass
class Position:
    """Where training stands, as a checkpoint's training state records it (minimoe/runs/run_folder.py)."""
    epoch: int = 0  # epochs complete
    epoch_step: int = 0  # steps of the next epoch done: a mid-epoch checkpoint; 0 after an epoch's
    step: int = 0  # optimizer steps in all: the schedule's position


def load_latest(run: Path, model, sharded: bool = False) -> dict | None:
    """The newest complete checkpoint's adapter and method heads into `model`; returns its training
    state, None when there is none. Call it before making the optimizer: loading rebuilds the
    method heads as new parameters (sharded: each rank's rows are put in place instead)."""
    checkpoint, state = latest_checkpoint(run)
    if checkpoint:
        (load_adapter_rows if sharded else load_adapter)(model, checkpoint)
    return state


def restore(run: Path, state: dict | None, optimizer, scheduler, rank: int, model=None) -> Position:
    """Optimizer, scheduler and RNG as `state` (load_latest's; None: the start) left them; returns the
    position to continue from (`model`: the sharded model whose optimizer state is keyed by parameter
    name; None: not sharded). Rank 0 removes what a kill left, and the checkpoints and log records
    past that position, which the resumed run writes again."""
    start = Position()
    if state:
        set_rng_state(state["rng"], params_device(optimizer))  # first: a sharded low-bit state sets each rank's own
        if model is not None:
            load_optimizer_rows(model, optimizer, state["optimizer"])
        else:
            optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start = Position(state["epoch"], state.get("epoch_step", 0), state["step"])
    if rank == 0:
        remove_orphans(run)
        drop_later_checkpoints(run, start.epoch, start.step)
        truncate_metrics(run, start.epoch, start.step)
    return start


def train(model, tokenizer, data: dict, cfg: TrainConfig, run: Path, *, resume: bool = False,
          on_step: Callable[[Position], object] = lambda position: None,
          on_epoch_end: Callable[[Position], object] = lambda position: None):
    """Fit `model` (LoRA + `cfg.method` already installed) on data["train"]; select on data["val"]. Returns the
    optimizer steps this call ran: 0 when a resumed run had finished training.
    on_step and on_epoch_end are called with the Position reached after each optimizer step (logged, and
    its step checkpoint written when one is due) and after each epoch (validated and checkpointed): the
    points a killed run resumes from (tests/kill.py stops runs there)."""
    rank, world_size, method = *world(), cfg.method
    sharded = cfg.shard == "fsdp"  # built sharded already (runs/sharding.py, cli/train.py)
    state = load_latest(run, model, sharded) if resume else None  # before the optimizer (see load_latest)
    # before the optimizer too: ESFT's full form makes its trainable rows from the choice
    if method.prepare is not None and not resume:  # a resume has its choice back in the checkpoint's router state
        method.prepare(model, training_routings(model, data["train"], tokenizer, cfg, rank, world_size))
    optimizer = make_optimizer(model, cfg)
    per_step = cfg.batch_size * cfg.grad_accum
    steps = steps_per_epoch(len(data["train"]), cfg)
    total = steps * cfg.epochs
    warmup = warmup_steps(total, cfg.warmup)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total, warmup, cfg.schedule))
    start = restore(run, state, optimizer, scheduler, rank, model if sharded else None) if resume else Position()
    ddp = model
    if world_size > 1 and not sharded:
        device = torch.device(cfg.device)
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    model.train()
    # every metrics.jsonl line also goes to --report-to; each is flushed as logged, so a crash loses none
    tracker = Tracker(cfg.report_to if rank == 0 else "none", run, read_json(run / "config.json") if rank == 0 else {},
                      first_step=start.step)
    step = start.step
    for epoch in range(start.epoch + 1, cfg.epochs + 1):
        order = torch.randperm(len(data["train"]), generator=torch.Generator().manual_seed(cfg.seed + epoch)).tolist()
        first = start.epoch_step if epoch == start.epoch + 1 else 0  # a mid-epoch resume skips the steps done, in this order
        bar = tqdm(range(first, steps), desc=f"epoch {epoch}/{cfg.epochs}", disable=rank != 0 or cfg.quiet)
        for s in bar:
            t0 = time.perf_counter()
            ids = order[s * per_step:(s + 1) * per_step]
            batches = micro_batches([data["train"][j] for j in ids], tokenizer, cfg, rank, world_size)
            step += 1
            logs = optimizer_step(ddp, batches, len(ids), optimizer, scheduler, cfg, world_size, step)
            seconds = time.perf_counter() - t0
            rate = global_sum(sum(b.real_tokens for b in batches if not b.placeholder)) / seconds
            loss = logs["task"] + method.lambda_ * logs["method"] + aux_coefficient(cfg, model.config) * logs["aux"]
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{rate:.0f}")
            if rank == 0:
                record = {"kind": "step", "epoch": epoch, "step": step, "loss": loss, **logs,
                          "lr": float(scheduler.get_last_lr()[0]), "tokens_per_s": rate, "seconds": seconds}
                append_metrics(run, record)
                tracker.log(record)
            every = cfg.save_every_steps
            if every and step % every == 0 and s + 1 < steps and (rank == 0 or sharded):  # at the end, the epoch's
                save_step(run, model, optimizer, scheduler, epoch - 1, s + 1, step, cfg.model, sharded)
            on_step(Position(epoch - 1, s + 1, step))
        t0 = time.perf_counter()
        val = score_split(model, tokenizer, data["val"], cfg)
        if rank == 0:
            record = {"kind": "epoch", "epoch": epoch, "step": step, **{f"val_{k}": v for k, v in val.items()},
                      "val_seconds": time.perf_counter() - t0}
            append_metrics(run, record)
            tracker.log(record)
        if rank == 0 or sharded:
            save_epoch(run, model, optimizer, scheduler, epoch, step, cfg.model, sharded)
        if dist.is_initialized():
            dist.barrier()
        on_epoch_end(Position(epoch, 0, step))
    tracker.close()
    if rank == 0:
        write_selection(run)
    return step - start.step


def write_selection(run: Path) -> dict:
    """The paper's rule, fixed before any test evaluation: minimum validation choice NLL, ties to the earlier epoch
    (chat and completion data: minimum validation loss per supervised token)."""
    epochs = [r for r in read_metrics(run) if r["kind"] == "epoch"]
    key, what = ("val_choice_nll", "validation choice NLL") if "val_choice_nll" in epochs[0] else (
        "val_loss", "validation loss per supervised token")
    if bad := [r["epoch"] for r in epochs if not math.isfinite(r[key])]:
        raise NonFiniteTraining(f"{run / 'metrics.jsonl'}: {what} is not finite at epoch(s) {bad}; "
                                f"no epoch can be selected, so selection.json is not written")
    best = min(epochs, key=lambda r: (r[key], r["epoch"]))
    rule = ("minimum length-normalised validation answer-choice NLL" if key == "val_choice_nll" else
            "minimum validation next-token loss per supervised token")
    selection = {"selected_epoch": best["epoch"], "last_epoch": max(r["epoch"] for r in epochs),
                 "rule": f"{rule}; ties to the earlier epoch", key: {str(r["epoch"]): r[key] for r in epochs}}
    with atomic_file(run / "selection.json") as tmp:
        tmp.write_text(json.dumps(selection, indent=2, allow_nan=False))
    return selection
