"""Run a grid of train.py runs (the paper's tables are presets), resumably, and write its report.

    python sweep.py --preset main --models ibm-granite/granite-3.1-3b-a800m-base allenai/OLMoE-1B-7B-0924-SFT \\
        --out-dir runs/main -- --data-source hub            # 2 x 9 x 4 x 3 = 216 runs, then runs/main/report.md
    python sweep.py --preset main --models ... --dry-run  # the cells and their state (done, partial, missing;
                                                          # refused: what train.py's own checks refuse, and why)
    python sweep.py --preset main --models ... --gpus     # one run per visible GPU
    python sweep.py --preset main --models ... --slurm --slurm-partition gpu   # one SLURM job per run
    python sweep.py --preset main --models ... --slurm --slurm-gpus 4 --slurm-param account=proj --slurm-param qos=high
    python sweep.py --preset main --models ... --report-only
    python sweep.py --preset study --out-dir runs/study  # the default model: 12 rows x sciq, arc_easy x 3 seeds
    python sweep.py --preset study --models weights/smollm2-split --results results --out-dir runs/from-results
                                                         # the report from results/ alone (minimoe/study/results.py)

    python sweep.py --models tiny --benchmarks arc_challenge --rows CE biased --method-module examples/my_method.py \\
        --seeds 42 --out-dir runs/mine   # a grid of your own: no --preset; your registered method is a row

Flags after `--` go to every train.py run unchanged (e.g. `-- --max-train-examples 16 --epochs 1`);
those that say which run a cell is (--method, --objective, --tune-router, --layers, --method-module,
--model, --data, --seed, --out-dir, --run-name) are refused: the grid flags set them.
Finished runs are skipped, killed ones continued with --resume; see minimoe/study/grid.py. A run whose
settings differ from its cell's (other flags after `--`, say) is refused, with the settings named,
unless --rerun: then it is moved aside (<run>.replaced-<UTC time>) and run again. The sweep exits 1
when a run failed, and 2 on bad flags.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from minimoe.cli import run_command, train
from minimoe.evaluation.diagnostics import PAPER_SEEDS
from minimoe.runs.config import check_value, default_of, flag_name
from minimoe.runs.naming import ABLATION_SETTINGS
from minimoe.runs.user_methods import import_method_module
from minimoe.runs.run_folder import set_aside
from minimoe.study.grid import BENCHMARKS, PRESETS, ROWS, Preset, check_row, grid
from minimoe.study.launch import run_local, run_on_devices, submit_slurm, visible_devices
from minimoe.study.report import claim_out_dir, write_report

# --set's keys: the ablation settings that take a value, by their train.py flag (--set lambda=... sets lambda_).
SETTING_FLAGS = {flag_name(key)[2:]: key for key in ABLATION_SETTINGS if not isinstance(default_of(key), bool)}


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="sweep.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("the grid")
    g.add_argument("--preset", choices=sorted(PRESETS),
                   help="the grid to run (left out: a grid of your own from --rows and --benchmarks, at seeds "
                        f"{' '.join(map(str, PAPER_SEEDS))} unless --seeds; with neither, the presets are listed); "
                        + "; ".join(f"{k}: {v.about}" for k, v in PRESETS.items()))
    g.add_argument("--models", nargs="+", metavar="MODEL[=RECIPE]",
                   help="hub ids, checkpoint folders, 'tiny' or 'tiny:<model_type>' (as train.py's --model); =RECIPE names the recipe "
                        "when the name does not say granite/olmoe (default: weights/smollm2-135m-moe, train.py's "
                        "default model, built on first use)")
    g.add_argument("--benchmarks", nargs="+", help=f"default: the preset's ({' '.join(BENCHMARKS)} for main)")
    g.add_argument("--rows", nargs="+", metavar="ROW", help=f"default: the preset's; any of {list(ROWS)}, or the "
                   "name of a method that --method-module registers")
    g.add_argument("--method-module", metavar="FILE|MODULE", help="a .py file or module registering methods (as "
                   "train.py's): its methods may be rows, e.g. --rows CE biased (examples/my_method.py's)")
    g.add_argument("--seeds", type=int, nargs="+", help="default: the preset's (42 43 45; 42 43 44 for TES tables)")
    g.add_argument("--set", action="append", default=[], metavar="KEY=V1,V2",
                   help=f"replace the preset's settings variants by these values; KEY in {list(SETTING_FLAGS)} "
                        "(e.g. --set lambda=1e-3,1e-2)")
    g.add_argument("--out-dir", default="runs/sweep", help="parent of the run folders and of report.md/report.csv "
                   "(default: %(default)s)")
    g = p.add_argument_group("where it runs (default: one run after another here)")
    w = g.add_mutually_exclusive_group()
    w.add_argument("--gpus", nargs="*", metavar="ID", help="one run per GPU at a time; no IDs = every visible GPU")
    w.add_argument("--slurm", action="store_true", help="one SLURM job per run through submitit")
    g.add_argument("--slurm-partition", help="SLURM partition")
    g.add_argument("--slurm-timeout-min", type=int, default=24 * 60, help="per-job time limit (default 1440)")
    g.add_argument("--slurm-gpus", type=int, default=1, help="GPUs per job; above 1 the run is data-parallel, "
                   "train.py under torchrun --nproc-per-node N (default 1)")
    g.add_argument("--slurm-param", action="append", default=[], metavar="KEY=VALUE",
                   help="a further sbatch setting, repeatable: account, qos, mem, constraint, or any other of "
                        "submitit's slurm_* parameters (e.g. --slurm-param account=proj --slurm-param mem=64G)")
    g = p.add_argument_group("what to do")
    g.add_argument("--dry-run", action="store_true", help="print the cells and their state; run nothing")
    g.add_argument("--report-only", action="store_true", help="write the report from what has finished")
    g.add_argument("--results", metavar="RESULTS", help="write the report from a results folder alone "
                   "(minimoe/study/results.py: its records are restored into --out-dir as run folders of evidence); "
                   "nothing runs; --models defaults to the models the records name")
    g.add_argument("--rerun", action="store_true", help="runs whose settings differ from their cell's (refused "
                   "otherwise) are moved aside to <run>.replaced-<UTC time> and run again")
    args = p.parse_args(argv)
    args.extra = extra
    return args, p


def slurm_params(specs, parser) -> dict:
    """--slurm-param account=proj mem=64G -> {"slurm_account": "proj", "slurm_mem": "64G"}; submitit's own
    SLURM executor says which names exist."""
    try:
        from submitit.slurm.slurm import SlurmExecutor
    except ImportError:
        parser.error('--slurm needs submitit: pip install -e ".[slurm]"')
    params = {}
    for spec in specs:
        key, eq, value = spec.partition("=")
        if not eq or not value or key not in SlurmExecutor._valid_parameters():
            parser.error(f"--slurm-param {spec!r}: expected KEY=VALUE with KEY one of submitit's SLURM parameters "
                         f"(account, qos, mem, constraint, ...: {sorted(SlurmExecutor._valid_parameters())})")
        params[f"slurm_{key}"] = int(value) if value.isdigit() else value
    return params


def settings_variants(specs, parser) -> tuple:
    """--set KEY=V1,V2 ... -> every combination; each value checked as train.py's flag checks it, up front."""
    variants = [{}]
    for spec in specs:
        key, _, values = spec.partition("=")
        if key not in SETTING_FLAGS or not values:
            parser.error(f"--set {spec!r}: expected KEY=V1,V2 with KEY in {list(SETTING_FLAGS)}")
        for x in values.split(","):
            try:
                check_value(SETTING_FLAGS[key], x)
            except ValueError as e:
                parser.error(f"--set {key}={x}: {e}")
        cast = type(default_of(SETTING_FLAGS[key]))  # float, or str for layers and transform
        variants = [{**v, SETTING_FLAGS[key]: cast(x)} for v in variants for x in values.split(",")]
    return tuple(variants)


def choose_preset(args, parser) -> Preset:
    """--preset's grid, or one of your own from the grid flags; a bare `python sweep.py` lists the presets
    and exits 2 (it must not start a 108-run grid, nor look as if it did something)."""
    if args.preset is not None:
        return PRESETS[args.preset]
    if args.rows and args.benchmarks:
        return Preset(tuple(args.rows), benchmarks=tuple(args.benchmarks), about="your own grid")
    if any((args.models, args.rows, args.benchmarks, args.seeds, args.set)):
        parser.error("without --preset a grid of your own needs --rows and --benchmarks (--models and --seeds "
                     "optional); or choose a --preset")
    listed = "\n".join(f"  {name:18s} {preset.about}" for name, preset in PRESETS.items())
    parser.error(f"choose a grid: --preset NAME, or --rows and --benchmarks for your own; the presets:\n{listed}")


def model_specs(specs) -> tuple[list[str], dict]:
    """--models MODEL[=RECIPE] ... -> (models as train.py names their runs, {model: recipe}); 'tiny' (and
    'tiny:<model_type>') is the tiny checkpoint's folder with the tiny recipe, as in train.py, so its runs are found where they are."""
    from minimoe.cli import is_tiny, model_path
    if not specs:
        from minimoe.making.smollm import smollm_checkpoint
        specs = [str(smollm_checkpoint())]
    models, recipes = [], {}
    for spec in specs:
        name, _, recipe = spec.partition("=")
        model = model_path(name)
        models.append(model)
        if recipe or is_tiny(name):
            recipes[model] = recipe or "tiny"
    return models, recipes


# train.py settings that say which run a cell is: set by the grid flags, never after `--`.
CELL_SETTINGS = {"method": "--rows", "method_module": "--method-module", "objective": "--rows",
                 "tune_router": "--rows", "layers": "--set layers=...", "model": "--models",
                 "recipe": "--models M=RECIPE", "data": "--benchmarks", "seed": "--seeds", "out_dir": "--out-dir",
                 "run_name": "the cell", "config": "the cell", "resume": "the sweep", "rerun": "--rerun"}


def refusal(cell) -> str | None:
    """What train.py would refuse of the cell's command line before training (train.check_command: the
    same checks), as its one line; None when it would run."""
    try:
        train.check_command(cell.train_args())
    except SystemExit as e:
        return str(e.code).removeprefix("train.py: error: ")
    except (ValueError, KeyError) as e:
        return str(e)
    except OSError:  # the model's config.json is not here (a hub id not cached offline): left to the run
        return None
    return None


def check_extra(extra, parser) -> None:
    """Flags after `--` that would change a row's method, scope or a cell's identity are refused: the run
    would train as another row than its cell's and the report would call the cell missing."""
    train_parser = train.parser()
    given, _ = train_parser.parse_known_args(extra)
    defaults = vars(train_parser.parse_args([]))
    for dest, where in CELL_SETTINGS.items():
        if getattr(given, dest, None) != defaults.get(dest):
            flag = next(a.option_strings[0] for a in train_parser._actions if a.dest == dest)
            parser.error(f"{flag} after --: it changes which run a cell is; set it with {where} instead")


def main(argv=None):
    args, parser = parse_args(argv)
    preset = choose_preset(args, parser)
    if args.method_module:
        args.method_module = str(Path(args.method_module).resolve()) if args.method_module.endswith(".py") \
            else args.method_module  # as train.py records it, so that the cell's settings match the run's
        import_method_module(args.method_module)
    check_extra(args.extra, parser)
    slurm = slurm_params(args.slurm_param, parser) if args.slurm else {}  # no submitit: refused before any write
    if args.results:  # the report from a results folder: its records stand for the run folders
        from minimoe.study import results
        args.report_only = True
        args.models = args.models or sorted({r["config"]["model"] for r in results.read(args.results)})
    for row in args.rows or ():
        try:
            check_row(row, "--rows")
        except ValueError as e:
            parser.error(str(e))
    models, recipes = model_specs(args.models)
    cells = grid(models, args.benchmarks or preset.benchmarks, args.rows or preset.rows, args.seeds or preset.seeds,
                 args.out_dir, settings=settings_variants(args.set, parser) if args.set else preset.settings,
                 recipes=recipes, extra=(*preset.train_args, *args.extra), train_eval=preset.train_eval,
                 zero_shot=preset.zero_shot, method_module=args.method_module)
    if args.results and not args.dry_run:
        try:
            claim_out_dir(args.out_dir)
        except FileExistsError as e:
            sys.exit(f"sweep.py: error: {e}")
        results.restore(args.results, args.out_dir, runs={c.run.name for c in cells})
    changed = {c: diff for c in cells
               if (diff := results.settings_differ(c, c.record()) if args.results and c.record() else c.changed())}
    if args.dry_run:
        refused = {c: why for c in cells if c.state() != "done" and (why := refusal(c))}
        for c in cells:
            print(f"{'changed' if c in changed else 'refused' if c in refused else c.state():8s} {c.run}"
                  + (f": {refused[c]}" if c in refused else ""))
        states = ["changed" if c in changed else "refused" if c in refused else c.state() for c in cells]
        print(f"{len(cells)} runs: " + ", ".join(f"{states.count(s)} {s}" for s in ("done", "partial", "missing",
                                                                                     "changed", "refused")))
        if refused:
            sys.exit(f"sweep.py: error: train.py would refuse {len(refused)} run(s) (listed above with the reason); "
                     f"change the grid or the flags after --")
        return cells
    if changed and (args.report_only or not args.rerun):
        lines = [f"  {c.run}: {', '.join(diff)}" for c, diff in changed.items()]
        sys.exit(f"sweep.py: error: {len(changed)} run(s) were made with other settings than their cells' (the "
                 f"flags after --, or the code's defaults, changed); refusing to reuse or report them:\n"
                 + "\n".join(lines) + "\nPass --rerun to set them aside and run them again, or use another --out-dir")
    try:
        claim_out_dir(args.out_dir)  # before any run: never a folder of another kind, never a report we did not write
    except FileExistsError as e:
        sys.exit(f"sweep.py: error: {e}")
    for c in changed:
        print(f"sweep: --rerun: {c.run.name} had other settings ({', '.join(changed[c])}); kept in {set_aside(c.run)}")
    todo = [c for c in cells if c.state() != "done"]
    if not args.report_only and todo:
        print(f"sweep: {len(cells) - len(todo)} of {len(cells)} runs done; running {len(todo)}", flush=True)
        if args.slurm:
            params = {"timeout_min": args.slurm_timeout_min, "gpus_per_node": args.slurm_gpus, **slurm}
            if args.slurm_partition:
                params["slurm_partition"] = args.slurm_partition
            jobs = submit_slurm(todo, nproc=args.slurm_gpus, **params)
            print(f"sweep: submitted {len(jobs)} jobs; run the same command with --report-only when they end "
                  "(again without it to resubmit the runs whose jobs failed)")
            return cells
        devices = (args.gpus or visible_devices()) if args.gpus is not None else None
        if devices == []:
            parser.error("--gpus: no GPU is visible (CUDA_VISIBLE_DEVICES is empty and torch sees none)")
        codes = run_on_devices(todo, devices) if devices else run_local(todo)
        failed = [str(run) for run, code in codes.items() if code != 0]
        # A run that ended well but is not its cell's (named otherwise, say) would leave the cell missing unseen.
        failed += [f"{c.run}: train.py exited 0 but this run folder is not done" for c in todo
                   if codes.get(c.run) == 0 and c.state() != "done"]
    else:
        failed = []
    print(write_report(cells, args.out_dir, preset.columns, preset.tables), end="")
    print(f"report: {args.out_dir}/report.md, {args.out_dir}/report.csv")
    if failed:
        sys.exit(f"sweep.py: error: {len(failed)} of {len(todo)} runs failed (their errors are above; run the "
                 f"same command again to continue them):\n  " + "\n  ".join(failed))
    return cells


def command():
    """minimoe-sweep, and python sweep.py: bad input ends in one line naming the file, exit status 2."""
    run_command(main, "sweep.py")


if __name__ == "__main__":
    command()
