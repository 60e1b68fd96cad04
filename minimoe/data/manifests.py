"""Split manifests: one example per JSON line (sorted keys, compact, UTF-8, written atomically), read strictly, every
error naming the file, the line and what was expected; the checks that make an example usable (`check_example`) and
splits disjoint (`check_disjoint`, on `normalise`d text), which benchmarks.py's filter and your own data share; and
where a split's manifest lives (`manifest_path`) and its digest (`split_sha256`, recorded by every run)."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

from minimoe.core.task.choices import Example

DEFAULT_DATA_DIR = Path("runs") / "splits"  # relative to the working directory; /runs/ is git-ignored


def example_json(ex: Example) -> str:
    """One manifest line: sorted keys, compact, UTF-8; no "prompt" key where the paper's prompt applies."""
    record = {k: v for k, v in asdict(ex).items() if not (k == "prompt" and v is None)}
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def check_example(ex: Example, where: str) -> None:
    """What makes an example unusable (filter_examples drops these from benchmarks; elsewhere they are errors)."""
    if not ex.id or not ex.question:
        raise ValueError(f"{where}: empty 'id' or 'question'; expected non-empty strings")
    if len(ex.choices) < 2 or not all(isinstance(c, str) and c for c in ex.choices):
        raise ValueError(f"{where}: 'choices' is {ex.choices!r}; expected at least two non-empty strings")
    if not 0 <= ex.answer < len(ex.choices):
        raise ValueError(f"{where}: 'answer' is {ex.answer}; expected an index in [0, {len(ex.choices)})")
    if len(set(ex.choices)) < len(ex.choices):
        raise ValueError(f"{where}: 'choices' {ex.choices!r} repeat a choice; expected distinct choices "
                         f"(the gold answer would be ambiguous)")


def _parse_line(line: str, where: str) -> Example:
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON ({e.msg}); expected one JSON object per line") from None
    required = {"id": str, "question": str, "choices": list, "answer": int}
    optional = {"source": dict, "prompt": str}  # a null optional key is left out (asdict of an Example writes them)
    if isinstance(d, dict) and ("messages" in d or "completion" in d):  # a chat or completion example
        from minimoe.data.instruct import parse_text_line
        return parse_text_line(d, where)
    if isinstance(d, dict):
        d = {k: v for k, v in d.items() if not (k in optional and v is None)}
    if not isinstance(d, dict) or not set(required) <= set(d) <= set(required) | set(optional):
        got = sorted(d) if isinstance(d, dict) else type(d).__name__
        raise ValueError(f"{where}: got keys {got}; expected exactly {sorted(required)} and optionally "
                         f"{sorted(optional)}")
    for key, typ in {**required, **optional}.items():
        if key in d and (not isinstance(d[key], typ) or isinstance(d[key], bool)):
            raise ValueError(f"{where}: {key!r} is {type(d[key]).__name__}; expected {typ.__name__}")
    ex = Example(**{"source": {}, **d})
    check_example(ex, where)
    return ex


def normalise(text: str) -> str:
    """The overlap check's view of a text: case folded, runs of whitespace as one space, ends stripped,
    so that copies differing only in spacing or case count as the same example."""
    return " ".join(text.casefold().split())


def check_disjoint(splits: dict[str, list[Example]], where="the data", rows: dict | None = None) -> None:
    """Refuse an example that sits in two splits: the same id, or the same question and choice set
    (filter_examples' duplicate key), compared as normalised text (`normalise`). `rows`
    ({(split, id): file and row}) adds where both are."""
    seen: dict = {}
    for split, examples in splits.items():
        for ex in examples:
            content = ("content", normalise(ex.question), tuple(sorted(map(normalise, ex.choices))))
            for key in (("id", ex.id), content):
                other = seen.setdefault(key, (split, ex.id))
                if other[0] != split:
                    what = f"id {ex.id!r}" if key[0] == "id" else f"question and choices ({other[1]!r} and {ex.id!r})"
                    at = f" ({rows[other]} and {rows[split, ex.id]})" if rows else ""
                    raise ValueError(f"{where}: {other[0]} and {split} share {what}{at}; expected disjoint splits, "
                                     f"or the test score would count examples seen in training")


def read_manifest(path, sha256: str | None = None) -> list[Example]:
    """Strictly parse a .jsonl manifest; every error names the file, the line and what was expected.
    `sha256`: the digest the file must have (a registered split's, from its splits.json)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: manifest not found; build it with build_splits() or load_split(<name>)")
    raw = path.read_bytes()
    if sha256 is not None and hashlib.sha256(raw).hexdigest() != sha256:
        raise ValueError(f"{path}: its sha256 {hashlib.sha256(raw).hexdigest()} is not the {sha256} that "
                         f"{path.parent / 'splits.json'} records; the registered split was changed after it was "
                         f"built. Restore it, or remove {path.parent} to build it again")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 ({e.reason} at byte {e.start}); expected UTF-8 JSON lines") from None
    if not text.strip():
        raise ValueError(f"{path}: manifest is empty; expected one JSON example per line")
    lines = text.split("\n")  # not splitlines(): U+2028 and the like may sit inside JSON strings
    if lines[-1] == "":
        lines.pop()
    examples, seen = [], set()
    for lineno, line in enumerate(lines, 1):
        ex = _parse_line(line, f"{path}:{lineno}")
        if ex.id in seen:
            raise ValueError(f"{path}:{lineno}: id {ex.id!r} repeats an earlier line; expected unique ids")
        seen.add(ex.id)
        examples.append(ex)
    return examples


def manifest_path(data, split: str, data_dir=DEFAULT_DATA_DIR) -> Path:
    """The file a split is read from: <folder>/<split>.jsonl, a .jsonl manifest as given, or a
    registered benchmark's data_dir/<name>/<split>.jsonl."""
    path = Path(data)
    if path.is_dir():
        return path / f"{split}.jsonl"
    if str(data).endswith(".jsonl"):
        return path
    return Path(data_dir) / str(data) / f"{split}.jsonl"


def split_sha256(data, split: str, data_dir=DEFAULT_DATA_DIR) -> str:
    """sha256 of the manifest a split is read from (`manifest_path`)."""
    return hashlib.sha256(manifest_path(data, split, data_dir).read_bytes()).hexdigest()
