"""A study's evidence kept in the repository: every finished run's test outcomes, one file per benchmark.

    python -m minimoe.study.results collect runs/study-split --out results        # gather (again: same bytes)
    python sweep.py --preset study --models weights/smollm2-split --results results --out-dir runs/from-results
    python evaluate.py compare --results results RUN_A RUN_B [RUN_A RUN_B ...]

Run folders hold checkpoints and live on the machine that trained them; the study's numbers (docs/study.md)
must not rest on them. `collect` reads each finished run folder (config.json, metrics.jsonl, and every
test evaluation under eval/: the reported one, test-selected, test-base) and writes one record per
run into results/<benchmark>.jsonl.gz (benchmark: metrics.json's "dataset"):

    {"run": RUN name, "config": config.json, "log": [metrics.jsonl records],
     "evaluations": {"test": {"metrics": metrics.json,
                              "questions": {"id": [...], "gold": [...], "prediction": [...], "choice_nll": [...]}},
                     "test-base": {...}, ...}}

The question arrays are predictions.jsonl's columns that minimoe/study/compare.py reads, in its order.
A run is collected only when its reported test evaluation (eval_folder.test_evaluation) scored the
whole split its config.json declares (diagnostics.partial_reason); the others are listed, not kept.
Records already in results/ stay unless a run of the same name is collected again (then the run
folder's wins), so runs finished on several machines gather into one folder.

Decisions:
- Absolute paths (this machine's) become `<local>/NAME`, in any string: the model, the data, the
  command line in provenance. Relative paths and hub ids are kept. A record names its run, its
  model by that name and its weights by sha256 (provenance), never a folder of one machine.
- Deterministic bytes: records sorted by run name, keys sorted, gzip with mtime 0 and no file
  name, so collecting the same runs twice writes the same file and git sees no change.
- Kept: what the sweep report and `evaluate.py compare` read (metrics, per-question outcomes, the
  training log for the wall-time table). Not kept: checkpoints and the per-token arrays
  (tokens-*.npz), so the transform and concentration tables and the error-prediction figures are
  made from run folders only.
- The report from results: `restore` writes each record back as a run folder of evidence only
  (kind "recorded-run": no checkpoints, so nothing can resume it) under the sweep's --out-dir,
  and sweep.py's ordinary report reads those; one report code path for runs and results alike.
"""
from __future__ import annotations

import gzip
import io
import json
import re
import shutil
from pathlib import Path

from minimoe.atomic import atomic_directory, atomic_file, check_replaceable, written_kind
from minimoe.evaluation.diagnostics import partial_reason
from minimoe.evaluation.folders import EVAL, METRICS, PREDICTIONS, test_evaluation

SUFFIX = ".jsonl.gz"
LOG = "metrics.jsonl"  # the run's training log (runs.METRICS)
LOCAL = "<local>"  # what stands for the machine-specific part of an absolute path
QUESTION_KEYS = ("id", "gold", "prediction", "choice_nll")
RESTORED = "recorded-run"  # atomic.KINDS: a run folder restored from results/ (evidence, no checkpoints)
# An absolute POSIX path inside a string: a "/" that starts the string or follows a space, "=" or a
# quote, up to the next space or quote. "https://..." is not one (its "/" follows ":" or "/").
ABSOLUTE = re.compile(r"(?:^|(?<=[\s='\"(]))/[^\s'\"]*")


class ResultsError(ValueError):
    """A results folder or run folder that cannot be read or written as documented; the message names it."""


# ---- collecting -----------------------------------------------------------------------------------

def portable(value):
    """`value` (a JSON value) with every absolute path in its strings replaced by <local>/NAME."""
    if isinstance(value, str):
        return ABSOLUTE.sub(lambda m: f"{LOCAL}/{Path(m.group(0)).name}" if m.group(0) != "/" else m.group(0), value)
    if isinstance(value, list):
        return [portable(v) for v in value]
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    return value


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ResultsError(f"{path}: not valid JSON ({e}); expected the file train.py or evaluate.py wrote") from None


def read_questions(folder: Path) -> dict:
    """An evaluation folder's predictions.jsonl -> {"id": [...], "gold": [...], ...} (QUESTION_KEYS)."""
    file = folder / PREDICTIONS
    columns = {k: [] for k in QUESTION_KEYS}
    for n, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        try:
            record = json.loads(line)
            values = (str(record["id"]), int(record["gold"]), int(record["prediction"]), float(record["choice_nll"]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ResultsError(f"{file}:{n}: expected a JSON object with {', '.join(QUESTION_KEYS)} ({e})") from None
        for key, value in zip(QUESTION_KEYS, values):
            columns[key].append(value)
    if not columns["id"]:
        raise ResultsError(f"{file}: no predictions")
    return columns


def run_record(run: Path) -> tuple[dict | None, str | None]:
    """A run folder -> (its record, None) when finished, else (None, why it is not collected)."""
    config_file = run / "config.json"
    if not config_file.is_file():
        return None, "no config.json: not a run folder"
    config = _read_json(config_file)
    reported = test_evaluation(run)
    if not (reported / METRICS).is_file() or not (reported / PREDICTIONS).is_file():
        return None, f"not finished: no {reported.relative_to(run)}/{METRICS} with {PREDICTIONS}"
    why = partial_reason(_read_json(reported / METRICS), config)
    if why:
        return None, f"partial test evaluation ({why})"
    evaluations = {}
    for folder in sorted((run / EVAL).iterdir()):
        if folder.name.split("-")[0] == "test" and (folder / METRICS).is_file() and (folder / PREDICTIONS).is_file():
            evaluations[folder.name] = {"metrics": portable(_read_json(folder / METRICS)),
                                        "questions": read_questions(folder)}
    log, records = run / LOG, []
    for n, line in enumerate(log.read_text(encoding="utf-8").splitlines() if log.is_file() else [], 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ResultsError(f"{log}:{n}: not valid JSON ({e}); expected train.py's metrics log") from None
    return {"run": run.name, "config": portable(config), "log": portable(records), "evaluations": evaluations}, None


def benchmark(record: dict) -> str:
    """The file a record goes to: its reported evaluation's dataset name."""
    folder = test_evaluation_name(record)
    name = str(record["evaluations"][folder]["metrics"].get("dataset") or "")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*", name):
        raise ResultsError(f"run {record['run']}: dataset {name!r} in its metrics.json is not a file name; expected "
                           f"a benchmark name such as sciq")
    return name


def test_evaluation_name(record: dict) -> str:
    """The evaluation the report reads (eval_folder.test_evaluation's rule, on the record's config)."""
    return "test-selected" if record["config"].get("test_checkpoint") == "selected" else "test"


def encode(records: list[dict]) -> bytes:
    """Records -> the file's bytes: one JSON line per record sorted by run, keys sorted, gzip mtime 0."""
    text = "".join(json.dumps(r, sort_keys=True, ensure_ascii=False, separators=(",", ":")) + "\n"
                   for r in sorted(records, key=lambda r: r["run"]))
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, compresslevel=9, mtime=0) as f:
        f.write(text.encode("utf-8"))
    return buffer.getvalue()


def read_file(path) -> list[dict]:
    """One results/<benchmark>.jsonl.gz -> its records; refused unless every line is a record."""
    path = Path(path)
    try:
        lines = gzip.decompress(path.read_bytes()).decode("utf-8").splitlines()
        records = [json.loads(line) for line in lines]
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ResultsError(f"{path}: not a results file ({type(e).__name__}: {e}); expected gzip-compressed JSON "
                           f"lines written by minimoe.study.results collect") from None
    for n, r in enumerate(records, 1):
        if not isinstance(r, dict) or not {"run", "config", "log", "evaluations"} <= r.keys():
            raise ResultsError(f"{path}:{n}: expected a record with run, config, log and evaluations "
                               f"(minimoe/study/results.py)")
    return records


def read(results_dir) -> list[dict]:
    """Every record in results_dir/*.jsonl.gz, sorted by run; a run named twice is refused."""
    results_dir = Path(results_dir)
    if not results_dir.is_dir():
        raise ResultsError(f"{results_dir}: no such results folder")
    records, seen = [], {}
    for path in sorted(results_dir.glob(f"*{SUFFIX}")):
        for r in read_file(path):
            if r["run"] in seen:
                raise ResultsError(f"run {r['run']} is in both {seen[r['run']]} and {path}; expected each run once")
            seen[r["run"]] = path
            records.append(r)
    return sorted(records, key=lambda r: r["run"])


def collect(runs_dirs, results_dir) -> dict:
    """Every finished run folder directly under `runs_dirs` -> results_dir/<benchmark>.jsonl.gz, merged
    with the records already there (a run collected again replaces its record). Each file is written
    atomically, and only if its bytes change. -> {"collected": [runs], "skipped": {run: why},
    "written": [files]}."""
    results_dir = Path(results_dir)
    found, skipped = {}, {}
    for runs_dir in map(Path, runs_dirs):
        if not runs_dir.is_dir():
            raise ResultsError(f"{runs_dir}: no such folder of runs (a sweep's --out-dir)")
        for run in sorted(p for p in runs_dir.iterdir() if p.is_dir() and (p / "config.json").is_file()):
            record, why = run_record(run)
            if record is None:
                skipped[run.name] = why
            elif run.name in found and found[run.name] != record:
                raise ResultsError(f"run {run.name} is in two of {[str(p) for p in runs_dirs]} with other "
                                   f"outcomes; collect one of them")
            else:
                found[run.name] = record
    files: dict[str, dict[str, dict]] = {}
    if results_dir.is_dir():
        for path in sorted(results_dir.glob(f"*{SUFFIX}")):
            files[path.name[:-len(SUFFIX)]] = {r["run"]: r for r in read_file(path)}
    for name, record in found.items():
        for held in files.values():  # a run that moved to another benchmark file leaves the old one
            held.pop(name, None)
        files.setdefault(benchmark(record), {})[name] = record
    written = []
    for bench, records in sorted(files.items()):
        path = results_dir / f"{bench}{SUFFIX}"
        data = encode(list(records.values()))
        if path.is_file() and path.read_bytes() == data:
            continue
        with atomic_file(path) as tmp:
            tmp.write_bytes(data)
        written.append(str(path))
    return {"collected": sorted(found), "skipped": skipped, "written": written}


# ---- reading them back ----------------------------------------------------------------------------

def restore(results_dir, out_dir, runs=None) -> list[Path]:
    """Write each record (or those named in `runs`) back as out_dir/RUN: config.json, metrics.jsonl
    and eval/<evaluation>/{metrics.json, predictions.jsonl} (the question columns only), a folder of
    kind "recorded-run" replaced only by another restore; a run folder of train.py there is refused.
    A run named in `runs` that the results no longer hold loses its restored folder, so that the
    report reads the results folder as it is now."""
    records = read(results_dir)
    if runs is not None:
        wanted = set(runs)
        records = [r for r in records if r["run"] in wanted]
        for name in sorted(wanted - {r["run"] for r in records}):  # restored before, no longer recorded
            stale = Path(out_dir) / name
            if stale.is_dir() and written_kind(stale) == RESTORED:
                shutil.rmtree(stale)
    written = []
    for r in records:
        target = Path(out_dir) / r["run"]
        try:
            check_replaceable(target, RESTORED)
        except FileExistsError as e:
            raise ResultsError(f"{e} (restoring {results_dir}: write the recorded runs into an --out-dir of "
                               f"their own, not beside train.py's runs)") from None
        with atomic_directory(target, RESTORED) as tmp:
            (tmp / "config.json").write_text(json.dumps(r["config"], indent=2) + "\n")
            (tmp / LOG).write_text("".join(json.dumps(x) + "\n" for x in r["log"]))
            for name, evaluation in r["evaluations"].items():
                folder = tmp / EVAL / name
                folder.mkdir(parents=True)
                (folder / METRICS).write_text(json.dumps(evaluation["metrics"], indent=2) + "\n")
                q = evaluation["questions"]
                (folder / PREDICTIONS).write_text("".join(
                    json.dumps(dict(zip(QUESTION_KEYS, row))) + "\n" for row in zip(*(q[k] for k in QUESTION_KEYS))))
        written.append(target)
    return written


def settings_differ(cell, record: dict) -> list[str]:
    """The sweep's settings check (Cell.changed) for a restored run: a path that collect made
    <local>/NAME counts as the cell's own where the names agree (run names hold the model's and the
    data's name, so the run was made from a model of that name)."""
    record = dict(record)
    for key in ("model", "data"):
        value, mine = record.get(key), str(cell.cfg.get(key))
        if isinstance(value, str) and value.startswith(f"{LOCAL}/") and Path(value).name == Path(mine).name:
            record[key] = mine
    return cell.changed(record)


def predictions(results_dir, run: str, evaluation: str | None = None, records: list[dict] | None = None):
    """One recorded run's reported (or named) test evaluation as compare.Predictions; its folder reads
    results_dir/RUN, the name the comparison prints. `records`: read(results_dir), when read already."""
    import numpy as np
    from minimoe.study.compare import Predictions
    record = next((r for r in (records if records is not None else read(results_dir)) if r["run"] == run), None)
    if record is None:
        raise ResultsError(f"{run}: no such run in {results_dir} (python -m minimoe.study.results list {results_dir} "
                           f"names those it holds)")
    name = evaluation or test_evaluation_name(record)
    if name not in record["evaluations"]:
        raise ResultsError(f"{run} in {results_dir}: no evaluation {name!r}; it holds {sorted(record['evaluations'])}")
    e = record["evaluations"][name]
    q = e["questions"]
    if len(set(q["id"])) != len(q["id"]):
        raise ResultsError(f"{run} in {results_dir}: a question id appears twice")
    return Predictions(Path(results_dir) / run, list(q["id"]), np.array(q["gold"]), np.array(q["prediction"]),
                       np.array(q["choice_nll"], dtype=np.float64), e["metrics"])


def compare_runs(results_dir, runs, **bootstrap) -> dict:
    """evaluate.py compare --results: [A1, B1, A2, B2, ...] run names -> compare.compare_pairs."""
    from minimoe.study.compare import compare_pairs
    runs = [str(r) for r in runs]
    if not runs or len(runs) % 2:
        raise ValueError(f"compare: expected pairs A B [A B ...], got {len(runs)} run name(s)")
    records = read(results_dir)
    read_ = [predictions(results_dir, r, records=records) for r in runs]
    return compare_pairs(list(zip(read_[0::2], read_[1::2])), **bootstrap)


if __name__ == "__main__":  # python -m minimoe.study.results runs its command, minimoe/cli/study_results.py
    import runpy
    runpy.run_module("minimoe.cli.study_results", run_name="__main__")
