"""Answer-choice accuracy of an in-memory model on a list of examples, and its routing diagnostics.

`evaluate_split` scores a model; `diagnostics_report` turns its token arrays into the paper's routing
diagnostics. What to evaluate (a run, an adapter, a base model) and the evaluation folder it writes
are minimoe/runs/eval_run.py's, which calls these.

Scoring (paper, "Experimental Configuration"): all candidates of `batch_size` examples run in one
forward (`make_choice_batch`). Examples are sorted by a length proxy
(characters of the question plus the longest choice) to cut padding; outputs keep the input order.
The paper ranks by mean answer-token log-prob ("accuracy"); sum and per-character rankings are
reported beside it. "choice_nll" is the mean over examples of the cross-entropy over candidates
scored by their mean token log-prob: the length-normalised answer-choice NLL that the paper
selects checkpoints by.

Routing diagnostics are read at the gold answer's token positions (`ChoiceBatch.supervised_mask`),
the tokens that supervised methods' training supervises; token CE there is the observed next-token CE.
- Every method, per diagnosed layer (the router spec's layers; the final layer without a spec):
  C_t from the native logits over the native top-K (Eq. diagnostic_token_concentration), computed
  here from `Routing.logits` (`routing.native_concentration`) so that it is the same statistic under
  every policy; C_bar, N_eff = 1/C_bar and the token-level Pearson r(C_t, CE_t) (Eq.
  diagnostic_split_concentration, diagnostic_concentration_loss_correlation; undefined -> NaN ->
  null in JSON).
- layers whose method predicts the error (routing.Method.predicts_error; its prediction is e_hat)
  also: pointwise r(e_hat_t, CE_t), group Pearson/Spearman over (layer, target token id)
  groups, and equal-count decile curves of train and evaluated populations, both standardised with
  the train groups' moments (subsec:error_prediction_analysis), drawn as in fig:arc_error_prediction.
  With more than one such layer, a "pooled" entry groups all of them by (layer, token) as the paper.
  One run is one seed: averaging group means across seeds is left to `average_groups_across_seeds`
  on the saved token arrays.

Decisions where neither the paper nor train.py fixes the answer:
- A run folder resolves only through selection.json (last_epoch / selected_epoch); a run without
  one has not finished and is refused, rather than guessing its latest epoch.
- Identity keys: "method" is the run's label; outside a run it is the adapter's router method
  (its record's label; "CE" for LoRA on native routing), or "native" without an adapter, and "seed" is
  null. "dataset" is the benchmark name, or the name of the folder holding the manifests.
- Model dtype "auto" is train.py's rule (runs.pick_dtype: bf16 on CUDA, fp32 on the CPU unless
  $MINIMOE_CPU_DTYPE says bfloat16); max_length and data default
  to the run's. The train population is the run's train split cut to its max_train_examples.
- Decile curves need >= 10 groups in each population and non-constant train group means; else
  they are null with "deciles_skipped" saying why (a fresh error head predicts one constant).

Rows are packed (minimoe/core/task/choices.py): one row per example, its prompt once and every candidate
behind a block-causal mask, the LM head only at answer positions; `packed=False` scores one row per
candidate, the reference path, with the same scores to rounding.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from minimoe.core.task.choices import (Example, by_example, choice_loss, choice_scores, forward_choices, make_choice_batch,
                                  pad_id, predictions)
from minimoe.core.routing_methods.routing import Scoring, moe_blocks, native_concentration
from minimoe.evaluation.diagnostics import (concentration_summary, decile_curve, error_prediction_summary,
                                            group_by_layer_token, population_moments)
from minimoe.evaluation.folders import plot_file

log = logging.getLogger(__name__)

NORMALISATIONS = {"mean": "accuracy", "sum": "accuracy_sum", "per_char": "accuracy_per_char"}
DECILE_BINS = 10


# ----------------------------------------------------------------------------- scoring

@dataclass
class TokenArrays:
    """One split's observations at the gold answer's token positions, n tokens in all."""
    token_ce: np.ndarray  # [n] observed next-token CE
    target: np.ndarray  # [n] the target token id (with the layer, the group key)
    example: np.ndarray  # [n] index of the token's example in the evaluated list
    concentration: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> [n] C_t
    e_hat: dict[int, np.ndarray] = field(default_factory=dict)  # error-predicting layer -> [n] aggregate prediction e_hat

    def save(self, path):
        arrays = {"token_ce": self.token_ce, "target": self.target, "example": self.example}
        arrays.update({f"concentration_layer{l}": v for l, v in self.concentration.items()})
        arrays.update({f"e_hat_layer{l}": v for l, v in self.e_hat.items()})
        np.savez(path, **arrays)


def diagnosed_layers(model) -> list[int]:
    spec = model.router_spec
    return list(spec["layers"]) if spec else list(moe_blocks(model))[-1:]  # native: the final MoE layer


def _length_proxy(ex: Example) -> int:
    return len(ex.question) + max(len(c) for c in ex.choices)


@torch.inference_mode()
def evaluate_split(model, tokenizer, examples: list[Example], *, batch_size: int = 16, device=None,
                   diagnostics: bool = True, max_length: int | None = None, packed: bool = True,
                   progress: str | None = None, pad_to: int = 1, autocast=nullcontext):
    """Score every candidate of `examples` -> (records, metrics, TokenArrays or None).

    records: one dict per example, in input order (the predictions.jsonl lines).
    metrics: n_examples, accuracy (mean-token), accuracy_sum, accuracy_per_char, choice_nll.
    max_length: longest prompt + candidate in tokens; longer prompts lose their start (make_choice_batch),
    as in training. packed: one row per example (default) or one per candidate (the reference path).
    progress: a tqdm bar over the batches with this description; None: no bar.
    pad_to: rows padded to a multiple of it (a compiled model's length buckets; scores do not change).
    autocast: makes the context each forward runs in (training's policy, runs.device.autocast_for).
    """
    if not examples:
        raise ValueError("evaluate_split: no examples")
    if batch_size < 1:
        raise ValueError(f"evaluate_split: batch_size={batch_size}; expected >= 1")
    device = torch.device(device) if device is not None else model.device
    with eval_mode(model):  # LoRA dropout off, also when a trainer calls this mid-run
        return _score(model, tokenizer, examples, batch_size, device, diagnostics, max_length, packed, progress, pad_to,
                      autocast)


@contextmanager
def eval_mode(model):
    """model.eval() inside; afterwards every module gets its own train/eval flag back."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, mode in modes:
            m.training = mode


def _score(model, tokenizer, examples, batch_size, device, diagnostics, max_length, packed, progress=None, pad_to=1,
           autocast=nullcontext):
    k, layers = Scoring.of(model.config), diagnosed_layers(model)  # the family's native top-K
    method = model.router_method
    errors = method is not None and method.predicts_error  # its Routing.prediction is e_hat
    order = sorted(range(len(examples)), key=lambda i: -_length_proxy(examples[i]))  # longest first: OOM early
    records: list[dict | None] = [None] * len(examples)
    seen = {"token_ce": [], "target": [], "example": []}
    conc: dict[int, list] = {l: [] for l in layers}
    e_hat: dict[int, list] = {}
    starts = range(0, len(order), batch_size)
    for start in tqdm(starts, desc=progress, unit="batch", disable=progress is None, leave=False):
        idx = order[start:start + batch_size]
        batch = make_choice_batch([examples[i] for i in idx], tokenizer, pad_id(tokenizer), max_length,
                                  packed=packed, pad_to=pad_to).to(device)
        with autocast():
            out, logp = forward_choices(model, batch)  # logp [n] fp32, every candidate's answer tokens
        scores = choice_scores(logp, batch)
        tables = {name: by_example(s, batch).tolist() for name, s in scores.items()}  # [X, C_max]
        tokens = by_example(batch.n_tokens.float(), batch).tolist()
        chars = by_example(batch.chars.float(), batch).tolist()
        picked = {name: predictions(s, batch).tolist() for name, s in scores.items()}
        nll = choice_loss(scores["mean"], batch, reduction="none").tolist()  # [X]
        for x, i in enumerate(idx):
            ex, n = examples[i], len(examples[i].choices)
            records[i] = {"id": ex.id, "gold": ex.answer, "prediction": picked["mean"][x],
                          "correct": picked["mean"][x] == ex.answer,
                          "prediction_sum": picked["sum"][x], "prediction_per_char": picked["per_char"][x],
                          "choice_nll": nll[x],
                          "logprob_mean": tables["mean"][x][:n], "logprob_sum": tables["sum"][x][:n],
                          "logprob_per_char": tables["per_char"][x][:n],
                          "n_tokens": [int(t) for t in tokens[x][:n]], "n_chars": [int(c) for c in chars[x][:n]]}
        if not diagnostics:
            continue
        mask = batch.supervised_mask.flatten()  # [R*T], the same flattening as Routing's tokens
        token_example = torch.tensor(idx, device=device)[batch.example[batch.cand]]  # [n] index into `examples`
        for name, values in (("token_ce", -logp.double()), ("target", batch.target), ("example", token_example)):
            seen[name].append(batch.at_supervised(values).flatten()[mask].cpu().numpy())
        for l in layers:
            routing = out.routings[l]
            c = native_concentration(routing.logits[mask], k)  # [n]
            conc[l].append(c.clamp_max(1.0).double().cpu().numpy())  # a sum of squares can round past 1
            if errors and routing.prediction is not None:
                e_hat.setdefault(l, []).append(routing.prediction[mask].double().cpu().numpy())
    metrics = {"n_examples": len(examples)}
    for name, key in NORMALISATIONS.items():
        field_name = "prediction" if name == "mean" else f"prediction_{name}"
        metrics[key] = sum(r[field_name] == r["gold"] for r in records) / len(records)
    metrics["choice_nll"] = float(np.mean([r["choice_nll"] for r in records]))
    arrays = None
    if diagnostics:
        arrays = TokenArrays(np.concatenate(seen["token_ce"]), np.concatenate(seen["target"]),
                             np.concatenate(seen["example"]), {l: np.concatenate(v) for l, v in conc.items()},
                             {l: np.concatenate(v) for l, v in e_hat.items()})
    return records, metrics, arrays


# ----------------------------------------------------------------------------- diagnostics

def _curve_json(curve: dict) -> dict:
    return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in curve.items()}


def error_prediction_stats(populations: dict[str, tuple], title: str):
    """populations: split -> (layer, target, e_hat, token_ce) arrays, "train" among them for curves.

    -> ({split: pointwise/group stats (+ deciles)}, plot arguments or None). Deciles need the train
    population (its group moments standardise every population) and >= 10 groups everywhere.
    """
    stats = {name: error_prediction_summary(*arrays) for name, arrays in populations.items()}
    groups = {name: group_by_layer_token(*arrays) for name, arrays in populations.items()}
    if "train" not in groups:
        return stats, None
    reference = population_moments(groups["train"].predicted, groups["train"].observed)
    reason = None
    if min(len(g.keys) for g in groups.values()) < DECILE_BINS:
        reason = f"fewer than {DECILE_BINS} layer-token groups"
    elif reference[1] <= 0 or reference[3] <= 0:
        reason = "constant train-group predicted or observed error (no moments to standardise with)"
    if reason is not None:
        for s in stats.values():
            s["deciles"], s["deciles_skipped"] = None, reason
        return stats, None
    curves = {name: decile_curve(g.predicted, g.observed, reference=reference, bins=DECILE_BINS)
              for name, g in groups.items()}
    for name, curve in curves.items():
        stats[name]["deciles"] = _curve_json(curve)
    stats["reference_moments"] = dict(zip(("pred_mean", "pred_std", "obs_mean", "obs_std"), reference))
    evaluated = [name for name in curves if name != "train"]
    plot = (curves["train"], curves[evaluated[0]], title) if evaluated else None
    return stats, plot


def diagnostics_report(evaluated: TokenArrays, split: str, train: TokenArrays | None = None, *, label: str = ""):
    """-> (metrics.json's "diagnostics", {png name: (train_curve, test_curve, title)}); label starts the titles."""
    populations = {split: evaluated}
    if train is not None and split != "train":
        populations = {"train": train, split: evaluated}
    layers, plots = {}, {}
    for l in evaluated.concentration:
        entry = {name: concentration_summary(a.concentration[l], a.token_ce) for name, a in populations.items()}
        if l in evaluated.e_hat:
            per_split = {name: (np.full(a.token_ce.shape, l), a.target, a.e_hat[l], a.token_ce)
                         for name, a in populations.items()}
            stats, plot = error_prediction_stats(per_split, f"{label}layer {l}: train vs {split}")
            for name in populations:
                entry[name].update(stats[name])
            if "reference_moments" in stats:
                entry["reference_moments"] = stats["reference_moments"]
            if plot is not None:
                entry["plot"] = plot_file(l)
                plots[entry["plot"]] = plot
        layers[str(l)] = entry
    report = {"positions": "gold answer tokens", "populations": list(populations), "layers": layers}
    error_layers = sorted(evaluated.e_hat)
    if len(error_layers) > 1:  # the paper's groups: (layer, token) over every supervised layer
        pooled = {name: tuple(np.concatenate(parts) for parts in zip(*(
                      (np.full(a.token_ce.shape, l), a.target, a.e_hat[l], a.token_ce) for l in error_layers)))
                  for name, a in populations.items()}
        stats, plot = error_prediction_stats(pooled, f"{label}layers {error_layers}: train vs {split}")
        if plot is not None:
            stats["plot"] = plot_file(None)
            plots[stats["plot"]] = plot
        report["pooled"] = {"layers": error_layers, **stats}
    return report, plots


def json_safe(value):
    """NaN/inf -> None (JSON null), numpy scalars -> Python numbers, recursively."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, (np.integer, np.bool_)):
        return value.item()
    if isinstance(value, (float, np.floating)):
        return float(value) if np.isfinite(value) else None
    return value
