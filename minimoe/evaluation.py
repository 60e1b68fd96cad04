"""Evaluation: answer-choice accuracy of a checkpoint (+ adapter) on one split, and routing diagnostics.

`evaluate_split` scores an in-memory model on a list of examples. An evaluation folder is made in
two steps: `load_evaluation` resolves what to evaluate (a run or adapter folder, its base model and
data, the train population) and loads it into an `Evaluation`; `score` scores that and writes the
output folder atomically (`atomic_directory`; its files: minimoe/eval_folder.py; error-prediction
plots for a method that predicts the error). evaluate.py runs the two; train.py's test scoring
(`evaluate_run`, into RUN/eval/<split>) and `evaluate_zero_shot` (the base model, RUN/eval/<split>-base)
make the Evaluation of the model they hold instead of loading one. `accuracy_report` turns many
metrics.json into the paper's table.

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

Rows are packed (minimoe/scoring.py): one row per example, its prompt once and every candidate
behind a block-causal mask, the LM head only at answer positions; `packed=False` scores one row per
candidate, the reference path, with the same scores to rounding.
"""
from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from minimoe.adapters import load_adapter
from minimoe.atomic import check_replaceable
from minimoe.checkpoint import DTYPES, atomic_directory, from_pretrained, load_tokenizer, resolve_checkpoint
from minimoe.config import ablation_settings
from minimoe.data import DEFAULT_DATA_DIR, SPLITS, Example, load_split, split_sha256
from minimoe.diagnostics import (PAPER_SEEDS, accuracy_table, collect_metrics, concentration_summary,
                                 decile_curve, error_prediction_summary, group_by_layer_token,
                                 metrics_files, partial_reason, plot_error_prediction, population_moments)
from minimoe.eval_folder import METRICS, PREDICTIONS, eval_dir, plot_file, tokens_file
from minimoe.provenance import provenance
from minimoe.routing import native_concentration
from minimoe.runs import AdapterSource, pad_id, pick_device, pick_dtype, read_json, resolve_adapter
from minimoe.scoring import by_example, choice_loss, choice_scores, forward_choices, make_choice_batch, predictions

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
    return list(spec["layers"]) if spec else [model.config.num_hidden_layers - 1]


def _length_proxy(ex: Example) -> int:
    return len(ex.question) + max(len(c) for c in ex.choices)


@torch.inference_mode()
def evaluate_split(model, tokenizer, examples: list[Example], *, batch_size: int = 16, device=None,
                   diagnostics: bool = True, max_length: int | None = None, packed: bool = True,
                   progress: str | None = None, pad_to: int = 1):
    """Score every candidate of `examples` -> (records, metrics, TokenArrays or None).

    records: one dict per example, in input order (the predictions.jsonl lines).
    metrics: n_examples, accuracy (mean-token), accuracy_sum, accuracy_per_char, choice_nll.
    max_length: longest prompt + candidate in tokens; longer prompts lose their start (make_choice_batch),
    as in training. packed: one row per example (default) or one per candidate (the reference path).
    progress: a tqdm bar over the batches with this description; None: no bar.
    pad_to: rows padded to a multiple of it (a compiled model's length buckets; scores do not change).
    """
    if not examples:
        raise ValueError("evaluate_split: no examples")
    if batch_size < 1:
        raise ValueError(f"evaluate_split: batch_size={batch_size}; expected >= 1")
    device = torch.device(device) if device is not None else model.device
    with eval_mode(model):  # LoRA dropout off, also when a trainer calls this mid-run
        return _score(model, tokenizer, examples, batch_size, device, diagnostics, max_length, packed, progress, pad_to)


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


def _score(model, tokenizer, examples, batch_size, device, diagnostics, max_length, packed, progress=None, pad_to=1):
    k, layers = model.config.num_experts_per_tok, diagnosed_layers(model)
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


# ----------------------------------------------------------------------------- what to evaluate

def split_record(data, split: str, data_dir, examples: list[Example]) -> dict:
    """metrics.json's record of the split scored: its manifest's sha256 and its size, all of it."""
    return {"split_sha256": split_sha256(data, split, data_dir), "split_examples": len(examples)}


def load_examples_for(data, split: str, data_dir, max_examples: int | None = None) -> list[Example]:
    """A benchmark name (registered manifests under data_dir), a folder of <split>.jsonl manifests (as
    train.py's --data takes), or one .jsonl manifest: named after a split it must match `split`, named
    otherwise it is taken as `split`. max_examples: the first N only."""
    path = Path(data)
    if path.is_dir():
        examples = load_split(path / f"{split}.jsonl")
    elif str(data).endswith(".jsonl"):
        examples = load_split(path, split if path.stem in SPLITS else None)
    else:
        examples = load_split(str(data), split, data_dir=data_dir)
    return first(examples, max_examples)


def first(examples: list[Example], max_examples: int | None) -> list[Example]:
    """The first max_examples (all of them for None): --max-examples."""
    if max_examples is None:
        return examples
    if max_examples < 1:
        raise ValueError(f"--max-examples {max_examples}; expected >= 1")
    return examples[:max_examples]


def train_data_for(data) -> str:
    """Where the train population of `data` lives: the same benchmark or folder, or train.jsonl beside a manifest."""
    path = Path(data)
    if path.is_dir() or not str(data).endswith(".jsonl"):
        return str(data)
    train = path.with_name("train.jsonl")
    if path.stem not in SPLITS or not train.is_file():
        raise FileNotFoundError(f"{train}: no train manifest beside {data}; the diagnostics' train population "
                                f"is read from train.jsonl in the manifest's folder (or pass "
                                f"--no-train-split-diagnostics)")
    return str(train)


def dataset_name(data) -> str:
    """The report's column: a benchmark name as is; for manifests, the folder they sit in (or the file stem)."""
    path = Path(data)
    if path.is_dir():
        return path.name
    if str(data).endswith(".jsonl"):
        return path.parent.name if path.stem in SPLITS else path.stem
    return str(data)


def _wants_train_population(flag: bool | None, source: AdapterSource | None, split: str) -> bool:
    if split == "train":
        return False  # the evaluated split is the train population
    return flag if flag is not None else (source is not None and source.method.predicts_error)


def _train_limit(max_examples, run_config) -> int | None:
    """--max-examples, else the run's --max-train-examples: the population the run trained on."""
    limits = [n for n in (max_examples, run_config.get("max_train_examples")) if n]
    return min(limits) if limits else None


@dataclass
class Evaluation:
    """A loaded model and the split to score it on, with what metrics.json says about them: what `score`
    scores. `load_evaluation` loads one from disk (evaluate.py); `evaluate_run` and `evaluate_zero_shot`
    make one of the model that train.py holds in memory."""
    model: torch.nn.Module
    tokenizer: object
    examples: list[Example]  # the split as scored: cut to --max-examples
    identity: dict  # metrics.json's keys that say what was evaluated (`_identity`) and by what ("provenance")
    train_examples: list[Example] | None = None  # the train population of the error-prediction deciles
    batch_size: int = 16  # examples per forward
    max_length: int | None = None  # prompt + candidate tokens (make_choice_batch cuts prompts from the left)
    packed: bool = True  # one row per example; False: a row per candidate (the reference layout)


def load_model(folder, adapter: AdapterSource | None, *, device: torch.device, dtype: str = "auto",
               allow_other_base: bool = False):
    """The checkpoint in `folder` on `device` (runs.pick_device's), in `dtype` ("auto": train.py's rule,
    runs.pick_dtype), with `adapter` loaded onto it -> (model, tokenizer)."""
    model = from_pretrained(folder, dtype=DTYPES[pick_dtype(dtype, device)], device=device)
    tokenizer = load_tokenizer(folder)
    if adapter is not None:
        load_adapter(model, adapter.folder, allow_other_base=allow_other_base)
    return model, tokenizer


def load_evaluation(*, base_model: str | None = None, adapter=None, checkpoint: str | None = None,
                    data: str | None = None, split: str = "test", data_dir=None, max_examples: int | None = None,
                    max_length: int | None = None, batch_size: int = 16, packed: bool | None = None,
                    train_split_diagnostics: bool | None = None, device: str = "auto", dtype: str = "auto",
                    model_revision: str | None = None, cache_dir=None, allow_other_base: bool = False) -> Evaluation:
    """What evaluate.py scores, loaded: `base_model` (a folder or hub id) with the `adapter` (a run folder,
    at its `checkpoint`, or an adapter folder) loaded onto it, and `split` of `data`. Left out,
    base_model, data, data_dir, max_length and packed are the run's (config.json; packed else True), and
    so are the revision and cache folder of the run's own base model. train_split_diagnostics=None loads
    the train population only for an adapter whose method predicts the error.
    Everything that can fail on bad input fails here, before `score` writes anything: the folders and
    manifests first, then the model and adapter.
    """
    source = resolve_adapter(adapter, checkpoint) if adapter is not None else None
    run_config = source.run_config if source else {}
    base_model = base_model or run_config.get("model")
    if base_model is None:
        raise ValueError("no model: pass --model, or an --adapter run folder whose config.json names it")
    if run_config.get("model") and str(run_config["model"]) != str(base_model):
        log.warning("--model %s differs from the run's model %s; the adapter's fingerprint check still applies",
                    base_model, run_config["model"])
    if base_model == run_config.get("model"):  # the run's own base: at the revision it trained on
        model_revision = model_revision or run_config.get("model_revision")
        cache_dir = cache_dir or run_config.get("cache_dir")
    data = data or run_config.get("data")
    if data is None:
        raise ValueError("no data: pass --data, or an --adapter run folder whose config.json names its data")
    data_dir = data_dir or run_config.get("data_dir") or DEFAULT_DATA_DIR
    max_length = max_length or run_config.get("max_length")
    packed = run_config.get("packed", True) if packed is None else packed  # the run's row layout
    examples = load_examples_for(data, split, data_dir)
    record = split_record(data, split, data_dir, examples)  # the whole split, before --max-examples cuts it
    examples = first(examples, max_examples)
    train_examples = train_population(source, data, split, data_dir, max_examples, train_split_diagnostics)

    torch_device = pick_device(device)
    folder = resolve_checkpoint(base_model, cache_dir, model_revision)  # a hub id: its snapshot at a commit
    model, tokenizer = load_model(folder, source, device=torch_device, dtype=dtype, allow_other_base=allow_other_base)
    keys = _identity(source, base_model=base_model, model=model, data=data, split=split, batch_size=batch_size,
                     max_examples=max_examples, max_length=max_length, split_record=record)
    keys["provenance"] = provenance(base_model, folder, revision=model_revision, device=torch_device)
    return Evaluation(model, tokenizer, examples, keys, train_examples, batch_size, max_length, packed)


def train_population(source: AdapterSource | None, data, split: str, data_dir, max_examples: int | None,
                     wanted: bool | None) -> list[Example] | None:
    """The train split that the error-prediction deciles set the scored split against, as the run cut
    it, or None: not wanted (None: only for an adapter whose method predicts the error)."""
    if not _wants_train_population(wanted, source, split):
        return None
    run_config = source.run_config if source else {}
    return load_examples_for(train_data_for(data), "train", data_dir, _train_limit(max_examples, run_config))


def score(evaluation: Evaluation, out, *, quiet: bool = False) -> dict:
    """Score the evaluation's split, summarise, and write `out` atomically (temp folder beside it, swapped
    in at the end: minimoe/eval_folder.py names its files); returns the metrics.json content."""
    check_replaceable(out, "evaluation")  # never replace a run, runs/ or an adapter; fail before any work
    e = evaluation
    split = e.identity["split"]
    records, metrics, arrays = evaluate_split(e.model, e.tokenizer, e.examples, batch_size=e.batch_size,
                                              max_length=e.max_length, packed=e.packed,
                                              progress=None if quiet else f"scoring {split}")
    train_arrays = None
    extra = {}
    if e.train_examples is not None:
        _, train_metrics, train_arrays = evaluate_split(e.model, e.tokenizer, e.train_examples,
                                                        batch_size=e.batch_size, max_length=e.max_length,
                                                        packed=e.packed, progress=None if quiet else "scoring train")
        extra = {"train_examples": train_metrics["n_examples"], "train_accuracy": train_metrics["accuracy"]}
    label = f"{e.identity['method']}, {e.identity['dataset']}: "
    diagnostics, plots = diagnostics_report(arrays, split, train_arrays, label=label)
    result = json_safe({**e.identity, **metrics, "diagnostics": {**diagnostics, **extra}})
    with atomic_directory(out, "evaluation") as tmp:
        with open(tmp / PREDICTIONS, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(json_safe(r), ensure_ascii=False, allow_nan=False) + "\n")
        arrays.save(tmp / tokens_file(split))
        if train_arrays is not None:
            train_arrays.save(tmp / tokens_file("train"))
        for name, (train_curve, test_curve, title) in plots.items():
            plot_error_prediction(train_curve, test_curve, tmp / name, title=title)
        with open(tmp / METRICS, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2, allow_nan=False)
            f.write("\n")
    return result


def _identity(source: AdapterSource | None, *, base_model, model, data, split, batch_size, max_examples, max_length,
              split_record: dict) -> dict:
    """metrics.json's keys that say what was evaluated (the report groups by model, method, settings, dataset,
    seed; it counts only evaluations of the whole split, `diagnostics.partial_reason`)."""
    return {**split_record, "model": str(base_model), "method": source.label if source else "native",
            "dataset": dataset_name(data), "data": str(data),
            "seed": source.run_config.get("seed") if source else None, "split": split,
            # Ablation settings off the row's defaults (lambda, layers, ...): part of the report key.
            "settings": ablation_settings(source.run_config, source.method) if source and source.run_config else {},
            "adapter": str(source.folder) if source else None,
            "run": str(source.run) if source and source.run else None,
            "checkpoint": source.checkpoint if source else None, "epoch": source.epoch if source else None,
            "router": model.router_spec,
            "dtype": str(model.dtype).removeprefix("torch."), "device": model.device.type,
            "batch_size": batch_size, "max_examples": max_examples, "max_length": max_length}


def evaluate_run(run, split: str = "test", *, model=None, tokenizer=None, examples=None, train_examples=None,
                 out=None, checkpoint: str | None = None, batch_size: int = 16,
                 train_split_diagnostics: bool | None = None, device: str = "auto", dtype: str = "auto",
                 quiet: bool = False) -> dict:
    """A finished run scored into RUN/eval/<split> (RUN/eval/<split>-selected for checkpoint="selected").

    With `model` (and `tokenizer`): the in-memory model as train.py ends with it, i.e. the last epoch,
    on `examples` (default: the run's split, read again) and, for the train population, `train_examples`.
    Without: the checkpoint is loaded from the run folder, as `python evaluate.py --adapter RUN` does.
    """
    if model is not None and checkpoint not in (None, "last"):
        raise ValueError(f"evaluate_run: checkpoint={checkpoint!r} with an in-memory model, which holds the last "
                         f"epoch; leave model=None to load the {checkpoint} checkpoint from {run}")
    out = eval_dir(run, split, checkpoint) if out is None else out
    check_replaceable(out, "evaluation")  # before loading anything
    if model is None:
        if examples is not None or train_examples is not None:
            raise ValueError("evaluate_run: examples and train_examples go with an in-memory model; without one "
                             f"the run's own splits are read from {run}/config.json's data")
        evaluation = load_evaluation(adapter=run, checkpoint=checkpoint, split=split, batch_size=batch_size,
                                     train_split_diagnostics=train_split_diagnostics, device=device, dtype=dtype)
        return score(evaluation, out, quiet=quiet)
    if tokenizer is None:
        raise ValueError("an in-memory model needs its tokenizer")
    source = resolve_adapter(run)
    config = source.run_config  # the run's settings, and the process that trained the model (provenance)
    data, data_dir = config["data"], config.get("data_dir") or DEFAULT_DATA_DIR
    examples = load_examples_for(data, split, data_dir) if examples is None else examples
    if train_examples is None:
        train_examples = train_population(source, data, split, data_dir, None, train_split_diagnostics)
    elif not _wants_train_population(train_split_diagnostics, source, split):
        train_examples = None
    keys = _identity(source, base_model=config["model"], model=model, data=data, split=split,
                     batch_size=batch_size, max_examples=None, max_length=config.get("max_length"),
                     split_record=split_record(data, split, data_dir, examples))
    keys["provenance"] = config.get("provenance")
    evaluation = Evaluation(model, tokenizer, examples, keys, train_examples, batch_size, config.get("max_length"),
                            config.get("packed", True))
    return score(evaluation, out, quiet=quiet)


def evaluate_zero_shot(run, model, tokenizer, examples, cfg, split: str = "test") -> dict:
    """The base model before training (no LoRA, native routing) into RUN/eval/<split>-base; `cfg` is
    the run's config.TrainConfig.

    Its metrics.json says method "zero-shot" and carries the run's seed, so `evaluate.py report` gives
    the base model its own row beside the trained ones (the same number for every seed), and the
    provenance of the process that scored it (the run's config.json, which train.py writes first).
    """
    config = Path(run) / "config.json"
    made_by = read_json(config).get("provenance") if config.is_file() else None
    data_dir = cfg.data_dir or DEFAULT_DATA_DIR
    keys = _identity(None, base_model=cfg.model, model=model, data=cfg.data, split=split,
                     batch_size=cfg.eval_batch_size, max_examples=None, max_length=cfg.max_length,
                     split_record=split_record(cfg.data, split, data_dir, examples))
    keys |= {"provenance": made_by, "method": "zero-shot", "seed": cfg.seed, "run": str(run)}
    evaluation = Evaluation(model, tokenizer, examples, keys, None, cfg.eval_batch_size, cfg.max_length)
    return score(evaluation, eval_dir(run, split, "base"), quiet=cfg.quiet)


# ----------------------------------------------------------------------------- the accuracy table

def accuracy_report(paths, *, seeds=PAPER_SEEDS, split: str = "test") -> tuple[str, list[str]]:
    """metrics.json files (or folders searched recursively) -> (Markdown table, notes on skipped files).

    Evaluations without a seed (a base model: no run) and of other splits are skipped, not errors;
    so are partial evaluations (`diagnostics.partial_reason`), each listed under the table.
    """
    kept, notes, partial = [], [], []
    for f in metrics_files(paths, split):
        record = read_json(f)
        run_config = Path(record["run"]) / "config.json" if record.get("run") else None
        why = partial_reason(record, read_json(run_config) if run_config and run_config.is_file() else None)
        if why:
            partial.append(f"- {f}: {why}")
        elif record.get("seed") is None:
            notes.append(f"skipped {f}: no seed (not a training run)")
        elif record.get("split", split) != split:
            notes.append(f"skipped {f}: split {record.get('split')!r}, not {split!r}")
        else:
            kept.append(f)
    if not kept:
        raise ValueError(f"no metrics.json of a whole split with a seed and split {split!r} under "
                         f"{[str(p) for p in paths]}" + ("; partial: " + " ".join(partial) if partial else ""))
    records = collect_metrics(kept)
    found = sorted({r["seed"] for r in records})
    if not set(found) & set(seeds):  # else an empty table, a header and nothing under it
        raise ValueError(f"no evaluation of seeds {list(seeds)} under {[str(p) for p in paths]}; those found have "
                         f"seeds {found}: pass --seeds with some of them")
    table = accuracy_table(records, seeds=seeds)
    if partial:
        table += ("\nNot counted, partial evaluations (score the whole split to count them):\n"
                  + "\n".join(partial) + "\n")
    return table, notes
