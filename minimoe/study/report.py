"""The report (report.md, report.csv in out_dir) reads whatever has finished and marks the rest; an
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
import re
import statistics
from dataclasses import replace
from pathlib import Path

from minimoe.atomic import KINDS, check_owned_file, mark, write_owned_file, written_kind
from minimoe.evaluation import diagnostics
from minimoe.evaluation.diagnostics import partial_reason
from minimoe.evaluation.folders import METRICS, eval_dir, tokens_file
from minimoe.runs.naming import ablation_settings
from minimoe.runs.run_folder import read_metrics
from minimoe.study import compare
from minimoe.study.grid import Cell


ZERO_SHOT = "zero-shot (base model)"  # the report row of the base model's scores (train.py --zero-shot)

REPORT_FILES = ("report.md", "report.csv", "comparisons.json")  # what write_report writes into out_dir
TOKEN_COLUMNS = ("loss",)  # chat and completion data: the test loss per supervised token (metrics.json's "loss")
HEADS = {"accuracy": "acc", "choice_nll": "NLL", "loss": "loss"}  # a column's word in the table's header


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


def _data_columns(cells, columns) -> dict[str, tuple]:
    """Each dataset's report columns: the preset's, or TOKEN_COLUMNS where its runs scored chat or completion
    data (their metrics hold a held-out loss and no accuracy)."""
    out = {c.data: columns for c in cells}
    for c in cells:
        m = _metrics(c)
        if m is not None and "accuracy" not in m and "loss" in m:
            out[c.data] = TOKEN_COLUMNS
    return out


def report(cells, columns=("accuracy",)) -> tuple[str, list[dict]]:
    """Markdown table (mean ± sample std over the seeds that finished, n=k/N when some are missing,
    Δ from the lambda_m = 1e-3 cell for lambda-changed rows) and the per-cell CSV rows. Chat and completion
    data report the test loss per supervised token instead (`_data_columns`)."""
    by_data = _data_columns(cells, columns)
    every = list(dict.fromkeys(k for cols in by_data.values() for k in cols))  # the CSV's columns
    groups: dict[tuple, list[Cell]] = {}
    for c in cells:
        groups.setdefault((Path(c.model).name, _row_key(c), c.data), []).append(c)
    csv_rows, summary = [], {}
    for (model, row, data), members in groups.items():
        found = [(c, m) for c in members if (m := _metrics(c)) is not None]
        for c in members:
            m = dict(found).get(c)
            csv_rows.append({"model": model, "row": row, "dataset": data, "seed": c.seed, "run": c.run.name,
                             "state": _state(c), **{k: (m or {}).get(k) for k in every}})
        summary[(model, row, data)] = {k: [m[k] for _, m in found] for k in by_data[data]} | {"n": len(found),
                                                                                              "of": len(members)}
    for c in cells:  # the zero-shot row: the base model's scores, where a run made them (--zero-shot);
        base, key = eval_dir(c.run, checkpoint="base") / METRICS, (Path(c.model).name, ZERO_SHOT, c.data)
        if base.is_file() and key not in summary and not _partial(base, c):  # deterministic: one run's copy serves
            m = json.loads(base.read_text())
            summary[key] = {k: [m[k]] for k in by_data[c.data]} | {"n": 1, "of": 1}
    datasets = list(dict.fromkeys(c.data for c in cells))
    rows = sorted(dict.fromkeys((m, r) for m, r, _ in summary), key=lambda mr: mr[1] != ZERO_SHOT)  # stable
    head = [f"{Path(d).name} {HEADS[k]}" if len(by_data[d]) > 1 or k not in columns else Path(d).name
            for d in datasets for k in by_data[d]]
    lines = ["| Model | Method | " + " | ".join(head) + " |", "|---|---|" + "---|" * len(head)]
    for model, row in rows:
        out = [model, row]
        base = _lambda_baseline(row)
        for d in datasets:
            s = summary.get((model, row, d))
            for k in by_data[d]:
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
