"""bench/study.py on the tiny model and a tiny grid: every cell runs, a killed cell is resumed, finished cells
are skipped, and the table has one row per method plus the zero-shot row."""
import json

import pytest

from bench import study
from minimoe.data import load_split

ROWS = ["CE", "TES-IS"]


@pytest.fixture
def tiny_sciq(tmp_path):
    """Manifests of 8 examples per split, from the offline SciQ splits."""
    load_split("sciq", "train", data_dir=tmp_path / "splits")
    folder = tmp_path / "sciq"
    folder.mkdir()
    for split in ("train", "val", "test"):
        lines = (tmp_path / "splits" / "sciq" / f"{split}.jsonl").read_text().splitlines()[:8]
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def run_study(tmp_path, data, *train_args):
    return study.main(["--model", "tiny", "--out", str(tmp_path / "study"), "--rows", *ROWS, "--data", str(data),
                       "--seeds", "42", "--epochs", "2", "--", "--batch-size", "4", *train_args])


def test_study_resumes_a_killed_cell_skips_finished_ones_and_reports(tmp_path, tiny_sciq, capsys):
    out = tmp_path / "study"
    # A kill after the first cell's epoch 1: train.py exits non-zero, and so does the study.
    with pytest.raises(SystemExit, match="sciq-CE-seed42 failed"):
        run_study(tmp_path, tiny_sciq, "--stop-after-epochs", "1")
    killed = out / "sciq-CE-seed42"
    assert (killed / "checkpoints" / "epoch-1").is_dir() and not (killed / "eval" / "test").exists()
    assert (killed / "eval" / "test-base" / "metrics.json").is_file()  # CE cells score the base model first
    table = run_study(tmp_path, tiny_sciq)
    log = capsys.readouterr().out
    assert "sciq-CE-seed42: resume" in log and "sciq-TES-IS-seed42: new" in log
    epochs = [json.loads(line)["epoch"] for line in (killed / "metrics.jsonl").read_text().splitlines()
              if json.loads(line)["kind"] == "epoch"]
    assert epochs == [1, 2]  # continued from epoch 1, not restarted
    for row in ROWS:
        assert (out / f"sciq-{row}-seed42" / "eval" / "test" / "metrics.json").is_file()
    assert not (out / "sciq-TES-IS-seed42" / "eval" / "test-base").exists()
    rows = {line.split("|")[2].strip() for line in table.splitlines()[2:]}
    assert rows == {"zero-shot", "CE", "TES-IS"}
    assert (out / "table.md").read_text() == table
    assert set(json.loads((out / "wall_times.json").read_text())) == {f"sciq-{r}-seed42" for r in ROWS}
    # Everything finished: a third call trains nothing and gives the same table.
    mtime = (killed / "eval" / "test" / "metrics.json").stat().st_mtime_ns
    assert run_study(tmp_path, tiny_sciq) == table
    assert "sciq-CE-seed42: skipped (finished)" in capsys.readouterr().out
    assert (killed / "eval" / "test" / "metrics.json").stat().st_mtime_ns == mtime
