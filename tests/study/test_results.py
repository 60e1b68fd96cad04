"""minimoe.study.results: a tiny study collected into results/, and the report and comparisons made from
results/ alone against the ones made from the run folders themselves (the reference: sweep.py's own
report of those folders, and evaluate.py compare of them); collecting is deterministic to the byte,
keeps no path of the machine, and keeps only runs that scored their whole test split."""
import gzip
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from minimoe.cli import evaluate, sweep
from minimoe.making.tiny import tiny_checkpoint
from minimoe.study import compare, results

ROWS = ["CE", "ACS-IS"]  # ACS-IS's control is CE: the report's group table has one line


def study_args(data, out_dir, *flags):
    return ["--preset", "study", "--benchmarks", str(data), "--rows", *ROWS, "--seeds", "42", "43",
            "--out-dir", str(out_dir), *flags]


@pytest.fixture(scope="module")
def study(tmp_path_factory, data):
    """Four tiny runs (CE and ACS-IS x seeds 42, 43; CE 42 also scores the base model), reported."""
    runs = tmp_path_factory.mktemp("study") / "runs"
    cells = sweep.main(study_args(data, runs, "--models", str(tiny_checkpoint()), "--", "--batch-size", "8", "--quiet"))
    assert all(c.state() == "done" for c in cells)
    return runs, cells


def test_the_report_from_results_alone_equals_the_report_from_the_run_folders(study, data, tmp_path):
    """report.md and report.csv written from results/ (no run folder read) equal those written from the
    runs: the zero-shot row (eval/test-base), each cell, the group comparison with its bootstrap
    interval and McNemar p, the wall time (metrics.jsonl); comparisons.json equal but for the folders."""
    runs, cells = study
    results.collect([runs], tmp_path / "results")
    (tmp_path / "elsewhere").mkdir()
    moved = shutil.move(str(runs), str(tmp_path / "elsewhere"))  # the run folders gone from where they were
    try:
        sweep.main(study_args(data, tmp_path / "report", "--results", str(tmp_path / "results")))
    finally:
        shutil.move(moved, str(runs.parent))
    sweep.main(study_args(data, runs, "--models", str(tiny_checkpoint()), "--report-only"))
    expected, got = (runs / "report.md").read_text(), (tmp_path / "report" / "report.md").read_text()
    assert got == expected
    for part in ("| zero-shot (base model) |", "| CE | ACS-IS | 42, 43 |", "## Wall time"):
        assert part in expected, part  # the equality covers every table the study's report has
    assert (tmp_path / "report" / "report.csv").read_text() == (runs / "report.csv").read_text()
    ours = (tmp_path / "report" / "comparisons.json").read_text().replace(str(tmp_path / "report"), "OUT")
    assert ours == (runs / "comparisons.json").read_text().replace(str(runs), "OUT")
    # every run's per-question outcomes, read back from results/ and from the restored folder, are the run's
    for c in cells:
        want = compare.read_predictions(c.run)
        for got in (results.predictions(tmp_path / "results", c.run.name),
                    compare.read_predictions(tmp_path / "report" / c.run.name)):
            assert got.ids == want.ids and got.metrics == results.portable(want.metrics)
            for key in ("gold", "prediction", "choice_nll"):
                assert np.array_equal(getattr(got, key), getattr(want, key)), key
    # evaluate.py compare of two recorded runs: the same numbers as from their folders
    ce, acs = (next(c for c in cells if c.row == row and c.seed == 42 and not c.settings) for row in ROWS)
    from_runs = evaluate.main(["compare", str(ce.run), str(acs.run)])
    from_results = evaluate.main(["compare", "--results", str(tmp_path / "results"), ce.run.name, acs.run.name])
    for r in (from_runs, from_results):
        for s in r["per_seed"]:
            s.pop("a"), s.pop("b")
    assert from_results == from_runs and from_runs["questions"] == 4


def test_collecting_again_writes_the_same_bytes_in_any_order_and_no_path_of_the_machine(study, tmp_path):
    """Collected at once, twice, or in two parts (a second collect merges): the same bytes; gzip's
    header holds no time and no name; every absolute path in config and metrics became <local>/NAME."""
    runs, cells = study
    one = results.collect([runs], tmp_path / "one")
    assert one["collected"] == sorted(c.run.name for c in cells) and one["skipped"] == {}
    data = (tmp_path / "one" / "arc.jsonl.gz").read_bytes()
    assert results.collect([runs], tmp_path / "one")["written"] == []  # nothing changed, nothing written
    assert data[4:8] == b"\0\0\0\0" and not data[3] & 0x08  # mtime 0; no FNAME flag
    halves = [tmp_path / "a", tmp_path / "b"]
    for i, c in enumerate(sorted(cells, key=lambda c: c.run.name, reverse=True)):  # the later names first
        shutil.copytree(c.run, halves[i % 2] / c.run.name)
    for half in halves:
        results.collect([half], tmp_path / "two")
    assert (tmp_path / "two" / "arc.jsonl.gz").read_bytes() == data
    text = gzip.decompress(data).decode()
    assert str(tmp_path.parent.parent) not in text and str(tiny_checkpoint()) not in text
    record = json.loads(text.splitlines()[0])
    assert record["config"]["model"] == f"<local>/{tiny_checkpoint().name}"
    assert record["evaluations"]["test"]["questions"]["id"][0].startswith("arc_challenge:")


def test_a_run_that_did_not_score_its_whole_test_split_is_not_collected(study, tmp_path):
    """A run scored on part of its test split (n_examples below config.json's data_sizes), and one with
    no test evaluation, are listed with the reason and kept out of results/."""
    runs, cells = study
    part, unfinished = tmp_path / "runs" / cells[0].run.name, tmp_path / "runs" / cells[1].run.name
    shutil.copytree(cells[0].run, part)
    shutil.copytree(cells[1].run, unfinished)
    metrics = json.loads((part / "eval" / "test" / "metrics.json").read_text())
    (part / "eval" / "test" / "metrics.json").write_text(json.dumps({**metrics, "n_examples": 2}))
    shutil.rmtree(unfinished / "eval" / "test")
    done = results.collect([tmp_path / "runs"], tmp_path / "results")
    assert done["collected"] == [] and not (tmp_path / "results").exists()
    assert "partial test evaluation (scored 2 of the run's 4 test examples)" == done["skipped"][part.name]
    assert done["skipped"][unfinished.name].startswith("not finished")


def test_restoring_again_follows_the_results_folder_as_it_is_now(study, tmp_path):
    """A record gone from results/ (another collect, fewer runs) takes its restored folder with it."""
    runs, cells = study
    results.collect([runs], tmp_path / "results")
    names = {c.run.name for c in cells}
    assert {p.name for p in results.restore(tmp_path / "results", tmp_path / "out", runs=names)} == names
    kept = sorted(names)[1:]
    (tmp_path / "fewer").mkdir()
    for name in kept:
        shutil.copytree(runs / name, tmp_path / "fewer" / name)
    results.collect([tmp_path / "fewer"], tmp_path / "results2")
    results.restore(tmp_path / "results2", tmp_path / "out", runs=names)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == kept


def test_restoring_beside_train_py_runs_is_refused_and_a_bad_results_file_is_named(study, tmp_path):
    runs, _ = study
    results.collect([runs], tmp_path / "results")
    with pytest.raises(results.ResultsError, match="refusing to replace it.*an --out-dir of their own"):
        results.restore(tmp_path / "results", runs)
    (tmp_path / "results" / "bad.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(results.ResultsError, match="bad.jsonl.gz: not a results file"):
        results.read(tmp_path / "results")


def test_a_run_is_in_one_benchmark_file_and_moves_when_collected_under_another(study, tmp_path):
    """A results folder naming a run in two benchmark files is refused, naming both; a run recorded under
    one benchmark and collected again under another leaves the old file, so the folder stays readable."""
    runs, cells = study
    results.collect([runs], tmp_path / "results")
    records = results.read_file(tmp_path / "results" / "arc.jsonl.gz")
    moved = records[0]["run"]
    (tmp_path / "results" / "sciq.jsonl.gz").write_bytes(results.encode(records[:1]))
    with pytest.raises(results.ResultsError, match=rf"run {moved} is in both .*arc.jsonl.gz and .*sciq.jsonl.gz"):
        results.read(tmp_path / "results")
    old = json.loads(json.dumps(records[0]))  # the same run, recorded earlier under another benchmark
    old["evaluations"]["test"]["metrics"]["dataset"] = "old"
    (tmp_path / "again").mkdir()
    (tmp_path / "again" / "old.jsonl.gz").write_bytes(results.encode([old]))
    results.collect([runs], tmp_path / "again")
    assert results.read_file(tmp_path / "again" / "old.jsonl.gz") == []
    assert [r["run"] for r in results.read(tmp_path / "again")] == sorted(c.run.name for c in cells)


def test_the_results_readme_counts_the_runs_the_folder_holds():
    """results/README.md says how many runs each file holds ("`sciq.jsonl.gz`, 24 runs"): the files' own count,
    and every file is named."""
    folder = Path(__file__).resolve().parents[2] / "results"
    text = (folder / "README.md").read_text()
    said = {name: int(n) for name, n in re.findall(r"`([\w.+-]+\.jsonl\.gz)`, (\d+) runs", text)}
    held = {path.name: len(results.read_file(path)) for path in sorted(folder.glob(f"*{results.SUFFIX}"))}
    assert held and said == held


def test_the_study_page_tables_are_the_report_of_results(tmp_path):
    """The study page's split-model tables (docs/study.md: the re-run's cells and paired comparisons) are
    what `sweep.py --results results` regenerates from the repository's results/ folder alone, line for line."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    records = results.read(root / "results")
    rows = sorted({r["config"]["method"] for r in records})
    assert records and {"native", "acs"} <= set(rows), "results/ holds the study's re-run"
    out = tmp_path / "from-results"
    sweep.main(["--preset", "study", "--models", "weights/smollm2-split", "--results", str(root / "results"),
                "--out-dir", str(out), "--benchmarks", "sciq"])
    page = (root / "docs" / "study.md").read_text(encoding="utf-8")
    table_lines = [line for line in (out / "report.md").read_text().splitlines()
                   if line.startswith("| smollm2-split |")]
    assert len(table_lines) >= len(STUDY_ROWS) + 1  # the zero-shot row, every row (missing ones too), the comparisons
    missing = [line for line in table_lines if line not in page]
    assert not missing, f"docs/study.md lines not regenerated from results/: {missing}"
    unfinished = [row for row in STUDY_ROWS if not any(line.startswith(f"| smollm2-split | {row} | ") and "±" in line
                                                       for line in table_lines)]
    assert not unfinished, f"rows the page reports as finished on SciQ have no accuracy in results/: {unfinished}"


STUDY_ROWS = ["CE", "ACS-IS", "ACS-ENLL", "ACS-IS [layers=all]", "CE + affinity tuning", "Dual Affinity", "TES-IS",
              "TES-ENLL"]  # the rows the re-run has finished on SciQ (docs/study.md); the preset's others show as missing
