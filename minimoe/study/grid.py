"""The paper's grid as data: its rows (`ROWS`, `check_row`) and presets (`PRESETS`), and the cells of a
grid of train.py run folders (`Cell`, `grid`).

A cell is one (model, benchmark, row, settings, seed); its identity is its run folder,
out_dir/run_name(cfg), the same name train.py gives it. State comes from the folder alone:
  done     eval/test/metrics.json exists (or selection.json when --no-test-eval is passed through)
  partial  config.json exists but the run is not done: it is continued with train.py --resume
  missing  no config.json: it is started
so a sweep that is killed and started again skips what finished and continues what did not.
A cell's run counts as the cell only while its settings are the cell's: `changed` builds the
cell's TrainConfig from its flags (those after `--` included) and the run's from its config.json,
both through config.build_config as train.py builds them, and compares the two; sweep.py refuses to
skip, resume or report a run whose settings differ (--rerun sets such runs aside, as
<run>.replaced-<time>, and runs them again).

Where cells run: study/launch.py; the report: study/report.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

from minimoe.core.decoder.family_record import FAMILIES
from minimoe.core.routing_methods.methods import ALIASES, METHODS, Method
from minimoe.data.userdata import data_kind
from minimoe.evaluation.diagnostics import PAPER_SEEDS
from minimoe.evaluation.folders import METRICS, eval_dir, test_evaluation
from minimoe.runs.compat import settings_of
from minimoe.runs.config import build_config, differing, flag_name, loaded_settings, method_for
from minimoe.runs.flags import flags_parser
from minimoe.runs.naming import run_name
from minimoe.runs.recipes import RECIPES


BENCHMARKS = ("arc_challenge", "openbookqa", "sciq", "medmcqa")

# The accuracy table's nine rows (tab:downstream_accuracy) as train.py flags, named as the run that they
# configure names its row (Method.row): CE, ACS-ENLL, ..., TES-IS; then the baselines' rows.
ROWS = {method_for(flags).row: flags for flags in (
    dict(method="ce"),
    dict(method="acs", objective="enll"),
    dict(method="acs", objective="is"),
    dict(method="ce", tune_router=True),
    dict(method="acs", objective="enll", tune_router=True),
    dict(method="acs", objective="is", tune_router=True),
    dict(method="dual"),
    dict(method="tes", objective="enll"),
    dict(method="tes", objective="is"),
)}
PAPER_ROWS = tuple(ROWS)
# The field's router-adaptation baselines (docs/methods.md, "Baselines"), each in the form its paper
# trains: DenseMixer and router-only tuning on every MoE layer's gate, the load-balancing loss at the
# family's own coefficient beside CE, ESFT's choice on every MoE layer (LoRA on the chosen experts only).
BASELINE_ROWS = {
    "DenseMixer": dict(method="densemixer", layers="all"),
    "Router only": dict(method="router", layers="all"),
    "CE + load balancing": dict(method="ce", aux_coef="family"),
    "ESFT": dict(method="esft", layers="all", lora_targets="experts"),  # its LoRA form: the chosen experts' LoRA
}
ROWS.update(BASELINE_ROWS)


def check_row(row: str, what: str = "unknown row") -> None:
    """A row is one of the paper's (ROWS) or the name of a registered method (your own: --method-module)."""
    if row not in ROWS and ALIASES.get(row, row) not in METHODS:
        raise ValueError(f"{what} {row!r}: expected one of {list(ROWS)}, or a method registered by --method-module "
                         f"(registered: {sorted(METHODS)})")


@dataclass(frozen=True)
class Preset:
    """One table of the paper: rows x settings variants, and the models/benchmarks/seeds it reports."""
    rows: tuple  # names in ROWS; (name, recipe) restricts a row to that backbone, (name, recipe, {settings})
    # also fixes settings for it there (OLMoE's ACS rows at lambda 1e-2 in the layer-scope table)
    settings: tuple = ({},)  # ablation variants, each a dict of train.py settings (lambda_, layers, ...)
    benchmarks: tuple = BENCHMARKS
    seeds: tuple = PAPER_SEEDS
    columns: tuple = ("accuracy",)  # "choice_nll" adds the NLL column (TES sensitivity)
    tables: tuple = ()  # further report tables: "transform", "concentration"
    train_eval: bool = False  # also evaluate each run on its train split (the concentration table's train rows)
    train_args: tuple = ()  # train.py flags for every run, before the ones after `--` (which win)
    zero_shot: bool = False  # the first seed's CE run also scores the base model: the table's zero-shot row
    about: str = ""


ALL_LAYERS = {"layers": "all"}
TUNED_ACS_GRANITE = (("ACS-ENLL + affinity tuning", "granite"), ("ACS-IS + affinity tuning", "granite"))
PRESETS = {
    "main": Preset(PAPER_ROWS, tables=("comparisons",),
                   about="tab:downstream_accuracy, the nine rows, and the paired comparisons within its groups"),
    "lambda-1e-2": Preset(
        (("TES-IS", "granite"), ("TES-ENLL", "granite"), ("ACS-IS + affinity tuning", "granite"),
         ("ACS-ENLL + affinity tuning", "granite"), ("ACS-IS", "olmoe"), ("ACS-ENLL", "olmoe")),
        settings=({}, {"lambda_": 1e-2}), about="tab:method_coefficient_impact; Δ from the lambda_m = 1e-3 cell"),
    "depth": Preset(("ACS-ENLL", "ACS-IS"), settings=({}, {"layers": "all"}),
                    about="tab:supervision_depth: final vs all-layer ACS (OLMoE in the paper)"),
    "depth-scaled": Preset(TUNED_ACS_GRANITE, settings=tuple(
        {"layers": scope, **scaled} for scope in ("last:8", "all") for scaled in ({}, {"depth_scaled_lambda": True})),
        about="tab:acs_depth_coefficient_scaling (Granite, affinity-tuned ACS): last-8 and all-layer scopes, "
              "fixed vs depth-scaled lambda"),
    "excessive-scaling": Preset(TUNED_ACS_GRANITE, settings=tuple(
        {"layers": scope, "depth_scaled_lambda": True, **ten} for scope in ("last:8", "all")
        for ten in ({}, {"lambda_": 1e-2})), benchmarks=("arc_challenge",),
        about="tab:acs_excessive_scaling_control (Granite ARC): depth-scaled lambda vs ten times it"),
    "layer-scope": Preset(
        ("CE + affinity tuning", *TUNED_ACS_GRANITE,
         ("ACS-ENLL + affinity tuning", "olmoe", {"lambda_": 1e-2}), ("ACS-IS + affinity tuning", "olmoe", {"lambda_": 1e-2})),
        settings=tuple({"layers": scope} for scope in ("final", "first:8", "last:8", "all")), tables=("comparisons",),
        about="tab:affinity_router_layer_ablation: affinity tuning and ACS on the same scope (OLMoE: selected epochs)"),
    "acs-lambda": Preset(
        (*TUNED_ACS_GRANITE, ("ACS-ENLL", "olmoe"), ("ACS-IS", "olmoe"), ("ACS-ENLL + affinity tuning", "olmoe"),
         ("ACS-IS + affinity tuning", "olmoe")), settings=({}, {"lambda_": 1e-2}),
        about="tab:acs_coefficient_sensitivity: final-layer ACS at lambda 1e-3 and 1e-2"),
    "acs-screen": Preset((("ACS-IS", "olmoe"), ("ACS-ENLL", "olmoe")),
                         settings=tuple({"lambda_": v} for v in (1e-4, 1e-3, 1e-2, 1e-1)), benchmarks=("arc_challenge",),
                         about="tab:olmoe_acs_coefficient_screen (OLMoE ARC, frozen affinity): lambda 1e-4 to 1e-1"),
    "transform": Preset(("TES-IS",), settings=({}, {"transform": "log"}), benchmarks=("arc_challenge",),
                        seeds=(42, 43, 44), columns=("accuracy", "choice_nll"), tables=("transform",),
                        about="tab:error_routing_transform_ablation (Granite): started-log vs pure log"),
    "tes-lr": Preset(("TES-IS",), settings=tuple({"error_head_lr": v} for v in (1e-3, 1e-4, 1e-5, 5e-6)),
                     benchmarks=("arc_challenge",), seeds=(42, 43, 44), columns=("accuracy", "choice_nll"),
                     about="tab:tes_hyperparameter_sensitivity, error-head learning-rate panel (Granite)"),
    "tes-gamma": Preset(("TES-IS",), settings=tuple({"gamma": v} for v in (0.5, 1.0, 2.0)),
                        benchmarks=("arc_challenge",), seeds=(42, 43, 44), columns=("accuracy", "choice_nll"),
                        about="tab:tes_hyperparameter_sensitivity, attenuation panel (Granite)"),
    "study": Preset(
        ("CE", "ACS-ENLL", "ACS-IS", ("ACS-IS", None, ALL_LAYERS), "CE + affinity tuning", "ACS-ENLL + affinity tuning",
         "ACS-IS + affinity tuning", "Dual Affinity", ("Dual Affinity", None, ALL_LAYERS), "TES-ENLL", "TES-IS",
         ("TES-IS", None, ALL_LAYERS)),
        benchmarks=("sciq", "arc_easy"), zero_shot=True,
        # One epoch of 448 examples (all of SciQ's offline train split; ARC-Easy's 2000 cut to
        # match) keeps a run to minutes on a CPU; flags after -- override both.
        train_args=("--epochs", "1", "--max-train-examples", "448"),
        tables=("comparisons", "wall_time"), about="the study on a real model (default: train.py's default model, the 4-expert copy; the "
        "README's results: --models weights/smollm2-split, docs/study.md): "
        "the nine rows, final layer supervised, plus all-layer ACS-IS, TES-IS and their Dual Affinity control, "
        "offline SciQ and ARC-Easy, one epoch, with the zero-shot row and the paired group comparisons"),
    "baselines": Preset(
        ("CE", "CE + affinity tuning", "ACS-IS", "Dual Affinity", "TES-IS", *BASELINE_ROWS),
        about="the field's router-adaptation baselines (DenseMixer, router-only tuning, CE with the family's "
              "load-balancing loss, ESFT with LoRA on the chosen experts) beside the paper's CE, CE + affinity tuning, ACS-IS, Dual Affinity and TES-IS"),
    "acs-diagnostics": Preset(
        ("CE + affinity tuning", "ACS-IS + affinity tuning", "ACS-ENLL + affinity tuning"),
        settings=({"lambda_": 1e-2},), benchmarks=("arc_challenge",), tables=("concentration",), train_eval=True,
        about="tab:acs_concentration_diagnostics (Granite): C-bar, N_eff, r on train and test"),
}

def row_settings(row: str) -> dict:
    """A row's train.py settings: one of the paper's nine (ROWS), else a method's registered name as it is
    (your own, from --method-module: `--rows CE my_method`), at train.py's default objective."""
    return ROWS[row] if row in ROWS else {"method": row}


def guess_recipe(model: str) -> str | None:
    """The family's recipe (family_record.Family.recipe): from a local folder's config.json, else from a hub id or
    folder name holding one of a family's `name_hints` (the longest that matches); None leaves it to train.py, which reads the
    checkpoint's model_type (never a default family's recipe)."""
    config = Path(model) / "config.json"
    if config.is_file():
        try:
            model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
        except (ValueError, AttributeError):  # unreadable: train.py names the problem
            model_type = None
        if model_type in FAMILIES:
            return FAMILIES[model_type].recipe
    name = Path(model).name.lower()
    hits = [(len(h), f.recipe) for f in FAMILIES.values() for h in f.name_hints if h in name]
    return max(hits)[1] if hits else None  # the longest hint: "olmoe-like" over "olmoe"


@dataclass(frozen=True)
class Cell:
    model: str
    data: str
    row: str
    settings: tuple  # sorted (key, value) pairs of the ablation settings
    seed: int
    out_dir: Path
    recipe: str | None = None
    extra: tuple = ()  # further train.py flags, passed through as they are
    train_eval: bool = False  # also RUN/eval/train (evaluate.py --split train)
    zero_shot: bool = False  # also RUN/eval/test-base (train.py --zero-shot: the base model, before training)
    method_module: str | None = None  # where a row's own method is registered (train.py --method-module)

    @property
    def row_flags(self) -> dict:
        """The row's settings and the cell's ablation settings, as train.py's flags set them."""
        module = {"method_module": self.method_module} if self.method_module else {}
        return {**row_settings(self.row), **module, **dict(self.settings)}

    @cached_property
    def flags(self) -> dict:
        """The cell's train.py command line (`train_args`) as train.py's parser reads it (flags_parser): the
        row's settings, the cell's and those passed through after sweep.py's `--`."""
        return vars(flags_parser().parse_args(self.train_args()))

    @property
    def cfg(self) -> dict:
        """The settings of that command line, the passed-through ones too: they name the run as they name
        train.py's (given by name alone, a passed-through lambda or option left the cell's name behind)."""
        return {k: v for k, v in self.flags.items() if v is not None and k not in ("out_dir", "resume")}

    @cached_property
    def method(self) -> Method:
        """The row's method, configured with the cell's settings (config.method_for, as train.py's)."""
        return method_for(settings_of(self.cfg))

    @property
    def run(self) -> Path:
        return self.out_dir / run_name(self.cfg, self.method)

    def train_args(self, resume: bool = False) -> list[str]:
        args = ["--model", self.model, "--data", self.data, "--seed", str(self.seed), "--out-dir", str(self.out_dir)]
        if self.recipe:
            args += ["--recipe", self.recipe]
        for key, value in self.row_flags.items():
            flag = flag_name(key)
            args += [flag] if value is True else [flag, str(value)]
        return args + (["--zero-shot"] if self.zero_shot else []) + list(self.extra) + (["--resume"] if resume else [])

    @property
    def slurm_dir(self) -> Path:
        """OUT/submitit/RUN: its SLURM jobs' logs and the last one's id (`submit_slurm`)."""
        return self.out_dir / "submitit" / self.run.name

    @property
    def test_dir(self) -> Path:
        """The evaluation the report reads (eval_folder.test_evaluation): RUN/eval/test, or
        RUN/eval/test-selected where train.py scored the validation-selected epoch instead."""
        return test_evaluation(self.run)

    def trained(self) -> bool:
        """Trained and tested: every test evaluation train.py makes for it (--test-checkpoint both: two)."""
        if "--no-test-eval" in self.extra:
            return (self.run / "selection.json").is_file()
        config = self.run / "config.json"
        both = config.is_file() and json.loads(config.read_text()).get("test_checkpoint") == "both"
        folders = (eval_dir(self.run), eval_dir(self.run, checkpoint="selected")) if both else (self.test_dir,)
        return all((f / METRICS).is_file() for f in folders)

    def record(self) -> dict | None:
        """The run's config.json, None before it exists."""
        config = self.run / "config.json"
        return json.loads(config.read_text()) if config.is_file() else None

    def changed(self, record: dict | None = None) -> list[str]:
        """The settings of the run's config.json (`record`: the run's own by default) that differ from what
        this cell's flags give ([] if none, or no run)."""
        record = self.record() if record is None else record
        return [] if record is None else settings_differ(dict(self.flags), record)

    def state(self) -> str:
        if self.trained() and (not self.train_eval or (eval_dir(self.run, "train") / METRICS).is_file()):
            return "done"
        return "partial" if (self.run / "config.json").is_file() else "missing"


def grid(models, benchmarks, rows, seeds, out_dir, *, settings=({},), recipes=None, extra=(),
         train_eval=False, zero_shot=False, method_module: str | None = None) -> list[Cell]:
    """Every (model, benchmark, row, settings, seed); a (row, recipe) pair keeps only that backbone's models.
    zero_shot: the first seed's plain CE run per (model, benchmark) also scores the base model (it is
    deterministic, so one seed is enough). method_module: registers the rows that name a method of your own."""
    recipes = recipes or {}
    cells = []
    for model in models:
        recipe = recipes.get(model) or guess_recipe(model)
        for data in benchmarks:
            for row in rows:
                row, only, fixed = (row, None, {}) if isinstance(row, str) else (*row, {})[:3]
                check_row(row)
                if only and recipe and only != recipe:
                    continue
                for variant in settings:
                    for seed in seeds:
                        chosen = tuple(sorted({**fixed, **variant}.items()))
                        base = zero_shot and row == "CE" and not chosen and seed == seeds[0]
                        module = method_module if row not in ROWS else None
                        cells.append(Cell(model, data, row, chosen, seed, Path(out_dir), recipes.get(model),
                                          tuple(extra), train_eval, base, module))
    unique = list({c.run: c for c in cells}.values())  # settings a row does not read give one run, once
    return unique


def settings_differ(settings: dict, record: dict) -> list[str]:
    """The settings that decide a run (config.differing) on which a cell's (`settings`: its train.py flags,
    parsed) and a run's config.json (`record`, as any version wrote it) differ, each built into a
    TrainConfig by config.build_config as train.py builds it, but without loading the model: the recipe
    is the cell's, else the run's; what loading a registered benchmark resolves is resolved alike
    (config.loaded_settings); the model's pad id is not compared, nor LoRA's targets where the cell leaves
    them to the model's family, nor device and dtype where the cell leaves them to the machine (auto)."""
    recipe = settings.get("recipe") or record.get("recipe")
    if recipe not in RECIPES:
        return ["recipe"]
    want = build_config(settings, recipe)
    ignore = ["pad_token_id", *(k for k in ("device", "dtype") if getattr(want, k) == "auto"),
              *(["lora_targets"] if want.lora_targets is None else [])]
    if data_kind(want.data, custom=want.field_map is not None or want.prompt_template is not None) == "rows":
        ignore += ["data", "field_map", "prompt_template", "data_revision"]  # resolved by building its manifests
    elif not Path(want.data).is_dir():
        want = replace(want, **loaded_settings(want))
    have = build_config(settings_of(record), record.get("recipe") or recipe)
    return differing(have, want, ignore)
