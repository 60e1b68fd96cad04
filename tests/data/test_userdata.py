"""Your own data (minimoe/data/userdata.py): a CSV and a `datasets` folder with field maps through train.py and
evaluate.py, the carve of missing splits, and each kind of bad row refused by name with nothing written."""
import csv
import json
from pathlib import Path

import pytest

from minimoe.cli import evaluate
from minimoe.cli import train
from minimoe.data.benchmarks import load_split
from minimoe.data.userdata import build_user_data

SMOKE = ["--model", "tiny", "--batch-size", "8", "--epochs", "1", "--quiet"]


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """Four-choice ARC-Challenge examples, the independent source of the rows we write in other layouts."""
    examples = load_split("arc_challenge", "train", data_dir=tmp_path_factory.mktemp("splits"))
    return [ex for ex in examples if len(ex.choices) == 4][:60]


def write_csv(path, examples, answer_as_text=lambda i: i % 2 == 0):
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["qid", "stem", "A", "B", "C", "D", "key"])
        for i, ex in enumerate(examples):
            key = ex.choices[ex.answer] if answer_as_text(i) else str(ex.answer)
            w.writerow([ex.id, ex.question, *ex.choices, key])
    return path


def manifest(folder, split):
    return [json.loads(line) for line in (folder / f"{split}.jsonl").read_text().splitlines()]


def train_and_evaluate(tmp_path, *flags):
    train.main(["--out-dir", str(tmp_path), "--run-name", "run", "--data-dir", str(tmp_path / "splits"),
                *SMOKE, *flags])
    run = tmp_path / "run"
    metrics = evaluate.main(["--adapter", str(run), "--out-dir", str(tmp_path / "eval")])
    return run, json.loads((run / "config.json").read_text()), metrics


def test_csv_with_a_field_map_trains_and_evaluates(tmp_path, pool):
    """Answers as text and as index both resolve to the source's answer; val and test are carved from train."""
    data = write_csv(tmp_path / "mine.csv", pool)
    run, cfg, metrics = train_and_evaluate(tmp_path, "--data", str(data),
                                           "--field-map", "id=qid,question=stem,choices=A+B+C+D,answer=key")
    folder = tmp_path / "splits" / cfg["data"].split("/")[-1]
    assert cfg["data"] == str(folder) and cfg["field_map"] is None and folder.name.startswith("mine-")
    rows = {r["id"]: r for s in ("train", "val", "test") for r in manifest(folder, s)}
    assert sorted(rows) == sorted(ex.id for ex in pool)
    for ex in pool:
        assert (rows[ex.id]["question"], rows[ex.id]["choices"], rows[ex.id]["answer"]) == (
            ex.question, ex.choices, ex.answer)
    report = json.loads((folder / "splits.json").read_text())
    assert report["carved"]["counts"] == {"test": 6, "val": 6} and report["given"] == ["train"]
    assert report["counts"] == {"train": 48, "val": 6, "test": 6}
    assert metrics["n_examples"] == 6 and (run / "eval" / "test" / "metrics.json").is_file()


def test_datasets_folder_with_a_field_map_and_a_prompt_template(tmp_path, pool):
    datasets = pytest.importorskip("datasets")
    as_rows = lambda exs: [{"q": ex.question, "opts": ex.choices, "label": ex.answer, "topic": "science"}
                           for ex in exs]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(as_rows(pool[:40])),
                          "validation": datasets.Dataset.from_list(as_rows(pool[40:50])),
                          "test": datasets.Dataset.from_list(as_rows(pool[50:60]))}).save_to_disk(tmp_path / "hf")
    template = "Topic: {topic}\nQ: {question}\nA:"
    run, cfg, metrics = train_and_evaluate(tmp_path, "--data", str(tmp_path / "hf"), "--prompt-template", template,
                                           "--field-map", "question=q,choices=opts,answer=label")
    test = manifest(tmp_path / "splits" / cfg["data"].split("/")[-1], "test")
    assert [(r["question"], r["choices"], r["answer"]) for r in test] == [
        (ex.question, ex.choices, ex.answer) for ex in pool[50:60]]
    assert [r["prompt"] for r in test] == [f"Topic: science\nQ: {ex.question}\nA:" for ex in pool[50:60]]
    assert [r["id"] for r in test] == [f"test:{i}" for i in range(10)]
    assert metrics["n_examples"] == 10 and cfg["prompt_template"] is None


def test_the_carve_is_deterministic_and_disjoint(tmp_path, pool):
    data = write_csv(tmp_path / "mine.csv", pool)
    flags = dict(field_map="id=qid,question=stem,choices=A+B+C+D,answer=key")
    first, again = (build_user_data(str(data), tmp_path / d, **flags) for d in ("a", "b"))
    assert first.name == again.name
    for split in ("train", "val", "test"):
        assert (first / f"{split}.jsonl").read_bytes() == (again / f"{split}.jsonl").read_bytes()
    train_ids = [r["id"] for r in manifest(first, "train")]
    assert train_ids == [ex.id for ex in pool if ex.id in set(train_ids)]  # train keeps the file's order
    held = {r["id"] for s in ("val", "test") for r in manifest(first, s)}
    assert len(held) == 12 and not held & set(train_ids)


@pytest.mark.parametrize("change, message", [
    (lambda rows: rows[3].__setitem__(0, rows[1][0]), "mine.csv:5: id .* repeats .*mine.csv:3"),
    (lambda rows: rows[4].__setitem__(6, "7"), r"mine.csv:6: 'answer' is 7; expected an index in \[0, 4\)"),
    (lambda rows: rows[2].__setitem__(3, " "), "mine.csv:4: 'choices' is .*; expected at least two non-empty"),
    (lambda rows: rows[5].__setitem__(6, "no such choice"), "mine.csv:7: answer 'no such choice' names none of"),
    (lambda rows: rows[5].__setitem__(6, "E"), "mine.csv:7: answer 'E' is letter 5 of 4 choices; expected A-D"),
    (lambda rows: rows[6].pop(), "mine.csv:8: 6 fields, header has 7"),
    (lambda rows: rows[6].append("x"), "mine.csv:8: 8 fields, header has 7"),
])
def test_bad_rows_are_named_and_nothing_is_written(tmp_path, pool, change, message):
    data = write_csv(tmp_path / "mine.csv", pool[:30])
    with open(data, newline="") as f:
        rows = list(csv.reader(f))
    header, body = rows[0], rows[1:]
    change(body)
    with open(data, "w", newline="") as f:
        csv.writer(f).writerows([header, *body])
    with pytest.raises(ValueError, match=message):
        train.main(["--out-dir", str(tmp_path), "--run-name", "run", "--data-dir", str(tmp_path / "splits"), *SMOKE,
                    "--data", str(data), "--field-map", "id=qid,question=stem,choices=A+B+C+D,answer=key"])
    assert not (tmp_path / "run").exists() and not (tmp_path / "splits").exists()


def test_overlap_between_given_splits_is_refused(tmp_path, pool):
    folder = tmp_path / "mine"
    folder.mkdir()
    write_csv(folder / "train.csv", pool[:20])
    write_csv(folder / "test.csv", pool[15:25])
    with pytest.raises(ValueError, match=f"train and test share id '{pool[15].id}' .*train.csv:17 and .*test.csv:2"):
        build_user_data(str(folder), tmp_path / "splits", field_map="id=qid,question=stem,choices=A+B+C+D,answer=key")
    assert not (tmp_path / "splits").exists()


@pytest.mark.plain
def test_hub_dataset_id_is_read_at_its_revision(tmp_path, pool, monkeypatch):
    """A hub id with --data-revision: the snapshot of that commit (a local cache standing in for the Hub,
    HF_HUB_OFFLINE), split by file name, parquet read; splits.json records the commit read."""
    import huggingface_hub.constants
    import pyarrow as pa
    import pyarrow.parquet as pq
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = tmp_path / "hub" / "datasets--someone--mcq" / "snapshots" / commit / "data"
    snapshot.mkdir(parents=True)
    rows = lambda exs: pa.Table.from_pylist([{"q": ex.question, "opts": ex.choices, "gold": ex.choices[ex.answer]}
                                             for ex in exs])
    pq.write_table(rows(pool[:30]), snapshot / "train-00000-of-00001.parquet")
    pq.write_table(rows(pool[30:40]), snapshot / "test-00000-of-00001.parquet")
    folder = build_user_data("someone/mcq", tmp_path / "splits", revision=commit,
                             field_map="question=q,choices=opts,answer=gold")
    report = json.loads((folder / "splits.json").read_text())
    assert (report["commit"], report["given"], report["counts"]) == (commit, ["test", "train"],
                                                                    {"train": 27, "val": 3, "test": 10})
    assert [(r["question"], r["answer"]) for r in manifest(folder, "test")] == [
        (ex.question, ex.answer) for ex in pool[30:40]]


def write_rows(path, header, rows):
    with open(path, "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([header, *rows])
    return path


NUMBERS = "id=qid,question=q,choices=a+b+c+d,answer=label"


def numeric_rows(label):
    """Thirty questions whose choices are digits; the gold is index 1, the choice "2"."""
    return [[f"q{i}", f"What is {i} plus 1, in a row of thirty?", "3", "2", "1", "4", label] for i in range(30)]


def test_letter_answers_resolve_without_a_type(tmp_path, pool):
    """A-D as in ARC, OpenBookQA and MMLU exports: the letter's position is the source's answer."""
    data = write_rows(tmp_path / "mcq.csv", ["qid", "q", "a", "b", "c", "d", "label"],
                      [[ex.id, ex.question, *ex.choices, "ABCD"[ex.answer]] for ex in pool])
    folder = build_user_data(str(data), tmp_path / "splits", field_map=NUMBERS)
    rows = {r["id"]: r["answer"] for s in ("train", "val", "test") for r in manifest(folder, s)}
    assert rows == {ex.id: ex.answer for ex in pool}


def test_a_digit_that_is_also_a_choice_text_is_refused_not_guessed(tmp_path):
    """'1' is index 1 ("2") or the choice "1" (index 2): refused with the row and the fix named."""
    data = write_rows(tmp_path / "num.csv", ["qid", "q", "a", "b", "c", "d", "label"], numeric_rows("1"))
    with pytest.raises(ValueError, match=r"num.csv:2: answer '1' is ambiguous: as index choice 1 \('2'\), as text "
                                         r"choice 2 \('1'\); say which with --field-map answer=label:index\|text"):
        build_user_data(str(data), tmp_path / "splits", field_map=NUMBERS)
    assert not (tmp_path / "splits").exists()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.mark.parametrize("answer, gold", [("41", 1), (1, 1), ("2", 2), ("70", 3)])
def test_a_digit_answer_with_one_reading_that_names_a_choice_is_that_choice(tmp_path, answer, gold):
    """Issue 41 item 3: math-style choices. "41" as an index names no choice of four, so only its text
    reading is left; a JSON int is an index; "2", which no choice's text is, is index 2."""
    rows = [{"id": f"q{i}", "question": f"What is {i} plus 40?", "choices": ["48", "41", "54", "70"],
             "answer": answer} for i in range(30)]
    folder = build_user_data(str(write_jsonl(tmp_path / "math.jsonl", rows)), tmp_path / "splits")
    assert {r["answer"] for s in ("train", "val", "test") for r in manifest(folder, s)} == {gold}


@pytest.mark.parametrize("kind, label, gold", [("index", "1", 1), ("text", "1", 2), ("letter", "b", 1)])
def test_an_answer_type_in_the_field_map_says_how_to_read_it(tmp_path, kind, label, gold):
    data = write_rows(tmp_path / "num.csv", ["qid", "q", "a", "b", "c", "d", "label"], numeric_rows(label))
    folder = build_user_data(str(data), tmp_path / "splits", field_map=f"{NUMBERS}:{kind}")
    assert {r["answer"] for s in ("train", "val", "test") for r in manifest(folder, s)} == {gold}
    assert json.loads((folder / "splits.json").read_text())["field_map"]["answer_type"] == kind


def test_a_typed_answer_of_another_type_is_refused(tmp_path):
    data = write_rows(tmp_path / "num.csv", ["qid", "q", "a", "b", "c", "d", "label"], numeric_rows("1"))
    with pytest.raises(ValueError, match="num.csv:2: answer '1' names none of .*; expected an answer of type letter"):
        build_user_data(str(data), tmp_path / "splits", field_map=f"{NUMBERS}:letter")


@pytest.mark.parametrize("content, message", [("", "empty.csv: empty file; expected a header row"),
                                              ("qid,q,a,b,c,d,label\n", "empty.csv: no rows under its header")])
def test_an_empty_or_header_only_file_is_named(tmp_path, content, message):
    (tmp_path / "empty.csv").write_text(content)
    with pytest.raises(ValueError, match=message):
        build_user_data(str(tmp_path / "empty.csv"), tmp_path / "splits", field_map=NUMBERS)


def test_unmapped_columns_are_named_once(tmp_path, pool, capsys):
    rows = [[ex.id, ex.question, *ex.choices, ex.answer, "note", "physics"] for ex in pool]
    data = write_rows(tmp_path / "mcq.csv", ["qid", "q", "a", "b", "c", "d", "label", "comment", "topic"], rows)
    build_user_data(str(data), tmp_path / "splits", field_map=NUMBERS, prompt_template="{topic}: {question}")
    warnings = [line for line in capsys.readouterr().err.splitlines() if "not mapped" in line]
    assert len(warnings) == 1 and "['comment']" in warnings[0]


def test_evaluate_scores_your_own_csv_with_the_flags_it_trained_with(tmp_path, pool):
    """evaluate.py --data FILE --field-map builds the same manifests train.py built: the run's test split."""
    data = write_rows(tmp_path / "mcq.csv", ["qid", "q", "a", "b", "c", "d", "label"],
                      [[ex.id, ex.question, *ex.choices, "ABCD"[ex.answer]] for ex in pool])
    run, cfg, _ = train_and_evaluate(tmp_path, "--data", str(data), "--field-map", NUMBERS)
    metrics = evaluate.main(["--adapter", str(run), "--data", str(data), "--field-map", NUMBERS, "--quiet",
                             "--out-dir", str(tmp_path / "again")])
    assert (metrics["data"], metrics["split_sha256"]) == (cfg["data"], cfg["data_sha256"]["test"])


def test_evaluate_scores_a_raw_jsonl_with_the_tiny_model(tmp_path, pool):
    """A JSONL without the manifest's keys (no id, letters for answers) is rows to build from, not a bad manifest."""
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps({"question": ex.question, "choices": ex.choices, "answer": "ABCD"[ex.answer]})
                            + "\n" for ex in pool))
    metrics = evaluate.main(["--model", "tiny", "--data", str(data), "--data-dir", str(tmp_path / "splits"),
                             "--out-dir", str(tmp_path / "eval"), "--quiet"])
    test = manifest(tmp_path / "splits" / metrics["dataset"], "test")
    assert metrics["n_examples"] == len(test) == 6 and metrics["model"].endswith("tiny-olmoe")
    golds = {ex.question: ex.answer for ex in pool}
    assert all(r["answer"] == golds[r["question"]] for r in test)


def test_evaluate_refuses_a_field_map_for_a_registered_benchmark(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        evaluate.main(["--model", "tiny", "--data", "arc_challenge", "--field-map", "answer=label",
                       "--eval-dir", str(tmp_path / "eval")])
    assert exit_.value.code == 2 and "--field-map and --prompt-template apply to your own --data" in capsys.readouterr().err
    assert not (tmp_path / "eval").exists()


def test_evaluate_reads_a_default_column_jsonl_with_text_answers_as_train_py_does(tmp_path, pool):
    """Issue 41 item 2: {"id", "question", "choices", "answer": "river"} has a manifest's keys but is your
    rows (a text answer); evaluate.py read it as a manifest and refused it ('answer' is str). Now both
    commands build the same manifests from it, and evaluate.py --data FILE scores the run's test split."""
    data = write_jsonl(tmp_path / "words.jsonl", [{"id": ex.id, "question": ex.question, "choices": ex.choices,
                                                   "answer": ex.choices[ex.answer]} for ex in pool])
    run, cfg, _ = train_and_evaluate(tmp_path, "--data", str(data))
    metrics = evaluate.main(["--adapter", str(run), "--data", str(data), "--quiet",
                             "--out-dir", str(tmp_path / "again")])
    assert (metrics["data"], metrics["split_sha256"]) == (cfg["data"], cfg["data_sha256"]["test"])
    golds = {ex.id: ex.answer for ex in pool}
    assert all(r["answer"] == golds[r["id"]] for r in manifest(tmp_path / "splits" / cfg["data"].split("/")[-1], "test"))


def test_a_folder_of_split_files_with_text_answers_is_rows_for_both_commands(tmp_path, pool):
    """A folder of train/val/test.jsonl is read as manifests only where they are in a manifest's form."""
    from minimoe.data.userdata import data_kind, resolve_data
    folder = tmp_path / "mine"
    folder.mkdir()
    for split, part in zip(("train", "val", "test"), (pool[:40], pool[40:50], pool[50:])):
        write_jsonl(folder / f"{split}.jsonl", [{"id": ex.id, "question": ex.question, "choices": ex.choices,
                                                 "answer": ex.choices[ex.answer]} for ex in part])
    assert data_kind(str(folder)) == data_kind(str(folder), split="test") == "rows"
    built = resolve_data(str(folder), tmp_path / "splits")
    assert data_kind(built) == "manifests" and resolve_data(built, tmp_path / "splits") == built
    assert [r["answer"] for r in manifest(Path(built), "test")] == [ex.answer for ex in pool[50:]]
    assert data_kind(str(Path(built) / "test.jsonl"), split="test") == "manifest"  # evaluate.py: that split
    assert data_kind(str(Path(built) / "test.jsonl")) == "rows"  # train.py: a file is its train split


@pytest.mark.parametrize("command", ["train", "evaluate"])
def test_a_missing_data_file_is_named_as_missing(tmp_path, command, capsys):
    """Issue 41 item 6: --data mcq.csv that does not exist said 'unknown dataset'."""
    main = train.main if command == "train" else evaluate.main
    with pytest.raises(FileNotFoundError, match=r"--data mcq.csv: no such file; expected .*\.csv file"):
        main(["--model", "tiny", "--data", "mcq.csv", "--out-dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
