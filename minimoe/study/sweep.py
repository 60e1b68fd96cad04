"""The paper's grid as train.py run folders: cells, their state, where they run, and the report.

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

Where cells run (no scheduler of our own):
  local     one after another, train.py as a subprocess with this interpreter
  gpus      one cell per listed device at a time, CUDA_VISIBLE_DEVICES=<device> in each child
  slurm     submitit (pip install -e ".[slurm]"): one job per cell, its logs in out_dir/submitit/<run name>

The report (report.md, report.csv in out_dir) reads whatever has finished and marks the rest; an
evaluation that did not score the whole split the run declares (evaluate.py --max-examples, or an
edited manifest) is not counted, and is listed. Presets with the paper's groups add the paired
comparisons of each method with its control (`group_comparisons`, minimoe/study/compare.py's statistics),
their numbers also in comparisons.json. out_dir carries the "sweep" kind's marker; the report files
are replaced only if the sweep wrote them (atomic.write_owned_file).
"""
from __future__ import annotations

import csv
import io
import json
import os
import queue
import re
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

from minimoe.study import compare

from minimoe.atomic import KINDS, atomic_file, check_owned_file, mark, write_owned_file, written_kind
from minimoe.core.families import FAMILIES
from minimoe.core.methods import ALIASES, METHODS, Method
from minimoe.data.userdata import data_kind
from minimoe.evaluation import diagnostics
from minimoe.evaluation.diagnostics import PAPER_SEEDS, partial_reason
from minimoe.evaluation.folders import METRICS, eval_dir, test_evaluation, tokens_file
from minimoe.runs.compat import settings_of
from minimoe.runs.config import build_config, differing, flag_name, loaded_settings, method_for
from minimoe.runs.flags import flags_parser
from minimoe.runs.naming import ablation_settings, run_name
from minimoe.runs.recipes import RECIPES
from minimoe.runs.folder import read_metrics

TRAIN = ("-m", "minimoe.cli.train")  # train.py as the package runs it: no checkout needed (minimoe/cli/train.py)
BENCHMARKS = ("arc_challenge", "openbookqa", "sciq", "medmcqa")

# The accuracy table's nine rows (tab:downstream_accuracy) as train.py flags, named as the run that they
# configure names its row (Method.row): CE, ACS-ENLL, ..., TES-IS.
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
    "main": Preset(tuple(ROWS), tables=("comparisons",),
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
        tables=("comparisons", "wall_time"), about="the study on a real model (default: train.py's default model): "
        "the nine rows, final layer supervised, plus all-layer ACS-IS, TES-IS and their Dual Affinity control, "
        "offline SciQ and ARC-Easy, one epoch, with the zero-shot row and the paired group comparisons"),
    "acs-diagnostics": Preset(
        ("CE + affinity tuning", "ACS-IS + affinity tuning", "ACS-ENLL + affinity tuning"),
        settings=({"lambda_": 1e-2},), benchmarks=("arc_challenge",), tables=("concentration",), train_eval=True,
        about="tab:acs_concentration_diagnostics (Granite): C-bar, N_eff, r on train and test"),
}

def row_settings(row: str) -> dict:
    """A row's train.py settings: one of the paper's nine (ROWS), else a method's registered name as it is
    (your own, from --method-module: `--rows CE my_method`), at train.py's default objective."""
    return ROWS[row] if row in ROWS else {"method": row}


ZERO_SHOT = "zero-shot (base model)"  # the report row of the base model's scores (train.py --zero-shot)


def guess_recipe(model: str) -> str | None:
    """The family's recipe (families.Family.recipe): from a local folder's config.json, else from a hub id or
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

    @property
    def cfg(self) -> dict:
        return {"model": self.model, "data": self.data, "seed": self.seed, **self.row_flags}

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
        return [] if record is None else settings_differ(vars(flags_parser().parse_args(self.train_args())), record)

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
    (config.loaded_settings); the model's pad id is not compared, nor device and dtype where the cell
    leaves them to the machine (auto)."""
    recipe = settings.get("recipe") or record.get("recipe")
    if recipe not in RECIPES:
        return ["recipe"]
    want, _ = build_config(settings, recipe)
    ignore = ["pad_token_id", *(k for k in ("device", "dtype") if getattr(want, k) == "auto")]
    if data_kind(want.data, custom=want.field_map is not None or want.prompt_template is not None) == "rows":
        ignore += ["data", "field_map", "prompt_template", "data_revision"]  # resolved by building its manifests
    elif not Path(want.data).is_dir():
        want = replace(want, **loaded_settings(want))
    have, _ = build_config(settings_of(record), record.get("recipe") or recipe)
    return differing(have, want, ignore)


REPORT_FILES = ("report.md", "report.csv", "comparisons.json")  # what write_report writes into out_dir


def claim_out_dir(out_dir) -> None:
    """Make out_dir a sweep folder (atomic.MARKER "sweep"), refusing one of another kind, and refuse
    report files there that the sweep did not write; before any cell runs."""
    out_dir = Path(out_dir)
    kind = written_kind(out_dir) if out_dir.is_dir() else None
    if kind not in (None, "sweep"):
        raise FileExistsError(f"--out-dir {out_dir}: holds {KINDS.get(kind, repr(kind))}, not a sweep; choose "
                              f"another --out-dir")
    for name in REPORT_FILES:
        check_owned_file(out_dir / name)
    if kind is None:
        out_dir.mkdir(parents=True, exist_ok=True)
        mark(out_dir, "sweep")


# ---- where cells run ------------------------------------------------------------------------------

def train_command(cell: Cell, nproc: int = 1) -> list[str]:
    """train.py for the cell; with nproc > 1 under torchrun on this node (--standalone: a free port of its own)."""
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    return [*launcher, *TRAIN, *cell.train_args(resume=(cell.run / "config.json").is_file())]


def train_eval_command(cell: Cell) -> list[str]:
    """evaluate.py on the run's train split, cut as the run's training population was."""
    limit = json.loads((cell.run / "config.json").read_text()).get("max_train_examples")
    return [sys.executable, "-m", "minimoe.cli.evaluate", "--adapter", str(cell.run), "--split", "train",
            "--eval-dir", str(eval_dir(cell.run, "train")), *(["--max-examples", str(limit)] if limit else [])]


def run_cell(cell: Cell, env: dict | None = None, nproc: int = 1) -> int:
    """train.py for one cell (continued with --resume when its folder exists; nproc > 1: data-parallel
    under torchrun), then the train-split evaluation when the cell needs it; returns the first non-zero
    exit code, else 0."""
    code = 0 if cell.trained() else subprocess.run(train_command(cell, nproc), env=env).returncode
    if code == 0 and cell.train_eval and not (eval_dir(cell.run, "train") / METRICS).is_file():
        code = subprocess.run(train_eval_command(cell), env=env).returncode
    return code


def run_local(cells, launch=run_cell) -> dict:
    return {c.run: launch(c) for c in cells}


def run_on_devices(cells, devices, launch=run_cell) -> dict:
    """One cell per device at a time; each child sees only its device (CUDA_VISIBLE_DEVICES)."""
    free = queue.Queue()
    for d in devices:
        free.put(str(d))

    def one(cell):
        device = free.get()
        try:
            return launch(cell, {**os.environ, "CUDA_VISIBLE_DEVICES": device})
        finally:
            free.put(device)

    with ThreadPoolExecutor(max_workers=len(devices)) as pool:
        return dict(zip([c.run for c in cells], pool.map(one, cells)))


def visible_devices() -> list[str]:
    """CUDA_VISIBLE_DEVICES if set, else every device torch sees."""
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        return os.environ["CUDA_VISIBLE_DEVICES"].split(",")
    import torch
    return [str(i) for i in range(torch.cuda.device_count())]


# SLURM states of a job that has yet to run or is running: its cell is not submitted again.
SLURM_ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED"}


def queued_job(cell, cluster: str) -> str | None:
    """The id of this cell's last SLURM job if SLURM still holds it (sacct, through submitit), so that
    running the same --slurm command twice does not queue every unfinished run twice."""
    record = cell.slurm_dir / "job_id"
    if cluster != "slurm" or not record.is_file():
        return None
    from submitit.slurm.slurm import SlurmJob
    job_id = record.read_text().strip()
    return job_id if SlurmJob(record.parent, job_id).state in SLURM_ACTIVE else None


def submit_slurm(cells, *, cluster: str | None = None, wait: bool = False, nproc: int = 1, **slurm_params) -> list:
    """One submitit job per cell, named after its run folder, unless SLURM still holds the cell's
    last job (`queued_job`); cluster="local"/"debug" runs them here (tests). nproc > 1: the job's one
    task runs train.py under torchrun with that many processes (one per GPU of the node).

    Why torchrun in one task rather than submitit's tasks_per_node: train.py's DDP is written and
    tested for torchrun's environment, a job stays one task whose exit code, logs and resume are the
    cell's (as with one GPU), and the train-split evaluation after training runs once, not per rank."""
    try:
        import submitit
    except ImportError:
        raise SystemExit('sweep.py: error: --slurm needs submitit: pip install -e ".[slurm]"') from None
    jobs = []
    for cell in cells:
        executor = submitit.AutoExecutor(folder=cell.slurm_dir, cluster=cluster)
        if held := queued_job(cell, executor.cluster):
            print(f"sweep: {cell.run.name} is queued or running as SLURM job {held}; not submitted again")
            continue
        executor.update_parameters(name=cell.run.name, **slurm_params)
        jobs.append(executor.submit(run_cell, cell, None, nproc))
        with atomic_file(cell.slurm_dir / "job_id") as tmp:
            tmp.write_text(str(jobs[-1].job_id))
    if wait:
        for job in jobs:
            job.result()
    return jobs


# ---- the report -----------------------------------------------------------------------------------

def _partial(path: Path, cell: Cell) -> str | None:
    """Why an evaluation of the cell's run does not count (`diagnostics.partial_reason`), None if it does."""
    return partial_reason(json.loads(path.read_text()), cell.record())


def _metrics(cell: Cell) -> dict | None:
    """The cell's test metrics, None when missing or partial (not the whole split the run declares)."""
    path = cell.test_dir / METRICS
    return json.loads(path.read_text()) if path.is_file() and not _partial(path, cell) else None


def _state(cell: Cell) -> str:
    """The report's state: the cell's, with a partial test evaluation called so."""
    path = cell.test_dir / METRICS
    why = _partial(path, cell) if path.is_file() else None
    return f"partial evaluation ({why})" if why else cell.state()


def _row_key(cell: Cell) -> str:
    return diagnostics.row_label({"method": cell.method.row, "settings": ablation_settings(cell.cfg, cell.method)})


def report(cells, columns=("accuracy",)) -> tuple[str, list[dict]]:
    """Markdown table (mean ± sample std over the seeds that finished, n=k/N when some are missing,
    Δ from the lambda_m = 1e-3 cell for lambda-changed rows) and the per-cell CSV rows."""
    groups: dict[tuple, list[Cell]] = {}
    for c in cells:
        groups.setdefault((Path(c.model).name, _row_key(c), c.data), []).append(c)
    csv_rows, summary = [], {}
    for (model, row, data), members in groups.items():
        found = [(c, m) for c in members if (m := _metrics(c)) is not None]
        for c in members:
            m = dict(found).get(c)
            csv_rows.append({"model": model, "row": row, "dataset": data, "seed": c.seed, "run": c.run.name,
                             "state": _state(c), **{k: (m or {}).get(k) for k in columns}})
        summary[(model, row, data)] = {k: [m[k] for _, m in found] for k in columns} | {"n": len(found),
                                                                                        "of": len(members)}
    for c in cells:  # the zero-shot row: the base model's scores, where a run made them (--zero-shot);
        base, key = eval_dir(c.run, checkpoint="base") / METRICS, (Path(c.model).name, ZERO_SHOT, c.data)
        if base.is_file() and key not in summary and not _partial(base, c):  # deterministic: one run's copy serves
            m = json.loads(base.read_text())
            summary[key] = {k: [m[k]] for k in columns} | {"n": 1, "of": 1}
    datasets = list(dict.fromkeys(c.data for c in cells))
    rows = sorted(dict.fromkeys((m, r) for m, r, _ in summary), key=lambda mr: mr[1] != ZERO_SHOT)  # stable
    head = [f"{Path(d).name} {'acc' if k == 'accuracy' else 'NLL'}" if len(columns) > 1 else Path(d).name
            for d in datasets for k in columns]
    lines = ["| Model | Method | " + " | ".join(head) + " |", "|---|---|" + "---|" * len(head)]
    for model, row in rows:
        out = [model, row]
        base = _lambda_baseline(row)
        for d in datasets:
            s = summary.get((model, row, d))
            for k in columns:
                if s is None:
                    out.append("")
                elif not s[k]:
                    out.append(f"missing (0/{s['of']})")
                else:
                    scale, digits = (100.0, 2) if k == "accuracy" else (1.0, 4)
                    text = diagnostics.mean_sd([scale * v for v in s[k]], digits)
                    ref = summary.get((model, base, d)) if base else None
                    if k == "accuracy" and ref and ref[k]:
                        delta = scale * (statistics.fmean(s[k]) - statistics.fmean(ref[k]))
                        text += f" [{delta:+.2f}]"
                    if s["n"] < s["of"]:
                        text += f" (n={s['n']}/{s['of']})"
                    out.append(text)
        lines.append("| " + " | ".join(x.replace("|", "\\|") for x in out) + " |")
    return "\n".join(lines) + "\n", csv_rows


def train_seconds(run: Path) -> float | None:
    """A run's training wall time from its metrics.jsonl: its steps and validations (None: not recorded)."""
    try:
        records = read_metrics(run)
    except FileNotFoundError:
        return None
    times = [r.get("seconds" if r["kind"] == "step" else "val_seconds") for r in records]
    return None if not times or None in times else sum(times)


def wall_time_table(cells) -> str:
    """Training wall time per run (steps + validation; loading and test scoring not counted), mean ± sd over seeds."""
    lines = ["| Model | Method | Dataset | Minutes per run | Runs |", "|---|---|---|---|---|"]
    total = []
    for (model, row, data), members in _finished_groups(cells).items():
        minutes = [t / 60 for c in members if (t := train_seconds(c.run)) is not None]
        total += minutes
        if minutes:
            lines.append(f"| {model} | {row} | {Path(data).name} | {diagnostics.mean_sd(minutes, 1)} | {len(minutes)} |")
    return "\n".join(lines) + f"\n\nAll runs: {sum(total) / 60:.2f} h of training over {len(total)} runs.\n"


def _lambda_baseline(row: str) -> str | None:
    """The row with lambda_m at its default for a lambda-changed row: the paper's Δ reference."""
    if "[" not in row:
        return None
    label, settings = row[:-1].split(" [", 1)
    kept = [s for s in settings.split(", ") if not s.startswith("lambda=")]
    if len(kept) == len(settings.split(", ")):
        return None
    return label + (" [" + ", ".join(kept) + "]" if kept else "")


def _finished_groups(cells) -> dict:
    """(model, row, dataset) -> the finished cells, in seed order."""
    groups: dict[tuple, list[Cell]] = {}
    for c in cells:
        if c.trained() and _metrics(c) is not None:
            groups.setdefault((Path(c.model).name, _row_key(c), c.data), []).append(c)
    return groups


def transform_table(cells) -> str:
    """tab:error_routing_transform_ablation: pointwise r, test NLL and accuracy are means over seeds;
    group r and rho are over the layer--token groups averaged across seeds (test split)."""
    lines = ["| Model | Method | Dataset | Pointwise r | Group r | Group ρ | Test NLL | Accuracy (%) | Seeds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (model, row, data), members in _finished_groups(cells).items():
        files = [c.test_dir / tokens_file("test") for c in members]
        errors = [diagnostics.token_file_errors(f) for f in files]
        if any(e is None for e in errors):
            continue  # not an error-head run
        pointwise = statistics.fmean(diagnostics.pearson(e[2], e[3]) for e in errors)
        groups = diagnostics.group_correlations(diagnostics.average_groups_across_seeds(
            [diagnostics.group_by_layer_token(*e) for e in errors]))
        metrics = [_metrics(c) for c in members]
        nll = statistics.fmean(m["choice_nll"] for m in metrics)
        acc = statistics.fmean(100.0 * m["accuracy"] for m in metrics)
        lines.append(f"| {model} | {row} | {Path(data).name} | {pointwise:.4f} | {groups['group_r']:.4f} | "
                     f"{groups['group_rho']:.4f} | {nll:.4f} | {acc:.2f} | {len(members)} |")
    return "\n".join(lines) + "\n"


def _train_tokens(cell: Cell) -> Path | None:
    """The train population's token arrays: scored beside test (tes) or by evaluate.py --split train."""
    for path in (cell.test_dir / tokens_file("train"), eval_dir(cell.run, "train") / tokens_file("train")):
        if path.is_file():
            return path
    return None


def concentration_table(cells) -> str:
    """tab:acs_concentration_diagnostics: final diagnosed layer, C-bar, N_eff and r, mean ± sd over seeds."""
    lines = ["| Model | Method | Dataset | Split | C̄ | N_eff | r | Seeds |", "|---|---|---|---|---|---|---|---|"]
    for (model, row, data), members in _finished_groups(cells).items():
        for split in ("train", "test"):
            files = [_train_tokens(c) if split == "train" else c.test_dir / tokens_file("test")
                     for c in members]
            files = [f for f in files if f is not None]
            if not files:
                lines.append(f"| {model} | {row} | {Path(data).name} | {split} | missing | | | 0 |")
                continue
            stats = [diagnostics.final_layer_concentration(f) for f in files]
            lines.append(f"| {model} | {row} | {Path(data).name} | {split} | "
                         + " | ".join(diagnostics.mean_sd([s[k] for s in stats], d)
                                      for k, d in (("C_bar", 4), ("N_eff", 2), ("r", 3)))
                         + f" | {len(files)} |")
    return "\n".join(lines) + "\n"


# The paper's parameter-matched groups (tab:downstream_accuracy): each method row and its control.
CONTROLS = {"ACS-ENLL": "CE", "ACS-IS": "CE",
            "ACS-ENLL + affinity tuning": "CE + affinity tuning", "ACS-IS + affinity tuning": "CE + affinity tuning",
            "TES-ENLL": "Dual Affinity", "TES-IS": "Dual Affinity"}


COMPARISONS_TITLE = "Paired comparisons within parameter-matched groups"
COMPARISONS_ABOUT = (f"Method minus control, paired by question and seed (evaluate.py compare, minimoe/study/compare.py): "
                     f"accuracy in points with a {100 * compare.LEVEL:g}% paired bootstrap interval over questions "
                     f"and seeds ({compare.BOOTSTRAP_RESAMPLES} resamples, seed {compare.BOOTSTRAP_SEED}); the exact "
                     f"McNemar p of each seed; the mean answer-choice NLL difference; the questions whose predicted "
                     f"answer differs from the control's.")


def control_of(cell: Cell, by_run: dict) -> Cell | None:
    """The cell's control in the grid: its group's control row with the same settings (the run it
    names; a setting the control does not read, lambda say, names the plain control run), else the
    control row at its default settings (CE for all-layer ACS: CE has no router head to place)."""
    if cell.row not in CONTROLS:
        return None
    for settings in (cell.settings, ()):
        control = by_run.get(replace(cell, row=CONTROLS[cell.row], settings=settings, zero_shot=False).run)
        if control is not None:
            return control
    return None


def group_comparisons(cells) -> list[dict]:
    """Each method row against its control (`control_of`), per model and benchmark, paired by seed over
    the seeds where both finished -> one record per (model, benchmark, method): its control, the seed
    pairs done ("pairs" of "of"), and compare.compare_pairs' "result" (accuracy difference with its
    paired bootstrap interval, McNemar p per seed, choice-NLL difference, differing predictions), or
    the "error" that kept them from being compared (evaluations of other questions, say)."""
    by_run = {c.run: c for c in cells}
    groups: dict[tuple, list] = {}  # (model, data, control row key, method row key) -> [(control, method) cells]
    for cell in cells:
        control = control_of(cell, by_run)
        if control is not None:
            key = (Path(cell.model).name, Path(cell.data).name, _row_key(control), _row_key(cell))
            groups.setdefault(key, []).append((control, cell))
    records = []
    for (model, data, control_row, row), pairs in groups.items():
        done = [(a, b) for a, b in pairs if _metrics(a) is not None and _metrics(b) is not None]  # whole splits
        record = {"model": model, "dataset": data, "control": control_row, "method": row,
                  "pairs": len(done), "of": len(pairs)}
        if done:
            try:
                record["result"] = compare.compare_pairs([(compare.read_predictions(a.test_dir),
                                                           compare.read_predictions(b.test_dir)) for a, b in done])
            except (OSError, ValueError) as e:
                record["error"] = str(e)
        records.append(record)
    return records


def comparison_table(records) -> str:
    """Markdown of `group_comparisons`: one line per method, then the pairs that could not be compared."""
    lines = ["| Model | Dataset | Control | Method | Seeds | Accuracy diff. (points) [95% CI] | McNemar p per seed "
             "| Choice NLL diff. [95% CI] | Predictions differing per seed |", "|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for r in records:
        head = f"| {r['model']} | {r['dataset']} | {r['control']} | {r['method']} | "
        if "error" in r:
            lines.append(head + "not compared (below) | | | | |")
            notes.append(f"- {r['method']} vs {r['control']}, {r['dataset']}: {r['error']}")
            continue
        if "result" not in r:
            lines.append(head + f"missing (0/{r['of']}) | | | | |")
            continue
        result, per_seed = r["result"], r["result"]["per_seed"]
        seeds = ", ".join(str(s["seed"]) for s in per_seed) + (f" (n={r['pairs']}/{r['of']})" if r["pairs"] < r["of"] else "")
        lines.append(head + f"{seeds} | {compare.interval_text(result['accuracy_difference'], result['accuracy_interval'], 2)} | "
                     + ", ".join(compare.p_text(s["mcnemar"]["p"]) for s in per_seed) + " | "
                     + compare.interval_text(result["choice_nll_difference"], result["choice_nll_interval"], 4) + " | "
                     + ", ".join(str(s["differing_predictions"]) for s in per_seed) + f" of {result['questions']} |")
    return "\n".join(lines) + "\n" + ("\n" + "\n".join(notes) + "\n" if notes else "")


def error_figures(cells, folder) -> list[str]:
    """fig:arc_error_prediction per (model, error-head row, dataset), groups averaged across seeds."""
    notes = []
    for (model, row, data), members in _finished_groups(cells).items():
        train = [_train_tokens(c) for c in members]
        test = [c.test_dir / tokens_file("test") for c in members]
        if any(f is None for f in train) or any(diagnostics.token_file_errors(f) is None for f in test):
            continue
        slug = re.sub(r"[^A-Za-z0-9.+=-]+", "_", "-".join([model, Path(data).name, row])).strip("_")
        path = Path(folder) / f"error-prediction-{slug}.png"
        try:
            stats = diagnostics.seed_error_figure(train, test, path, title=f"{row}, {Path(data).name}: train vs test")
        except ValueError as e:  # too few groups, or constant train predictions
            notes.append(f"no figure for {row}, {data}: {e}")
            continue
        notes.append(f"{path.name}: test group r {stats['test']['group_r']:.4f}, ρ {stats['test']['group_rho']:.4f} "
                     f"over {stats['test']['groups']} groups, {len(members)} seeds")
    return notes


def write_report(cells, out_dir, columns=("accuracy",), tables=()) -> str:
    claim_out_dir(out_dir)  # before any file: never a report file the sweep did not write
    table, rows = report(cells, columns)
    extras = {"transform": ("Error-to-routing transform ablation", transform_table),
              "concentration": ("Affinity-concentration diagnostics", concentration_table),
              "wall_time": ("Wall time", wall_time_table)}
    for name in tables:
        if name == "comparisons":  # the table, and every number of it in comparisons.json
            comparisons = group_comparisons(cells)
            table += f"\n## {COMPARISONS_TITLE}\n\n{COMPARISONS_ABOUT}\n\n" + comparison_table(comparisons)
            write_owned_file(Path(out_dir) / "comparisons.json", json.dumps(comparisons, indent=2) + "\n")
            continue
        title, make = extras[name]
        table += f"\n## {title}\n\n" + make(cells)
    figures = error_figures(cells, Path(out_dir) / "figures")
    if figures:
        table += "\n## Error-prediction figures (figures/)\n\n" + "".join(f"- {n}\n" for n in figures)
    missing = sum(r["state"] != "done" for r in rows)
    text = table + (f"\n{missing} of {len(rows)} runs not finished; their cells use the seeds that did.\n"
                    if missing else "")
    partial = [f"- {r['run']}: {r['state']}" for r in rows if r["state"].startswith("partial evaluation")]
    if partial:
        text += "\nNot counted (evaluate them on the whole split to count them):\n" + "\n".join(partial) + "\n"
    out_dir = Path(out_dir)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]) if rows else ["run"])
    writer.writeheader()
    writer.writerows(rows)
    write_owned_file(out_dir / "report.md", text)
    write_owned_file(out_dir / "report.csv", buffer.getvalue())
    return text
