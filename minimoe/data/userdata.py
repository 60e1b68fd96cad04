"""Your own data as split manifests: JSONL or CSV files, a `datasets` folder, or a hub dataset; multiple-choice
rows, or chat and prompt/completion rows (a `messages` column, or `prompt` and `completion`: data/instruct.py).

    python train.py --model tiny --data my.csv --field-map question=stem,choices=A+B+C+D,answer=key
    python train.py --data user/repo --data-revision <commit> --field-map question=q,choices=options,answer=label

What --data may be (train.py and evaluate.py alike: `data_kind` decides, `resolve_data` builds):
- a .jsonl or .csv file: the train split;
- a folder of train/val/test files (.jsonl or .csv; "validation" and "dev" name val), or a folder that
  `datasets.Dataset(Dict).save_to_disk` wrote (its arrow files are read with pyarrow: no `datasets` at
  run time);
- a hub dataset id (owner/name), read at --data-revision: its parquet, JSONL or CSV files, each split
  named by its file name.
Fields (--field-map, default question=question,choices=choices,answer=answer,id=id): `choices` names
one column holding a list (a JSON list in CSV), or several columns joined by "+"; a dotted name reads
inside a nested value (choices=choices.text). The answer is an index from 0, a letter or the text of
one choice; answer=COLUMN:index, :letter (A-Z or a-z) or :text says which. Untyped, a JSON int is an
index, a digit string an index or a choice's text, A-Z a letter; a reading that names no choice is no
reading ("41" among 4 choices is the text "41"), and a value that two readings take to different
choices ("1" among choices 3, 2, 1, 4) is refused with its row named, never guessed. A CSV row with
more or fewer fields than the header, and an empty file, are refused; columns nothing reads are named
in one warning. `id` is optional (default <split>:<row number>), `source` too. --prompt-template (a str.format string over the row's fields and {question}) replaces the paper's
"Question: <q>\\nAnswer:" prompt; it is rendered into each example's `prompt`.

A missing val or test split is carved from train: sort by id, shuffle with Random(seed), 10% each (at
least one), the rest stays train in its own order. Every row is checked before anything is written;
an error names the file and row. The manifests go to <data_dir>/<name>-<digest>/ with splits.json
(where the rows came from, the field map, the template, the carve), the digest over the manifests'
bytes: the same data gives the same folder, changed data a new one. config.json records that folder
as the run's data, so evaluate.py and a relaunch read the manifests as they were.
"""
from __future__ import annotations

import csv
import hashlib
import json
import random
import re
import string
import sys
from pathlib import Path

from minimoe.atomic import atomic_directory
from minimoe.data.benchmarks import SPLITS, Example, _read_arrow
from minimoe.data.manifests import check_disjoint, check_example, example_json
from minimoe.data.instruct import TEXT_FIELDS, TEXT_KEYS, row_kind, to_text_example

FIELDS = {"question": "question", "choices": "choices", "answer": "answer", "id": "id"}  # the default map
SPLIT_NAMES = {"train": "train", "val": "val", "validation": "val", "dev": "val", "test": "test"}
CARVE_FRACTION = 0.1
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
ANSWER_TYPES = ("index", "letter", "text")  # --field-map answer=COLUMN:TYPE; index counts from 0


def parse_field_map(text: str | None) -> dict[str, str]:
    """'question=stem,choices=A+B,answer=key:letter' -> the default map with those entries replaced, and
    "answer_type" (index, letter, text; None: read from each value, refusing the ambiguous ones)."""
    mapping = {**FIELDS, **TEXT_FIELDS, "answer_type": None}
    for item in filter(None, (text or "").split(",")):
        key, eq, column = item.partition("=")
        if not eq or key not in {**FIELDS, **TEXT_FIELDS} or not column:
            raise ValueError(f"--field-map {item!r}: expected FIELD=COLUMN with FIELD in {[*FIELDS, *TEXT_FIELDS]}")
        name, colon, kind = column.rpartition(":")
        if key == "answer" and colon and kind in ANSWER_TYPES:  # answer=label:letter
            column, mapping["answer_type"] = name, kind
        mapping[key] = column
    return mapping


def is_user_data(data: str) -> bool:
    """A path (file or folder) or a hub dataset id: not one of data.BENCHMARKS' names."""
    return Path(data).exists() or bool(HUB_ID.fullmatch(data))


class FieldMapForBenchmark(ValueError):
    """--field-map or --prompt-template given with a registered benchmark, whose fields are fixed."""


MANIFEST_KEYS = {"id", "question", "choices", "answer", "source", "prompt"}  # data.example_json's keys
DATA_FILES = (".jsonl", ".csv", ".parquet")


def in_manifest_form(path: Path) -> bool:
    """Whether a .jsonl file reads as one of minimoe's manifests: its first line an object with an id, a
    question, choices and an integer answer, and no other keys than a manifest's. A file whose first line
    is no JSON object (or that is empty) counts too: read_manifest then says what is wrong with it. Rows
    of your own (no id, an answer as text or a letter) do not."""
    with open(path, encoding="utf-8") as f:
        line = f.readline()
    try:
        first = json.loads(line)
    except json.JSONDecodeError:
        return True
    if not isinstance(first, dict):
        return True
    answer = first.get("answer")
    if set(first) in TEXT_KEYS:  # a chat or completion manifest (data/instruct.py)
        return True
    return ({"id", "question", "choices", "answer"} <= set(first) <= MANIFEST_KEYS
            and isinstance(answer, int) and not isinstance(answer, bool))


def data_kind(data: str, *, custom: bool = False, split: str | None = None) -> str:
    """What --data is, decided in one place for train.py and evaluate.py:
    "manifests": a folder whose train/val/test.jsonl are manifests (what config.json records), read as they are;
    "manifest": evaluate.py only (`split` given): a file named <split>.jsonl in manifest form, that one split;
    "rows": your own rows to build manifests from (build_user_data): any other file or folder, a hub id,
    or anything with --field-map or --prompt-template (`custom`);
    "benchmark": a registered benchmark's name (load_split checks it).
    A data file that does not exist (mcq.csv) is refused here, named as a missing file."""
    path = Path(data)
    if not path.exists() and path.suffix in DATA_FILES:
        raise FileNotFoundError(f"--data {data}: no such file; expected a registered benchmark, a .jsonl or .csv "
                                f"file of your questions, a folder of them, a datasets folder or a hub dataset id")
    if not is_user_data(data):
        return "benchmark"
    def manifest(file: Path) -> bool:
        return file.is_file() and in_manifest_form(file)
    if not custom and path.is_dir() and all(manifest(path / f"{s}.jsonl") for s in SPLITS):
        return "manifests"
    if not custom and split is not None and path.name == f"{split}.jsonl" and manifest(path):
        return "manifest"
    return "rows"


def resolve_data(data: str, data_dir, *, field_map: str | None = None, prompt_template: str | None = None,
                 revision: str | None = None, seed: int = 42, split: str | None = None) -> str:
    """--data as both commands read it (data_kind): your own rows become their manifests' folder (the same
    folder for the same rows and flags); manifests and benchmarks are returned as they are."""
    custom = field_map is not None or prompt_template is not None
    kind = data_kind(data, custom=custom, split=split)
    if kind == "rows":
        return str(build_user_data(data, data_dir, field_map=field_map, prompt_template=prompt_template,
                                   revision=revision, seed=seed))
    if kind == "benchmark" and custom:
        raise FieldMapForBenchmark(f"--field-map and --prompt-template apply to your own --data (a file, folder or "
                                   f"hub id); {data!r} is a registered benchmark (its fields and the paper's prompt "
                                   f"are fixed)")
    return data


# ---- reading rows: {split: (origin, [row dict])} ----

def _read_csv(path: Path) -> list[dict]:
    """The rows under the header; a row with more or fewer fields than the header is refused, since csv's
    DictReader would fill the missing ones with None (then misread as a bad answer) or drop the extra."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        header, rows = reader.fieldnames, list(reader)
    if header is None:
        raise ValueError(f"{path}: empty file; expected a header row, then one row per question")
    for number, row in enumerate(rows, 2):  # row 1 is the header
        n = sum(v is not None for k, v in row.items() if k is not None) + len(row.get(None, []))
        if n != len(header):
            raise ValueError(f"{path}:{number}: {n} fields, header has {len(header)}; expected one "
                             f"field per header column (quote a field that holds a comma)")
    return rows


def _read_file(path: Path) -> list[dict]:
    if path.suffix == ".csv":
        rows = _read_csv(path)
    elif path.suffix == ".jsonl":
        rows = []
        for lineno, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg}); expected one object per line") from None
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq
        rows = pq.read_table(path).to_pylist()
    else:
        raise ValueError(f"{path}: expected a .jsonl, .csv or .parquet file")
    if not rows:
        raise ValueError(f"{path}: no rows{' under its header' if path.suffix == '.csv' else ''}; expected at "
                         f"least one question")
    return rows


def _saved_dataset(folder: Path) -> list[dict]:
    """The rows of one split that `datasets` save_to_disk wrote (state.json lists its arrow files)."""
    state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
    return [row for f in state["_data_files"] for row in _read_arrow(folder / f["filename"])]


def _split_of(name: str) -> str | None:
    """'train-00000-of-00001' -> train, 'validation' -> val, 'my_test' -> test; None: no split name in it."""
    words = re.split(r"[^a-z]+", name.lower())
    found = {SPLIT_NAMES[w] for w in words if w in SPLIT_NAMES}
    return found.pop() if len(found) == 1 else None


def read_rows(data: str, revision: str | None = None) -> tuple[dict[str, list[tuple[str, dict]]], str | None]:
    """({split: [(where, row)]}, the hub commit read or None). `where` names the file and row for errors."""
    path, commit = Path(data), None
    if path.is_file():
        files = {"train": [path]}
    elif (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():  # datasets.save_to_disk
        names = json.loads((path / "dataset_dict.json").read_text())["splits"] if (
            path / "dataset_dict.json").is_file() else [None]
        out = {}
        for name in names:
            split = "train" if name is None else _split_of(name)
            if split is None or split in out:
                raise ValueError(f"{path}: split {name!r}; expected train, val/validation/dev and test, once each")
            folder = path if name is None else path / name
            out[split] = [(f"{folder} row {i}", row) for i, row in enumerate(_saved_dataset(folder))]
        return out, None
    else:
        if not path.is_dir():
            from huggingface_hub import snapshot_download
            from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
            try:
                path = Path(snapshot_download(data, repo_type="dataset", revision=revision,
                                              allow_patterns=["*.parquet", "*.jsonl", "*.csv"]))
            except (LocalEntryNotFoundError, HfHubHTTPError) as e:
                raise FileNotFoundError(f"--data {data}: no such file or folder, and as a hub dataset at "
                                        f"{revision or 'main'}: {e}") from None
            commit = path.name
        files = {}
        for f in sorted(p for p in path.rglob("*") if p.suffix in (".parquet", ".jsonl", ".csv")):
            split = _split_of(f.stem)
            if split is not None:
                files.setdefault(split, []).append(f)
        if "train" not in files:
            raise ValueError(f"{data}: no train file; expected train.jsonl or train.csv (val/validation/dev and "
                             f"test optional), or a folder written by datasets' save_to_disk")
    out = {}
    for split, paths in files.items():
        out[split] = []
        for f in paths:
            first = 2 if f.suffix == ".csv" else 1  # CSV row 1 is the header
            where = f"{f}:{{}}" if f.suffix != ".parquet" else f"{f} row {{}}"
            out[split] += [(where.format(i + first), row) for i, row in enumerate(_read_file(f))]
    return out, commit


# ---- mapping rows to examples ----

def _get(row: dict, column: str, where: str):
    value = row
    for part in column.split("."):
        if not isinstance(value, dict) or part not in value:
            keys = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise ValueError(f"{where}: no field {column!r} (has {keys}); map it with --field-map")
        value = value[part]
    return value


def _choices(row: dict, column: str, where: str) -> list[str]:
    if "+" in column:
        values = [_get(row, c, where) for c in column.split("+")]
    else:
        values = _get(row, column, where)
        if isinstance(values, str) and values.lstrip().startswith("["):  # a CSV cell holding a JSON list
            values = json.loads(values)
    if not isinstance(values, list):
        raise ValueError(f"{where}: choices {values!r}; expected a list, or several columns joined by '+'")
    return [v.strip() if isinstance(v, str) else "" if v is None else str(v) for v in values]


def _readings(value, choices: list[str], kind: str | None) -> dict[str, int]:
    """Each way `value` could name a choice, {type: index}, in or out of range: as an index (a JSON int,
    or a string of digits: CSV cells are strings), a letter (A-Z; a-z too when the type says letter) or
    a choice's text; only `kind`'s when a type is given. Untyped, a JSON int is an index only: its type
    already says it is no text."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return {}
    text, readings = str(value).strip(), {}
    if kind in (None, "index") and re.fullmatch(r"-?\d+", text):
        readings["index"] = int(text)
    if isinstance(value, int) and kind is None:
        return readings
    if re.fullmatch(r"[A-Z]", text) if kind is None else kind == "letter" and re.fullmatch(r"[A-Za-z]", text):
        readings["letter"] = ord(text.upper()) - ord("A")
    if kind in (None, "text") and text in choices:
        readings["text"] = choices.index(text)
    return readings


def _answer(value, choices: list[str], where: str, kind: str | None = None, column: str = "COLUMN") -> int:
    """The answer's index. A reading that names no choice (index 41 of 4 choices) is no reading; a value
    that two readings take to different choices is refused, never guessed: "1" among the choices
    3, 2, 1, 4 is index 1 ("2") or the text "1" (index 2). "41" among 48, 41, 54, 70 is the text only."""
    readings = _readings(value, choices, kind)
    named = {how: i for how, i in readings.items() if 0 <= i < len(choices)}
    if len(set(named.values())) > 1:
        ways = ", ".join(f"as {k} choice {i} ({choices[i]!r})" for k, i in named.items())
        raise ValueError(f"{where}: answer {value!r} is ambiguous: {ways}; say which with --field-map "
                         f"answer={column}:{'|'.join(named)}")
    if named:
        return next(iter(named.values()))  # every reading that names a choice names this one
    if not readings:
        expected = f"an answer of type {kind}" if kind else "an index, a letter A-Z or the text of a choice"
        raise ValueError(f"{where}: answer {value!r} names none of the choices {choices!r}; expected {expected}")
    how, index = next(iter(readings.items()))  # out of range: said as the index or letter it is
    if how == "letter":
        raise ValueError(f"{where}: answer {value!r} is letter {index + 1} of {len(choices)} choices; expected "
                         f"A-{chr(ord('A') + len(choices) - 1)}")
    return index  # check_example names the range


def to_example(row: dict, fields: dict, split: str, index: int, where: str, template: str | None, data: str) -> Example:
    question = _get(row, fields["question"], where)
    question = question.strip() if isinstance(question, str) else ""
    choices = _choices(row, fields["choices"], where)
    answer = _answer(_get(row, fields["answer"], where), choices, where, fields.get("answer_type"),
                     fields["answer"])
    ex_id = str(row[fields["id"]]) if fields["id"] in row else f"{split}:{index}"
    source = row.get("source") if isinstance(row.get("source"), dict) else {"dataset": data, "partition": split}
    prompt = None
    if template is not None:
        try:
            prompt = template.format(**{k: v for k, v in row.items() if isinstance(k, str)}, question=question)
        except (KeyError, IndexError) as e:
            raise ValueError(f"{where}: --prompt-template names {e}, which this row lacks; its fields are "
                             f"{sorted(row)} and question") from None
    ex = Example(ex_id, question, choices, answer, source, prompt)
    check_example(ex, where)
    return ex


def unused_columns(rows: dict, fields: dict, template: str | None, kind: str = "choice") -> list[str]:
    """Top-level columns that neither the field map, the template nor `source` reads: named once in a
    warning, since a column the map forgot (a second answer key, say) would otherwise vanish unseen."""
    keys = {"choice": FIELDS, "chat": ("id", "messages"), "completion": ("id", "prompt", "completion")}[kind]
    used = {"source", *(c.split(".")[0] for key in keys for c in fields[key].split("+"))}
    if template is not None:
        used |= {re.split(r"[.\[]", name)[0] for _, name, _, _ in string.Formatter().parse(template) if name}
    seen = {k for split in rows.values() for _, row in split if isinstance(row, dict) for k in row}
    return sorted(str(k) for k in seen - used)


def carve(splits: dict[str, list[Example]], seed: int) -> dict:
    """Fill a missing val and test from train (module docstring); returns what was carved, for splits.json."""
    missing = [s for s in ("test", "val") if s not in splits]
    if not missing:
        return {}
    train = splits["train"]
    n = max(1, round(CARVE_FRACTION * len(train)))
    if len(train) < n * len(missing) + 1:
        raise ValueError(f"train has {len(train)} examples; carving {', '.join(missing)} ({n} each) needs at least "
                         f"{n * len(missing) + 1}. Give val and test files, or more training rows")
    order = sorted(train, key=lambda ex: ex.id)
    random.Random(seed).shuffle(order)
    taken = set()
    for i, split in enumerate(missing):
        splits[split] = order[i * n:(i + 1) * n]
        taken |= {ex.id for ex in splits[split]}
    splits["train"] = [ex for ex in train if ex.id not in taken]
    return {"from": "train", "seed": seed, "fraction": CARVE_FRACTION, "counts": {s: n for s in missing}}


def build_user_data(data: str, data_dir, *, field_map: str | None = None, prompt_template: str | None = None,
                    revision: str | None = None, seed: int = 42) -> Path:
    """Check every row, carve what is missing, write the manifests; returns their folder (module docstring)."""
    fields = parse_field_map(field_map)
    rows, commit = read_rows(data, revision)
    kind = row_kind(rows["train"][0][1], fields)  # chat, completion or choice: the first train row says
    if kind != "choice" and prompt_template is not None:
        raise ValueError(f"--data {data}: --prompt-template applies to multiple-choice rows; these are {kind} rows "
                         f"(the chat template or the prompt as given make their text)")
    splits, at = {}, {}  # at: (split, id) -> the file and row, for errors
    for split in [s for s in SPLITS if s in rows]:
        splits[split], seen = [], {}
        for index, (where, row) in enumerate(rows[split]):
            if not isinstance(row, dict):
                raise ValueError(f"{where}: a {type(row).__name__}; expected an object of fields")
            if row_kind(row, fields) != kind:
                raise ValueError(f"{where}: a {row_kind(row, fields)} row among {kind} rows (as the first train row "
                                 f"is); expected one kind of row throughout")
            ex = (to_example(row, fields, split, index, where, prompt_template, data) if kind == "choice" else
                  to_text_example(row, fields, kind, split, index, where))
            if ex.id in seen:
                raise ValueError(f"{where}: id {ex.id!r} repeats {seen[ex.id]}; expected unique ids")
            seen[ex.id] = at[split, ex.id] = where
            splits[split].append(ex)
    check_disjoint(splits, data, at)  # the same id or question in two given splits
    if unused := unused_columns(rows, fields, prompt_template, kind):  # after the checks: an error says more
        print(f"warning: --data {data}: columns {unused} are not mapped by --field-map nor used by "
              f"--prompt-template; they are left out of the manifests", file=sys.stderr)
    carved = carve(splits, seed)
    check_disjoint(splits, data)  # two train rows with one question, one of them carved away
    line = example_json if kind == "choice" else lambda ex: ex.json()
    manifests = {s: "".join(line(ex) + "\n" for ex in splits[s]).encode("utf-8") for s in SPLITS}
    digest = hashlib.sha256(b"".join(hashlib.sha256(m).digest() for m in manifests.values())).hexdigest()
    name = data.rstrip("/").split("/")[-1] if not Path(data).exists() else Path(data).stem
    folder = Path(data_dir) / f"{name}-{digest[:12]}"
    if (folder / "splits.json").is_file():  # the same manifests, built before
        return folder
    report = {"data": data, "kind": kind, "revision": revision, "commit": commit, "field_map": fields,
              "prompt_template": prompt_template, "given": sorted(rows), "carved": carved,
              "counts": {s: len(splits[s]) for s in SPLITS},
              "sha256": {s: hashlib.sha256(m).hexdigest() for s, m in manifests.items()}}
    with atomic_directory(folder, kind="user-data-manifests") as tmp:
        for split, content in manifests.items():
            (tmp / f"{split}.jsonl").write_bytes(content)
        (tmp / "splits.json").write_text(json.dumps(report, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return folder
