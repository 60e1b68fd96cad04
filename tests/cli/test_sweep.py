"""sweep.py on the tiny checkpoint: a 2x2 grid through train.py subprocesses, a killed cell that
resumes, the report with a missing cell, GPU scheduling on a fake device list, and the submitit path
on its local executor. Run names and report keys are checked against the settings that were set."""
import csv
import json
import re
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from scipy.stats import binomtest

from minimoe.cli import evaluate, sweep
from minimoe.evaluation.diagnostics import accuracy_table
from minimoe.making.tiny import tiny_checkpoint
from minimoe.study import grid as grid_module
from minimoe.study.grid import ALL_LAYERS, BASELINE_ROWS, PRESETS, ROWS, grid
from minimoe.study.launch import queued_job, run_cell, run_on_devices, submit_slurm
from minimoe.study.report import (COMPARISONS_TITLE, ZERO_SHOT, comparison_table, concentration_table, error_figures,
                                  group_comparisons, train_seconds, transform_table, write_report)

REPO = Path(__file__).resolve().parents[2]
SMOKE = ["--batch-size", "8", "--epochs", "2", "--quiet"]  # 8 examples: one step per epoch


def sweep_args(tmp_path, data, *flags):
    return ["--preset", "main", "--models", str(tiny_checkpoint()), "--benchmarks", str(data), "--rows", "TES-IS",
            "--set", "gamma=1,2", "--seeds", "42", "43", "--out-dir", str(tmp_path), *flags, "--", *SMOKE]


def test_slurm_does_not_submit_again_a_cell_whose_job_slurm_still_holds(tmp_path, data, monkeypatch, capsys):
    """A second --slurm sweep: the cell whose last job is PENDING is skipped, the one whose job FAILED
    is submitted again and its new job id recorded. sacct is faked: submitit's SlurmJob gives the state."""
    submitit = pytest.importorskip("submitit")
    import submitit.slurm.slurm
    cells = sweep.main(sweep_args(tmp_path, data, "--dry-run"))[:2]
    states = {"11": "PENDING", "12": "FAILED"}
    for cell, job_id in zip(cells, states):
        (tmp_path / "submitit" / cell.run.name).mkdir(parents=True)
        (tmp_path / "submitit" / cell.run.name / "job_id").write_text(job_id)
    monkeypatch.setattr(submitit.slurm.slurm, "SlurmJob", lambda folder, job_id: SimpleNamespace(state=states[job_id]))
    assert queued_job(cells[0], "slurm") == "11" and queued_job(cells[1], "slurm") is None
    assert queued_job(cells[0], "local") is None  # no queue to ask outside SLURM

    submitted = []

    class Executor:  # submitit.AutoExecutor on a SLURM cluster, without the cluster
        cluster = "slurm"

        def __init__(self, folder, cluster=None):
            pass

        def update_parameters(self, **params):
            pass

        def submit(self, fn, cell, *args):  # run_cell's further arguments: env, nproc
            submitted.append(cell)
            return SimpleNamespace(job_id="13")
    monkeypatch.setattr(submitit, "AutoExecutor", Executor)
    assert len(submit_slurm(cells)) == 1 and submitted == [cells[1]]
    assert f"{cells[0].run.name} is queued or running as SLURM job 11" in capsys.readouterr().out
    assert (tmp_path / "submitit" / cells[1].run.name / "job_id").read_text() == "13"


def test_grid_runs_resumes_a_killed_cell_and_reports(tmp_path, data, capsys):
    """2 settings (gamma 1 = the default, gamma 2) x 2 seeds. One cell is killed after epoch 1 of 2,
    one runs as a two-process job of submitit's local executor (the SLURM path with --slurm-gpus 2); the report marks the two that
    have not run. The sweep then continues the killed cell with --resume, starts the missing ones,
    skips the finished one, and a second sweep runs nothing."""
    pytest.importorskip("submitit")
    cells = sweep.main(sweep_args(tmp_path, data, "--dry-run"))
    assert [c.state() for c in cells] == ["missing"] * 4
    killed, job = cells[1], cells[3]
    subprocess.run([sys.executable, "-m", "tests.kill", "--after-epochs", "1", *killed.train_args()], cwd=REPO)
    assert killed.state() == "partial"
    # the job as --slurm-gpus 2 runs it: two data-parallel processes under torchrun (gloo on CPU)
    assert [j.result() for j in submit_slurm([job], cluster="local", wait=True, timeout_min=5, nproc=2)] == [0]
    assert job.state() == "done" and (tmp_path / "submitit" / job.run.name).is_dir()  # the job's identity
    assert json.loads((job.run / "config.json").read_text())["world_size"] == 2
    text = write_report(cells, tmp_path)
    assert "| TES-IS | missing (0/2) |" in text and "(n=1/2)" in text and "3 of 4 runs not finished" in text
    rows = list(csv.DictReader(open(tmp_path / "report.csv")))
    assert [r["state"] for r in rows] == ["missing", "partial", "missing", "done"]

    before = (job.run / "eval" / "test" / "metrics.json").stat().st_mtime_ns
    sweep.main(sweep_args(tmp_path, data))
    assert "1 of 4 runs done; running 3" in capsys.readouterr().out
    assert [c.state() for c in cells] == ["done"] * 4
    assert (job.run / "eval" / "test" / "metrics.json").stat().st_mtime_ns == before  # skipped
    epochs = [json.loads(x)["epoch"] for x in (killed.run / "metrics.jsonl").read_text().splitlines()
              if json.loads(x)["kind"] == "epoch"]
    assert epochs == [1, 2]  # continued with --resume, not started over (train.py refuses an existing folder)
    sweep.main(sweep_args(tmp_path, data))
    assert "running" not in capsys.readouterr().out
    table = (tmp_path / "report.md").read_text()
    # Against the metrics.json files themselves, through the evaluate.py report's independent table.
    for c in cells:  # metrics.json's identity carries the setting off the default, the report keys it
        metrics = json.loads((c.run / "eval" / "test" / "metrics.json").read_text())
        assert metrics["settings"] == ({"gamma": 2.0} if dict(c.settings)["gamma"] == 2.0 else {})
    for cell_row, gamma in (("TES-IS", 1.0), ("TES-IS [gamma=2.0]", 2.0)):
        accs = [json.loads((c.run / "eval" / "test" / "metrics.json").read_text())["accuracy"]
                for c in cells if dict(c.settings)["gamma"] == gamma]
        # The cell as evaluate.py's report computes it from the same numbers (mean ± sample std in %).
        expected = accuracy_table([{"model": "m", "method": "x", "dataset": "d", "seed": s, "accuracy": a}
                                   for s, a in zip((42, 43), accs)], seeds=(42, 43)).splitlines()[-1].split(" | ")[-1]
        assert f"| {cell_row} | {expected.rstrip(' |')} |" in table


def test_grid_sizes_and_report_keys_carry_ablation_settings():
    """The presets' grids have the paper's sizes, and ablation settings part runs and report rows (the
    run names themselves: tests/runs/test_config.py)."""
    # The paper's grid sizes: 2 backbones x 9 rows x 4 benchmarks x 3 seeds; the lambda table's
    # rows are per backbone (Granite: TES and ACS + affinity tuning; OLMoE: frozen ACS), each at two lambdas.
    both = ["ibm-granite/granite-3.1-3b-a800m-base", "allenai/OLMoE-1B-7B-0924-SFT"]
    # The appendix tables: depth-scaled and layer-scope on Granite's affinity-tuned ACS (layer scopes
    # final, first 8, last 8, all; OLMoE's ACS rows there at lambda 1e-2), the tenfold control and the
    # OLMoE lambda screen on ARC only.
    for preset, size in (("main", 216), ("lambda-1e-2", (4 + 2) * 2 * 4 * 3), ("depth-scaled", 2 * 4 * 4 * 3),
                         ("excessive-scaling", 2 * 4 * 3), ("layer-scope", 2 * 3 * 4 * 4 * 3),
                         ("acs-lambda", (2 + 4) * 2 * 4 * 3), ("acs-screen", 2 * 4 * 3)):
        p = PRESETS[preset]
        assert len(grid(both, p.benchmarks, p.rows, p.seeds, "runs", settings=p.settings)) == size
    olmoe_acs = {c.run.name for c in grid(both, ["d"], PRESETS["layer-scope"].rows, (42,), "runs",
                                           settings=PRESETS["layer-scope"].settings) if "OLMoE" in c.model and "ACS" in c.row}
    assert len(olmoe_acs) == 8 and all("lambda0.01" in name for name in olmoe_acs)
    # A setting the method does not read is no part of its name: CE at lambda 1e-2 is the CE run.
    cells = grid(["org/granite-x"], ["d"], ["CE", "ACS-IS"], (42,), "runs", settings=({}, {"lambda_": 1e-2}))
    assert sorted(c.run.name for c in cells) == ["granite-x-d-ACS-IS-lambda0.01-seed42", "granite-x-d-ACS-IS-seed42",
                                                 "granite-x-d-CE-seed42"]
    # Two runs differing only in lambda are two report rows, not a "duplicate run".
    records = [{"model": "m", "method": "ACS-IS", "dataset": "d", "seed": 42, "accuracy": 0.5, "settings": s}
               for s in ({}, {"lambda": 0.01})]
    table = accuracy_table(records, seeds=(42,))
    assert "| ACS-IS |" in table and "| ACS-IS [lambda=0.01] |" in table


def test_lambda_table_writes_the_change_from_the_1e3_cell(tmp_path):
    """Δ = mean(lambda 1e-2) - mean(lambda 1e-3), in points, from hand-written metrics."""
    cells = grid(["org/granite-x"], ["d"], [("TES-IS", "granite"), ("ACS-IS", "olmoe")], (42, 43), tmp_path,
                    settings=({}, {"lambda_": 1e-2}))
    assert {c.row for c in cells} == {"TES-IS"}  # the OLMoE-only row is not run on Granite
    accs = {(False, 42): 0.60, (False, 43): 0.62, (True, 42): 0.65, (True, 43): 0.66}
    for c in cells:
        out = c.run / "eval" / "test"
        out.mkdir(parents=True)
        (c.run / "config.json").write_text("{}")
        (out / "metrics.json").write_text(json.dumps({"accuracy": accs[(bool(c.settings), c.seed)]}))
    table = write_report(cells, tmp_path)
    assert "| granite-x | TES-IS [lambda=0.01] | 65.50 ± 0.71 [+4.50] |" in table
    assert "| granite-x | TES-IS | 61.00 ± 1.41 |" in table


def test_devices_run_one_cell_each_at_a_time():
    """A fake list of two devices: never two cells on one device, both devices used, every cell run once."""
    cells = grid(["org/olmoe-x"], ["d"], ["CE", "TES-IS", "ACS-IS"], (42, 43), "runs")
    busy, seen, lock = set(), [], threading.Lock()

    def launch(cell, env):
        device = env["CUDA_VISIBLE_DEVICES"]
        with lock:
            assert device not in busy
            busy.add(device)
            seen.append((cell.run, device))
        time.sleep(0.05)
        with lock:
            busy.discard(device)
        return 0

    codes = run_on_devices(cells, ["0", "1"], launch=launch)
    assert sorted(codes) == sorted(c.run for c in cells) and set(codes.values()) == {0}
    assert {d for _, d in seen} == {"0", "1"} and len(seen) == len(cells)


def test_train_split_evaluation_feeds_the_concentration_table(tmp_path, data, monkeypatch):
    """A cell that needs train diagnostics (acs-diagnostics) gets evaluate.py --split train on the
    run's training population after training: with --max-train-examples 5 of the 8, exactly the 5
    examples train.py kept (the first 5), not the uncut split. The table's train row is that split's
    C_t. A finished phase is never run again: the cell, trained and tested, runs evaluate.py alone
    (not train.py --resume, which would score test again), and once done, nothing."""
    cell = grid([str(tiny_checkpoint())], [str(data)], ["ACS-IS"], (42,), tmp_path,
                   extra=(*SMOKE, "--max-train-examples", "5"))[0]
    assert run_cell(cell) == 0 and cell.state() == "done"
    finished = {p: p.stat().st_mtime_ns for p in (cell.run / "eval" / "test" / "metrics.json", cell.run / "metrics.jsonl",
                                                  cell.run / "selection.json")}
    commands, real_run = [], subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda command, **kw: commands.append(command) or real_run(command, **kw))
    cell = replace(cell, train_eval=True)
    assert cell.state() == "partial"
    assert run_cell(cell) == 0 and cell.state() == "done"
    assert [c[1:3] for c in commands] == [["-m", "minimoe.cli.evaluate"]]  # evaluate.py's command, alone
    assert run_cell(cell) == 0 and len(commands) == 1
    assert {p: p.stat().st_mtime_ns for p in finished} == finished
    train = json.loads((cell.run / "eval" / "train" / "metrics.json").read_text())
    trained = [json.loads(line)["id"] for line in (data / "train.jsonl").read_text().splitlines()[:5]]
    assert train["split"] == "train" and train["n_examples"] == 5  # the run's training population
    assert [r["id"] for r in map(json.loads, (cell.run / "eval" / "train" / "predictions.jsonl").read_text().splitlines())] == trained
    with np.load(cell.run / "eval" / "train" / "tokens-train.npz") as z:
        assert sorted(set(z["example"].tolist())) == list(range(5))
        c = z[f"concentration_layer{max(int(k[19:]) for k in z.files if k.startswith('concentration_layer'))}"]
    assert f"| train | {c.mean():.4f} | {1 / c.mean():.2f} |" in concentration_table([cell])


def write_tokens(path, seed, *, layers=(3,), groups=12, repeats=None, concentration=None):
    """Synthetic tokens-<split>.npz: e_hat tracks CE per target token, with seed-dependent noise; the
    occurrences per token differ between seeds, so pooling tokens is not averaging seed means."""
    rng = np.random.default_rng(seed)
    target = np.repeat(np.arange(groups), repeats or 2 + seed % 3)
    ce = rng.gamma(2.0, 1.0, target.size)
    arrays = {"token_ce": ce, "target": target, "example": np.arange(target.size)}
    for l in layers:
        arrays[f"e_hat_layer{l}"] = 0.5 * ce + rng.normal(0, 0.3, ce.size) + 0.1 * target
        arrays[f"concentration_layer{l}"] = rng.uniform(0.3, 1.0, ce.size) if concentration is None else concentration
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays)
    return arrays


def fake_cells(tmp_path, seeds, accs, nlls):
    cells = grid(["org/granite-x"], ["arc"], ["TES-IS"], seeds, tmp_path)
    for c, acc, nll in zip(cells, accs, nlls):
        (c.run / "eval" / "test").mkdir(parents=True)
        (c.run / "config.json").write_text("{}")
        (c.run / "eval" / "test" / "metrics.json").write_text(json.dumps({"accuracy": acc, "choice_nll": nll}))
    return cells


def test_transform_table_and_figure_average_groups_across_seeds(tmp_path):
    """Against a direct recount: pointwise r averaged over seeds (np.corrcoef); group r and rho over
    (layer, token) groups whose per-seed means are averaged across seeds (tie-averaged ranks)."""
    cells = fake_cells(tmp_path, (42, 43), (0.6, 0.7), (0.9, 1.0))
    per_seed = []
    for c in cells:
        test = write_tokens(c.run / "eval" / "test" / "tokens-test.npz", c.seed, layers=(2, 3))
        write_tokens(c.run / "eval" / "test" / "tokens-train.npz", c.seed + 100, layers=(2, 3))
        per_seed.append(test)
    pointwise = np.mean([np.corrcoef(np.concatenate([a["e_hat_layer2"], a["e_hat_layer3"]]),
                                     np.tile(a["token_ce"], 2))[0, 1] for a in per_seed])
    sums = {}
    for a in per_seed:
        for l in (2, 3):
            for t in np.unique(a["target"]):
                m = a["target"] == t
                sums.setdefault((l, t), []).append((a[f"e_hat_layer{l}"][m].mean(), a["token_ce"][m].mean()))
    pred, obs = (np.array([np.mean([v[i] for v in vals]) for vals in sums.values()]) for i in (0, 1))
    def rank(x):  # ties (observed CE is the same at both layers) share their mean rank
        xs = np.sort(x)
        return (np.searchsorted(xs, x, "left") + np.searchsorted(xs, x, "right") + 1) / 2
    expected = (f"| {pointwise:.4f} | {np.corrcoef(pred, obs)[0, 1]:.4f} | "
                f"{np.corrcoef(rank(pred), rank(obs))[0, 1]:.4f} | 0.9500 | 65.00 | 2 |")
    assert expected in transform_table(cells)
    notes = error_figures(cells, tmp_path / "figures")
    assert len(notes) == 1 and f"group r {np.corrcoef(pred, obs)[0, 1]:.4f}" in notes[0], notes
    assert (tmp_path / "figures" / "error-prediction-granite-x-arc-TES-IS.png").stat().st_size > 0


def test_concentration_table_is_mean_and_sample_std_over_seeds(tmp_path):
    cells = fake_cells(tmp_path, (42, 43, 45), (0.5,) * 3, (1.0,) * 3)
    c_bars = []
    for i, c in enumerate(cells):
        conc = np.full(36, 0.2 + 0.1 * i)
        conc[0] = 0.9  # not constant, so r is defined
        write_tokens(c.run / "eval" / "test" / "tokens-test.npz", c.seed, repeats=3, concentration=conc)
        c_bars.append(conc.mean())
    table = concentration_table(cells)
    n_eff = [1 / c for c in c_bars]
    assert (f"| test | {np.mean(c_bars):.4f} ± {np.std(c_bars, ddof=1):.4f} | "
            f"{np.mean(n_eff):.2f} ± {np.std(n_eff, ddof=1):.2f} |") in table
    assert "| train | missing |" in table  # no train population was scored


def test_a_run_scored_at_its_selected_epoch_is_done_and_reported(tmp_path):
    """train.py scores the OLMoE affinity-tuned group at the validation-selected epoch (eval/test-selected;
    its config.json says so): the sweep must count that cell done and report that evaluation."""
    [cell] = grid(["org/olmoe-x"], ["d"], ["CE + affinity tuning"], (42,), tmp_path)
    (cell.run / "eval" / "test-selected").mkdir(parents=True)
    (cell.run / "config.json").write_text(json.dumps({"test_checkpoint": "selected"}))
    assert cell.state() == "partial"
    record = {"model": "org/olmoe-x", "method": "CE + affinity tuning", "dataset": "d", "seed": 42, "accuracy": 0.5,
              "choice_nll": 1.0, "settings": {}}
    (cell.run / "eval" / "test-selected" / "metrics.json").write_text(json.dumps(record))
    assert cell.state() == "done"
    assert "50.00" in write_report([cell], tmp_path, ("accuracy",), ())


def test_a_run_asked_for_both_test_evaluations_is_done_only_with_both(tmp_path):
    """--test-checkpoint both: a cell killed after the last epoch's evaluation, before the selected one's,
    is partial (the sweep resumes it and train.py scores the missing one), not done without it."""
    [cell] = grid(["org/olmoe-x"], ["d"], ["CE"], (42,), tmp_path)
    (cell.run / "config.json").parent.mkdir(parents=True)
    (cell.run / "config.json").write_text(json.dumps({"test_checkpoint": "both"}))
    for folder, state in (("test", "partial"), ("test-selected", "done")):
        (cell.run / "eval" / folder).mkdir(parents=True)
        (cell.run / "eval" / folder / "metrics.json").write_text(json.dumps({"accuracy": 0.5}))
        assert cell.state() == state, folder
    assert cell.test_dir == cell.run / "eval" / "test"  # the reported one: the last epoch's, as the paper's rows


def test_study_preset_scores_the_base_model_once_and_reports_zero_shot_and_wall_time(tmp_path, data):
    """The study preset: its rows, one epoch (its own train.py flag, which flags after -- still override),
    the first seed's CE run also scores the base model, and the report leads with that zero-shot row
    (the numbers in eval/test-base) and ends with each run's training wall time from metrics.jsonl."""
    args = ["--preset", "study", "--models", str(tiny_checkpoint()), "--benchmarks", str(data),
            "--out-dir", str(tmp_path)]
    cells = sweep.main([*args, "--dry-run"])
    # The nine rows, and all-layer ACS-IS, TES-IS and TES-IS's control Dual Affinity: 12 x 3 seeds.
    assert len(cells) == 12 * 3 and {c.row for c in cells} == set(grid_module.PAPER_ROWS)
    assert {c.row for c in cells if c.settings == (("layers", "all"),)} == {"ACS-IS", "Dual Affinity", "TES-IS"}
    assert [(c.row, c.seed) for c in cells if c.zero_shot] == [("CE", 42)]
    assert "--zero-shot" in cells[0].train_args() and "--zero-shot" not in cells[1].train_args()
    ce = [c for c in cells if c.row in ("CE", "TES-IS") and not c.settings and c.seed == 42]
    flags = ce[0].train_args()
    assert flags[flags.index("--epochs") + 1] == "1"
    sweep.main([*args, "--rows", "CE", "TES-IS", "--seeds", "42", "--", "--batch-size", "8", "--quiet"])
    assert all(c.state() == "done" for c in ce)
    assert (ce[0].run / "eval" / "test-base").is_dir() and not (ce[1].run / "eval" / "test-base").exists()
    assert [json.loads(x)["epoch"] for x in (ce[0].run / "metrics.jsonl").read_text().splitlines()
            if json.loads(x)["kind"] == "epoch"] == [1]
    text = (tmp_path / "report.md").read_text()
    rows = [line.split(" | ")[1] for line in text.splitlines()[2:5]]
    assert rows == [ZERO_SHOT, "CE", "TES-IS"]  # the zero-shot row first
    base = json.loads((ce[0].run / "eval" / "test-base" / "metrics.json").read_text())["accuracy"]
    assert f"| {ZERO_SHOT} | {100 * base:.2f} |" in text
    records = [json.loads(x) for x in (ce[1].run / "metrics.jsonl").read_text().splitlines()]
    seconds = sum(r["seconds"] if r["kind"] == "step" else r["val_seconds"] for r in records)
    assert train_seconds(ce[1].run) == pytest.approx(seconds) and seconds > 0
    assert f"| TES-IS | {Path(data).name} | {seconds / 60:.1f} | 1 |" in text
    # evaluate.py compare reads the runs' own predictions.jsonl (train.py's format), run folders as given.
    result = evaluate.main(["compare", str(ce[0].run), str(ce[1].run)])
    predicted = [[json.loads(x)["prediction"] for x in (c.run / "eval" / "test" / "predictions.jsonl").read_text()
                  .splitlines()] for c in ce]
    assert result["seeds"] == [42] and (result["a"], result["b"]) == ("CE", "TES-IS")
    assert result["differing_predictions"] == sum(a != b for a, b in zip(*predicted)) and result["questions"] == 4


def test_report_compares_each_method_with_its_parameter_matched_control(tmp_path):
    """Group comparisons on hand-made evaluations: all-layer ACS-IS against CE (no all-layer CE in the
    grid), all-layer TES-IS against all-layer Dual Affinity, paired by seed over the seeds where both
    finished; every number against a recount (scipy's binomial test, the bootstrap redrawn by hand)."""
    from tests.study.test_compare import reference_bootstrap, write_evaluation
    rows = ["CE", "ACS-IS", ("ACS-IS", None, ALL_LAYERS), "Dual Affinity", ("Dual Affinity", None, ALL_LAYERS),
            "TES-IS", ("TES-IS", None, ALL_LAYERS)]
    cells = grid(["org/granite-x"], ["d"], rows, (42, 43), tmp_path)
    rng = np.random.default_rng(0)
    ids, gold = [f"q{i}" for i in range(40)], rng.integers(0, 3, 40)
    written = {}
    for c in cells:
        if (c.row, c.settings, c.seed) in (("CE", (), 43), ("ACS-IS", (), 42)):
            continue  # not finished: no seed where both CE and ACS-IS did, all-layer ACS-IS on seed 42 alone
        pred = np.where(rng.random(40) < 0.6, gold, rng.integers(0, 3, 40))
        nll = rng.gamma(2.0, 0.5, 40)
        (c.run).mkdir(parents=True)
        (c.run / "config.json").write_text("{}")
        write_evaluation(c.run / "eval" / "test", ids, gold, pred, nll, seed=c.seed, method=c.row)
        written[(c.row, c.settings, c.seed)] = (pred, nll)
    report = write_report(cells, tmp_path, tables=("comparisons",))
    lines = [l for l in report[report.index(COMPARISONS_TITLE):].splitlines() if l.startswith("| ")][1:]
    assert [line.split(" | ")[2:4] for line in lines[:4]] == [
        ["CE", "ACS-IS"], ["CE", "ACS-IS [layers=all]"], ["Dual Affinity", "TES-IS"],
        ["Dual Affinity [layers=all]", "TES-IS [layers=all]"]]
    all_layers = (("layers", "all"),)

    def expected(control, method, seeds):
        a, b = ([written[(*row, seed)] for seed in seeds] for row in (control, method))  # [(pred, nll)] per seed
        ca, cb = (np.stack([pred == gold for pred, _ in side]) for side in (a, b))  # [S, Q] right or wrong
        dacc, dnll = cb.astype(float) - ca, np.stack([nb - na for (_, na), (_, nb) in zip(a, b)])
        lo, hi = 100 * reference_bootstrap(dacc, 10_000)
        nlo, nhi = reference_bootstrap(dnll, 10_000)
        ps = [binomtest(int(np.sum(~x & y)), int(np.sum(x != y)), 0.5).pvalue if np.any(x != y) else 1.0
              for x, y in zip(ca, cb)]
        differing = [int(np.sum(pa != pb)) for (pa, _), (pb, _) in zip(a, b)]
        return (f"{100 * dacc.mean():+.2f} [{lo:+.2f}, {hi:+.2f}] | " + ", ".join(f"{p:.3g}" for p in ps)
                + f" | {dnll.mean():+.4f} [{nlo:+.4f}, {nhi:+.4f}] | " + ", ".join(map(str, differing)) + " of 40 |")

    assert lines[0].endswith(" | CE | ACS-IS | missing (0/2) | | | | |")
    assert lines[1].endswith(" | 42 (n=1/2) | " + expected(("CE", ()), ("ACS-IS", all_layers), (42,)))
    assert lines[3].endswith(" | 42, 43 | " + expected(("Dual Affinity", all_layers), ("TES-IS", all_layers), (42, 43)))
    saved = json.loads((tmp_path / "comparisons.json").read_text())  # the table's numbers, in full
    assert [(r["control"], r["method"], r["pairs"], r["of"]) for r in saved] == [
        ("CE", "ACS-IS", 0, 2), ("CE", "ACS-IS [layers=all]", 1, 2), ("Dual Affinity", "TES-IS", 2, 2),
        ("Dual Affinity [layers=all]", "TES-IS [layers=all]", 2, 2)]
    dual_all_43 = next(c for c in cells if (c.row, c.settings, c.seed) == ("Dual Affinity", all_layers, 43))
    assert saved[3]["result"]["per_seed"][1]["a"] == str(dual_all_43.test_dir)
    # Evaluations of other questions are named, not compared.
    tes = next(c for c in cells if (c.row, c.settings, c.seed) == ("TES-IS", (), 43))
    write_evaluation(tes.run / "eval" / "other", ids[:30], gold[:30], gold[:30], np.ones(30), seed=43, method="TES-IS")
    (tes.run / "eval" / "test").rename(tes.run / "eval" / "old")
    (tes.run / "eval" / "other").rename(tes.run / "eval" / "test")
    text = comparison_table(group_comparisons(cells))
    assert "| Dual Affinity | TES-IS | not compared (below) |" in text
    assert text.count("different questions") == 1 and "- TES-IS vs Dual Affinity, d: " in text


def test_slurm_params_reach_submitit_by_its_names(tmp_path, data, monkeypatch):
    """--slurm-param account=... qos=... mem=... constraint=... become submitit's slurm_* parameters,
    --slurm-gpus 4 the GPUs per node and torchrun's process count; an unknown key is refused by name."""
    pytest.importorskip("submitit")
    seen = {}
    monkeypatch.setattr(sweep, "submit_slurm", lambda cells, **kw: seen.update(kw) or [])
    sweep.main(sweep_args(tmp_path, data, "--slurm", "--slurm-gpus", "4", "--slurm-param", "account=proj",
                          "--slurm-param", "qos=high", "--slurm-param", "mem=64G", "--slurm-param", "constraint=a100"))
    assert seen == {"nproc": 4, "gpus_per_node": 4, "timeout_min": 1440, "slurm_account": "proj",
                    "slurm_qos": "high", "slurm_mem": "64G", "slurm_constraint": "a100"}
    with pytest.raises(SystemExit):
        sweep.main(sweep_args(tmp_path, data, "--slurm", "--slurm-param", "acount=proj"))


def test_a_grid_of_your_own_with_the_tiny_alias_and_your_own_method_runs_and_reports(tmp_path, data, capsys):
    """No --preset: --rows and --benchmarks make the grid. --models tiny names its runs as train.py does
    (tiny-olmoe-...), and a method that --method-module registers is a row beside CE; both run and are reported."""
    module = str(Path(__file__).parents[2] / "examples" / "my_method.py")
    args = ["--models", "tiny", "--benchmarks", str(data), "--rows", "CE", "biased", "--method-module", module,
            "--seeds", "42", "--out-dir", str(tmp_path)]
    cells = sweep.main([*args, "--", "--batch-size", "8", "--epochs", "1", "--quiet"])
    assert [c.run.name for c in cells] == ["tiny-olmoe-arc-CE-seed42", "tiny-olmoe-arc-Biased-seed42"]
    assert [c.state() for c in cells] == ["done", "done"]
    assert json.loads((cells[1].run / "config.json").read_text())["method"]["name"] == "biased"
    table = (tmp_path / "report.md").read_text()
    assert "| tiny-olmoe | CE | " in table and "| tiny-olmoe | Biased | " in table and "missing" not in table


@pytest.mark.parametrize("flags, message", [
    (["--models", "tiny", "--rows", "CE"], "without --preset a grid of your own needs --rows and --benchmarks"),
    ([], "choose a grid: --preset NAME"),
    (["--preset", "main", "--rows", "my_method"], "--rows 'my_method': expected one of .* or a method registered"),
    (["--preset", "main", "--", "--method", "dual"], "--method after --: it changes which run a cell is"),
    (["--preset", "main", "--", "--layers", "all"], "--layers after --: .* with --set layers"),
    (["--preset", "main", "--", "--seed", "7"], "--seed after --: .* with --seeds"),
])
def test_a_sweep_that_would_run_other_cells_than_it_names_exits_2(tmp_path, flags, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        sweep.main(["--out-dir", str(tmp_path), *flags])
    assert exit_.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_a_run_that_exits_0_without_finishing_its_cell_fails_the_sweep(tmp_path, data, monkeypatch):
    """train.py ending well but writing elsewhere (a run named otherwise) left the cell missing in a report
    that exited 0; the sweep now counts it as failed."""
    monkeypatch.setattr(sweep, "run_local", lambda cells: {c.run: 0 for c in cells})
    with pytest.raises(SystemExit, match=r"^sweep.py: error: 1 of 1 runs failed.*\n.*train.py exited 0 but this run "
                                         r"folder is not done"):
        sweep.main(["--models", str(tiny_checkpoint()), "--benchmarks", str(data), "--rows", "CE", "--seeds", "42",
                    "--out-dir", str(tmp_path)])


# The accuracy table's Method column (tab:downstream_accuracy), in its order, "(Ours)" left out.
PAPER_ROWS = ["CE", "ACS-ENLL", "ACS-IS", "CE + affinity tuning", "ACS-ENLL + affinity tuning", "ACS-IS + affinity tuning",
              "Dual Affinity", "TES-ENLL", "TES-IS"]


def test_the_rows_are_the_papers_named_as_their_runs_name_their_row():
    """ROWS is named by Method.row of the run each row's flags configure, and those names are the paper's;
    the baselines' rows follow them."""
    assert list(grid_module.PAPER_ROWS) == PAPER_ROWS and list(ROWS) == PAPER_ROWS + list(BASELINE_ROWS)


def test_the_baselines_preset_puts_each_baseline_beside_the_papers_rows(tmp_path, data):
    """Each baseline row is one run of its own name (the load-balancing row is CE at --aux-coef family),
    with the flags train.py takes; the paper's rows keep their runs."""
    cells = sweep.main(["--preset", "baselines", "--models", str(tiny_checkpoint()), "--benchmarks", str(data),
                        "--seeds", "42", "--out-dir", str(tmp_path), "--dry-run"])
    names = {c.row: c.run.name for c in cells}
    assert set(BASELINE_ROWS) <= set(names) and len(set(names.values())) == len(names)
    assert names["CE + load balancing"].endswith("-CE-auxfamily-seed42")
    assert names["DenseMixer"].endswith("-DenseMixer-layersall-seed42")
    assert names["Router only"].endswith("-Router_only-layersall-seed42")
    assert names["ESFT"].endswith("-ESFT-layersall-seed42")
    dense = next(c for c in cells if c.row == "DenseMixer")
    assert dense.train_args()[-4:] == ["--method", "densemixer", "--layers", "all"]


@pytest.mark.parametrize("row", ["CE", "TES-IS", "tes", "ce", "native", "TES", "my_method"])
def test_the_sweep_command_and_the_grid_accept_the_same_rows(tmp_path, row, capsys):
    """One row check (study.grid.check_row) for `grid` and sweep.py's --rows."""
    try:
        grid(["tiny"], ["arc_challenge"], [row], [42], tmp_path)
        in_grid = True
    except ValueError as e:
        in_grid = False
        assert re.match(rf"unknown row '{row}': expected one of \[", str(e))
    try:
        sweep.main(["--out-dir", str(tmp_path), "--models", "tiny", "--benchmarks", "arc_challenge", "--rows", row,
                    "--seeds", "42", "--dry-run"])
        in_command = True
    except SystemExit as e:
        assert e.code == 2 and f"--rows {row!r}: expected one of" in capsys.readouterr().err
        in_command = False
    assert in_grid == in_command == (row not in ("TES", "my_method"))


def test_the_help_example_of_your_own_rows_names_what_the_example_file_registers(capsys, monkeypatch):
    """Issue 41 item 7: sweep.py --help's row `my_method` was not the name examples/my_method.py registers."""
    from minimoe.runs.user_methods import resolve_method
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    with pytest.raises(SystemExit):
        sweep.main(["--help"])
    text = capsys.readouterr().out
    examples = re.findall(r"--rows CE (\w+) --method-module (\S+)", text)
    assert examples, "sweep.py --help shows no --rows example with --method-module"
    for name, module in examples:
        assert resolve_method(name, module).name == name


@pytest.mark.parametrize("extra", [(), ("--lambda", "0.1"), ("--method-option", "gamma=3"), ("--gamma", "3"),
                                   ("--epochs", "2")])
def test_a_cell_is_named_as_train_py_names_its_run_whatever_is_passed_after_the_dashes(extra):
    """The flags after sweep.py's `--` reach train.py, so a naming setting among them (lambda, a method
    option) names the run there: the cell carries the same name, or the sweep would never find its run."""
    from minimoe.cli.train import parse_args, resolve_config
    from minimoe.loading.config_json import read_config
    from minimoe.runs.naming import run_name
    cell = grid(["tiny"], ["arc_easy"], ["TES-IS"], (42,), "runs", extra=extra)[0]
    cfg = resolve_config(parse_args(cell.train_args()), read_config(tiny_checkpoint()))
    assert cell.run.name == run_name(vars(cfg), cfg.method)
    assert ("lambda0.1" in cell.run.name) == ("--lambda" in extra)


def test_the_dry_run_refuses_what_the_runs_would_refuse(tmp_path, data, capsys):
    """--dry-run checks each cell's command line with train.py's own checks (train.check_command): the
    layer-scope preset on the 4-layer tiny model (its tuned-affinity row: the others are Granite's or OLMoE's
    recipe's) lists its first:8 and last:8 cells as refused, with the reason, and exits non-zero, where the
    runs would fail one by one after the others had run; nothing is written."""
    with pytest.raises(SystemExit, match="train.py would refuse 2 run"):
        sweep.main(["--preset", "layer-scope", "--models", "tiny", "--benchmarks", str(data), "--seeds", "42",
                    "--out-dir", str(tmp_path / "out"), "--dry-run"])
    out = capsys.readouterr().out
    refused = [line for line in out.splitlines() if line.startswith("refused")]
    assert len(refused) == 2 and all("layers='first:8'" in line or "layers='last:8'" in line for line in refused), out
    assert not (tmp_path / "out").exists()


def test_a_sweep_cell_on_chat_data_runs_and_reports_the_test_loss(tmp_path, capsys):
    """A grid of your own over a chat file (--chat-template passed after --, to every run): the dry run lists
    the cell as missing and writes nothing; the cell then runs (TES on the conversations' assistant turns) and
    the report gives the run's test loss per supervised token (its metrics.json), headed as a loss."""
    from tests.cli.test_train_chat import CHATML, chat_rows, write_jsonl
    (tmp_path / "chatml.jinja").write_text(CHATML)
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows())
    args = ["--models", "tiny", "--benchmarks", str(data), "--rows", "TES-IS", "--seeds", "42",
            "--out-dir", str(tmp_path / "out")]
    extra = ["--", "--chat-template", str(tmp_path / "chatml.jinja"), "--batch-size", "8", "--epochs", "1", "--quiet"]
    sweep.main([*args, "--dry-run", *extra])
    assert "missing  " + str(tmp_path / "out" / "tiny-olmoe-chat.jsonl-TES-IS-seed42") in capsys.readouterr().out
    assert not (tmp_path / "out").exists()
    [cell] = sweep.main([*args, *extra])
    assert cell.state() == "done"
    loss = json.loads((cell.test_dir / "metrics.json").read_text())["loss"]
    table = (tmp_path / "out" / "report.md").read_text()
    assert "| Model | Method | chat.jsonl loss |" in table and f"| tiny-olmoe | TES-IS | {loss:.4f} |" in table
    [row] = csv.DictReader((tmp_path / "out" / "report.csv").open())
    assert float(row["loss"]) == pytest.approx(loss) and "accuracy" not in row
