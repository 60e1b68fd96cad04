"""Watching a run: routing statistics per layer, TensorBoard or Weights & Biases, and training curves.

    python train.py --model tiny --report-to tensorboard    # then: tensorboard --logdir runs
    WANDB_MODE=offline python train.py --model tiny --report-to wandb
    python evaluate.py plot runs/run-a runs/run-b --out curves.png

- `RoutingStats` sums, over one optimizer step's micro-batches, for each diagnosed layer (the
  method's layer scope; the final layer for CE): the expert load (the fraction of the real tokens'
  top-K slots that each expert takes), the mean diagnostic C_t at the gold answer tokens (the
  supervised positions, as evaluate.py's diagnostics), and for an error-predicting method the mean e_hat beside the
  mean observed token loss it predicts. Under torchrun (DDP or FSDP) they are summed over every
  rank's micro-batches (`summary`, one all-reduce), so they describe the step's whole batch, as one
  process's do. train.py writes them into metrics.jsonl's step lines
  ("routing"), so a run has them whether or not it reports to a tracker.
- `Tracker` sends every metrics.jsonl line as scalars: `train/<term>` (loss, task, method, aux,
  grad_norm, lr, tokens_per_s, seconds), `val/<name>` (choice_nll, accuracy, seconds) and
  `routing/layer<l>/...` (load/expert<e>, c_t, e_hat, token_loss), at the line's optimizer step.
  TensorBoard's event files go to RUN/tensorboard; a resumed run drops the events past its
  checkpoint (SummaryWriter's purge_step). W&B logs into RUN/wandb, offline with WANDB_MODE=offline;
  each launch of a run (a --resume too) is its own W&B run.
- `plot_training_curves` draws metrics.jsonl of one or more runs on one figure.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from minimoe.core.routing_methods.routing import native_concentration

REPORTERS = ("none", "tensorboard", "wandb")


class RoutingStats:
    """Per-layer routing statistics of one optimizer step, summed over micro-batches (see the module docstring)."""

    def __init__(self, layers: list[int], num_experts: int, k):  # k: the family's routing.Scoring, or K
        self.layers, self.k, self.num_experts = layers, k, num_experts
        self.load, self.sums = {}, {}  # per layer, on the routing's device: read back once, by summary
        self.supervised = 0  # gold answer tokens seen (the batches' host-side counts)

    @torch.no_grad()
    def add(self, routings, batch, token_loss):
        """routings: the forward's per-layer Routing ([R*T] tokens); token_loss [R, T]: observed CE at the
        gold answer positions (batch.at_supervised(-logp)). Masked sums, not boolean indexing, so that
        nothing here waits for the device."""
        real = batch.attention_mask.flatten().double()  # [R*T]
        mask = batch.supervised_mask.flatten().double()  # [R*T]
        self.supervised += batch.supervised_tokens
        for l in self.layers:
            routing = routings[l]
            K = routing.experts.shape[-1]
            load = real.new_zeros(self.num_experts).index_add_(0, routing.experts.flatten(),
                                                              real[:, None].expand(-1, K).flatten())
            sums = {"c_t": (native_concentration(routing.logits, self.k).double() * mask).sum()}
            if routing.prediction is not None:  # reported as e_hat where the method predicts the error
                sums["e_hat"] = (routing.prediction.double() * mask).sum()
                sums["token_loss"] = (token_loss.flatten().double() * mask).sum()
            self.load[l] = load + self.load[l] if l in self.load else load
            self.sums[l] = {k: v + self.sums[l][k] for k, v in sums.items()} if l in self.sums else sums

    def flat(self) -> torch.Tensor:
        """Every layer's load [E] and sums, in one float64 tensor on their device: what `summary` reads,
        so that the optimizer step reads it back with its other values at once (training.read_back)."""
        device = next(iter(self.load.values())).device if self.load else "cpu"
        parts = []
        for l in self.layers:
            parts.append(self.load.get(l, torch.zeros(self.num_experts, dtype=torch.float64, device=device)))
            parts += [s.reshape(1) for s in self.sums.get(l, {}).values()]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)

    def summary(self, has_e_hat: bool, values: list[float] | None = None) -> dict:
        """{"layer<l>": {"load": [E fractions], "c_t": mean, ("e_hat", "token_loss"): means if has_e_hat}}.
        has_e_hat: the method's prediction is a predicted token error (routing.Method.predicts_error).
        values: `flat()` read back already, after `sum_over_ranks` (under torchrun every rank calls both);
        None sums over the ranks and reads it here."""
        if values is None:
            self.sum_over_ranks()
        host = iter(self.flat().tolist() if values is None else values)
        out = {}
        for l in self.layers:
            load = torch.tensor([next(host) for _ in range(self.num_experts)], dtype=torch.float64)
            load = load / load.sum().clamp_min(1)
            entry = {"load": [round(x, 6) for x in load.tolist()]}
            sums = {name: next(host) for name in self.sums.get(l, {})}
            if self.supervised:
                means = {name: s / self.supervised for name, s in sums.items()}
                entry["c_t"] = means["c_t"]
                if has_e_hat:
                    entry.update(e_hat=means.get("e_hat", 0.0), token_loss=means.get("token_loss", 0.0))
            out[f"layer{l}"] = entry
        return out


    def sum_over_ranks(self):
        """Every rank's sums added into each rank's (one all-reduce of a float64 vector): a rank whose
        micro-batches were all placeholders contributes zeros."""
        import torch.distributed as dist
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        names = ("c_t", "e_hat", "token_loss")
        zero = torch.zeros((), dtype=torch.float64)
        # On the host, where every rank's copy is (gloo; train.py starts gloo beside nccl): summary reads it there.
        packed = torch.cat([torch.tensor([float(self.supervised)], dtype=torch.float64)] + [
            torch.cat([self.load.get(l, torch.zeros(self.num_experts, dtype=torch.float64)).cpu(),
                       torch.stack([self.sums.get(l, {}).get(n, zero).cpu() for n in names])])
            for l in self.layers])
        dist.all_reduce(packed)
        self.supervised = round(packed[0].item())
        for i, l in enumerate(self.layers):
            row = packed[1 + i * (self.num_experts + 3):1 + (i + 1) * (self.num_experts + 3)]
            self.load[l] = row[:self.num_experts]
            self.sums[l] = dict(zip(names, row[self.num_experts:]))


def scalars(record: dict) -> dict[str, float]:
    """A metrics.jsonl line -> {tag: value}: train/..., val/..., routing/layer<l>/..."""
    out = {}
    for key, value in record.items():
        if key in ("kind", "epoch", "step"):
            continue
        if key == "routing":
            for layer, entry in value.items():
                for name, v in entry.items():
                    if name == "load":
                        out.update({f"routing/{layer}/load/expert{e}": x for e, x in enumerate(v)})
                    else:
                        out[f"routing/{layer}/{name}"] = v
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"val/{key.removeprefix('val_')}" if record["kind"] == "epoch" else f"train/{key}"] = value
    return out


class Tracker:
    """--report-to: every metrics.jsonl line to TensorBoard or W&B ('none': nothing)."""

    def __init__(self, kind: str, run: Path, config: dict, first_step: int = 0):
        if kind not in REPORTERS:
            raise ValueError(f"--report-to {kind!r}; expected one of {', '.join(REPORTERS)}")
        self.kind, self.writer = kind, None
        if kind == "tensorboard":
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ValueError("--report-to tensorboard needs the tensorboard package: "
                                 "pip install -e \".[tensorboard]\"") from None
            # purge_step: after a resume, events past the checkpoint (logged before the kill) are dropped
            self.writer = SummaryWriter(str(run / "tensorboard"), purge_step=first_step + 1 if first_step else None)
        elif kind == "wandb":
            try:
                import wandb
            except ImportError:
                raise ValueError("--report-to wandb needs the wandb package: pip install -e \".[wandb]\"") from None
            self.writer = wandb.init(project=os.environ.get("WANDB_PROJECT", "minimoe"), name=run.name,
                                     dir=str(run), config=config)

    def log(self, record: dict):
        if self.writer is None:
            return
        values = scalars(record)
        if self.kind == "tensorboard":
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, record["step"])
            self.writer.flush()
        else:
            self.writer.log(values, step=record["step"])

    def close(self):
        if self.writer is not None:
            self.writer.close() if self.kind == "tensorboard" else self.writer.finish()


# ----------------------------------------------------------------------------- curves

CURVES = [("loss", "total loss"), ("task", "task CE (answer choices or supervised tokens)"),
          ("method", "method term L_m"), ("aux", "load-balancing loss"), ("lr", "learning rate"),
          ("val_choice_nll", "validation choice NLL"), ("val_loss", "validation next-token loss (chat, completion)")]


def plot_training_curves(runs: list[Path], out: Path) -> Path:
    """One panel per curve of CURVES that some run logged (an all-zero method or aux term is left out),
    one colour per run, against the optimizer step; validation at each epoch's last step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from minimoe.atomic import atomic_file
    from minimoe.runs.run_folder import read_metrics
    logs = {}
    for run in map(Path, runs):
        if not (run / "metrics.jsonl").is_file():
            raise FileNotFoundError(f"{run}: no metrics.jsonl; expected a run folder written by train.py")
        logs[run] = read_metrics(run)
    panels = [(key, title) for key, title in CURVES
              if any(r.get(key) for records in logs.values() for r in records)]
    if not panels:
        raise ValueError(f"{', '.join(map(str, runs))}: metrics.jsonl has no step lines yet")
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows), squeeze=False)
    for ax, (key, title) in zip(axes.flat, panels):
        for run, records in logs.items():
            points = [(r["step"], r[key]) for r in records if key in r]
            if points:
                ax.plot(*zip(*points), marker="o" if key.startswith("val_") else None, markersize=3, label=run.name)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("optimizer step")
        if key == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(out) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return out
