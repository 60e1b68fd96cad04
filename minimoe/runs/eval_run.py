"""An evaluation folder: what to evaluate (a run or adapter folder, its base model and data), loaded, scored
by minimoe/evaluation/accuracy.py, and written.

An evaluation folder is made in two steps: `load_evaluation` resolves what to evaluate (a run or adapter
folder, its base model and data, the train population) and loads it into an `Evaluation`; `score` scores
that and writes the output folder atomically (`atomic_directory`; its files: minimoe/evaluation/folders.py;
error-prediction plots for a method that predicts the error). evaluate.py runs the two; train.py's test
scoring (`evaluate_run`, into RUN/eval/<split>) and `evaluate_zero_shot` (the base model,
RUN/eval/<split>-base) make the Evaluation of the model they hold instead of loading one.
`accuracy_report` turns many metrics.json into the paper's table. What each number is, and the decisions
behind them: minimoe/evaluation/accuracy.py.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from minimoe.atomic import check_replaceable
from minimoe.data.benchmarks import DEFAULT_DATA_DIR, SPLITS, Example, load_split
from minimoe.data.manifests import split_sha256
from minimoe.data.chat import TokenRow
from minimoe.data.instruct import TextExample, encode_splits
from minimoe.core.adaptation.packed_embedding import pack_embedding
from minimoe.core.decoder.generate import generate
from minimoe.evaluation.accuracy import diagnostics_report, eval_mode, evaluate_split, json_safe
from minimoe.evaluation.diagnostics import (PAPER_SEEDS, accuracy_table, collect_metrics, metrics_files,
                                            partial_reason, plot_error_prediction)
from minimoe.evaluation.folders import METRICS, PREDICTIONS, eval_dir, tokens_file
from minimoe.evaluation.heldout import evaluate_tokens
from minimoe.loading.checkpoint import DTYPES, atomic_directory, from_pretrained
from minimoe.loading.hub import resolve_checkpoint
from minimoe.loading.tokenizer import load_tokenizer
from minimoe.runs.adapters import load_adapter
from minimoe.runs.device import autocast_for, pick_device, pick_dtype
from minimoe.runs.naming import ablation_settings
from minimoe.runs.provenance import provenance
from minimoe.runs.run_folder import AdapterSource, read_json, resolve_adapter

log = logging.getLogger(__name__)

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
    generate: int = 0  # chat and completion data: greedy completions of the first N examples (generations.jsonl)


def load_model(folder, adapter: AdapterSource | None, *, device: torch.device, dtype: str = "auto",
               allow_other_base: bool = False, quantize: str | None = None, quantize_embedding: bool = False):
    """The checkpoint in `folder` on `device` (runs.pick_device's), in `dtype` ("auto": train.py's rule,
    runs.pick_dtype), its base packed as `quantize` says (a QLoRA run's: core/adaptation/quantized.py), with `adapter`
    loaded onto it -> (model, tokenizer); quantize_embedding: its embedding's table packed too (packed_embedding.py)."""
    model = from_pretrained(folder, dtype=DTYPES[pick_dtype(dtype, device)], device=device, quantize=quantize)
    if quantize_embedding:
        pack_embedding(model)
    tokenizer = load_tokenizer(folder)
    if adapter is not None:
        load_adapter(model, adapter.folder, allow_other_base=allow_other_base, method=adapter.method)
    return model, tokenizer


def load_evaluation(*, base_model: str | None = None, adapter=None, checkpoint: str | None = None,
                    data: str | None = None, split: str = "test", data_dir=None, max_examples: int | None = None,
                    max_length: int | None = None, batch_size: int = 16, packed: bool | None = None,
                    train_split_diagnostics: bool | None = None, device: str = "auto", dtype: str = "auto",
                    model_revision: str | None = None, cache_dir=None, allow_other_base: bool = False,
                    chat_template=None, generate: int = 0) -> Evaluation:
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
    model, tokenizer = load_model(folder, source, device=torch_device, dtype=dtype, allow_other_base=allow_other_base,
                                  quantize=run_config.get("quantize"),  # scored on the base it trained on
                                  quantize_embedding=run_config.get("quantize_embedding", False))
    if any(isinstance(ex, TextExample) for ex in examples):  # chat or completion: their token rows, no diagnostics
        examples = encode_splits({split: examples}, tokenizer, folder, chat_template or run_config.get("chat_template"),
                                 max_length, str(data))[split]
        train_examples = None
    keys = _identity(source, base_model=base_model, model=model, data=data, split=split, batch_size=batch_size,
                     max_examples=max_examples, max_length=max_length, split_record=record)
    keys["provenance"] = provenance(base_model, folder, revision=model_revision, device=torch_device)
    return Evaluation(model, tokenizer, examples, keys, train_examples, batch_size, max_length, packed, generate)


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
    in at the end: minimoe/evaluation/folders.py names its files); returns the metrics.json content."""
    check_replaceable(out, "evaluation")  # never replace a run, runs/ or an adapter; fail before any work
    e = evaluation
    split = e.identity["split"]
    if isinstance(e.examples[0], TokenRow):
        return score_tokens(e, out, quiet=quiet)

    def autocast():  # training's policy for the model's device and dtype: bf16 autocast on CUDA for bf16 weights
        return autocast_for(e.model.device, e.model.dtype)
    records, metrics, arrays = evaluate_split(e.model, e.tokenizer, e.examples, batch_size=e.batch_size,
                                              max_length=e.max_length, packed=e.packed,
                                              progress=None if quiet else f"scoring {split}", autocast=autocast)
    train_arrays = None
    extra = {}
    if e.train_examples is not None:
        _, train_metrics, train_arrays = evaluate_split(e.model, e.tokenizer, e.train_examples,
                                                        batch_size=e.batch_size, max_length=e.max_length,
                                                        packed=e.packed, progress=None if quiet else "scoring train",
                                                        autocast=autocast)
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


def score_tokens(e: Evaluation, out, *, quiet: bool = False) -> dict:
    """`score` for chat and completion rows: the held-out loss and perplexity per supervised token
    (evaluation/heldout.py); predictions.jsonl holds each example's loss and supervised tokens."""
    records, metrics = evaluate_tokens(e.model, e.examples, batch_size=e.batch_size,
                                       pad_token_id=e.tokenizer.pad_token_id,
                                       progress=None if quiet else f"scoring {e.identity['split']}",
                                       autocast=lambda: autocast_for(e.model.device, e.model.dtype))
    result = json_safe({**e.identity, **metrics})
    generations = [generate_row(e.model, e.tokenizer, row) for row in e.examples[:e.generate]]
    with atomic_directory(out, "evaluation") as tmp:
        if generations:
            with open(tmp / GENERATIONS, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(g, ensure_ascii=False) + "\n" for g in generations)
        with open(tmp / PREDICTIONS, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(json_safe(r), ensure_ascii=False, allow_nan=False) + "\n")
        with open(tmp / METRICS, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2, allow_nan=False)
            f.write("\n")
    return result


GENERATIONS = "generations.jsonl"  # evaluate.py --generate N: {id, prompt, reference, generation} per line


def generate_row(model, tokenizer, row: TokenRow) -> dict:
    """A held-out example's last supervised turn (the last run of supervised tokens: the final assistant
    turn, or the completion) generated greedily from everything before it, through the KV and state caches
    (core/decoder/generate.py): at most its reference's length + 16 tokens, stopping at the reference's last
    token (the end-of-turn marker, or end of sequence)."""
    start = len(row.supervised) - 1
    while start > 0 and row.supervised[start - 1]:
        start -= 1
    prompt, reference = row.ids[:start], row.ids[start:]
    device = next(model.parameters()).device
    with eval_mode(model):
        out = generate(model, torch.tensor([prompt], device=device), len(reference) + 16,
                       eos_token_id=reference[-1])[0, len(prompt):].tolist()
    return {"id": row.id, "prompt": tokenizer.decode(prompt, skip_special_tokens=False),
            "reference": tokenizer.decode(reference, skip_special_tokens=False),
            "generation": tokenizer.decode(out, skip_special_tokens=False)}


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
