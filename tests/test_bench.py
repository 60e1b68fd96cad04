"""The benchmark's own machinery: the streaming checkpoint writer and the interleaved timer."""
import json
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common  # noqa: E402
from bench.make_checkpoint import make  # noqa: E402
from minimoe.core.decoder.model import MoEConfig  # noqa: E402
from minimoe.loading.checkpoint import checkpoint_tensors, from_pretrained  # noqa: E402


def tiny(family):
    d = dict(common.OFFICIAL[family], vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
             num_experts=4, num_experts_per_tok=2, num_attention_heads=4,
             num_key_value_heads=2 if family == "granitemoe" else 4)
    return MoEConfig(**d)


def test_streamed_checkpoint_has_the_saver_keys_and_loads_strictly(tmp_path):
    """make_checkpoint writes safetensors by hand; minimoe's strict loader and its saver's key set are the reference."""
    for family in ("olmoe", "granitemoe"):
        out = make(family, tmp_path / family, config=tiny(family), max_shard_bytes=20_000)
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1, "small shards should give several files"
        model = from_pretrained(out, dtype=torch.float32)  # raises on any missing/unexpected/misshaped key
        assert set(index["weight_map"]) == set(checkpoint_tensors(model))
        assert (family == "granitemoe") == ("lm_head.weight" not in index["weight_map"])  # tied embeddings
        with torch.no_grad():
            assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


def test_interleaved_rotates_order_and_ratios_per_round():
    calls = []
    t = common.interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=2, warmup=0)
    assert calls == ["a", "b", "b", "a"]
    t.times = {"a": [2.0, 4.0], "b": [1.0, 1.0]}
    assert t.ratio("a", "b") == (3.0, 2.0, 4.0)
    assert t.best_ratio("a", "b") == 2.0


def test_gpu_benchmark_runs_end_to_end_in_smoke_mode(tmp_path, monkeypatch):
    """bench/gpu.py --smoke on the CPU: every section runs (tiny widths) and the table has its rows; on
    a GPU the same code measures. Parity and grouped_mm figures are real checks even here."""
    pytest.importorskip("transformers")  # its parity and LoRA sections compare with transformers + peft
    pytest.importorskip("peft")
    from bench import gpu
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    rows = gpu.main(["--smoke", "--device", "cpu", "--out", "gpu-smoke"])
    failed = [r for r in rows if r["metric"] in ("failed", "skipped") and r["section"] != "default run"]
    assert not failed, failed
    by = {(r["section"], r["model"], r["metric"]): r for r in rows}
    assert by[("parity", "olmoe 3L", "fp32 max |logit diff| vs transformers")]["minimoe"] < 1e-4
    assert by[("grouped_mm", "granitemoe block", "max |diff| output / input grad / bank grad vs the loop")]["minimoe"] == "0 / 0 / 0"
    assert {r["model"] for r in rows if r["section"] == "lora"} == {"granitemoe 2L", "olmoe 2L"}
    assert (tmp_path / "gpu-smoke.md").read_text().count("\n") == len(rows) + 2


def test_every_bench_script_a_page_names_exists_or_is_listed_as_retired():
    """bench/ keeps the benchmarks a user runs. A page or module that names bench/NAME.py names a script
    that is there; the measurement log (bench/RESULTS.md) may name a retired one, which bench/README.md's
    table of retired investigations lists with the git object that still holds it."""
    repo = Path(__file__).resolve().parents[1]
    named = re.compile(r"(?<![:\w/])bench/(\w+)\.py")
    readme = (repo / "bench" / "README.md").read_text()
    retired = dict(re.findall(r"^\| `(\w+)\.py` \| ([^|]+) \|", readme.split("## Retired investigations")[1], re.M))
    assert retired and "git show 0283844:bench/NAME.py" in readme
    for name in retired:
        assert not (repo / "bench" / f"{name}.py").exists(), f"{name}.py is listed as retired and still in bench/"
    pages = [repo / "README.md", *repo.glob("docs/*.md"), repo / "bench" / "README.md", *repo.glob("minimoe/**/*.py"),
             *repo.glob("bench/*.py"), *repo.glob("tests/**/*.py"), *repo.glob("examples/*.py")]
    missing = [f"{page.relative_to(repo)}: bench/{name}.py" for page in pages if page.name != "test_bench.py"
               for name in named.findall(page.read_text()) if not (repo / "bench" / f"{name}.py").exists()]
    assert not missing, f"pages name bench scripts that are not there: {missing}"
    log = named.findall((repo / "bench" / "RESULTS.md").read_text())
    unknown = sorted({n for n in log if not (repo / "bench" / f"{n}.py").exists() and n not in retired})
    assert not unknown, f"bench/RESULTS.md names scripts neither in bench/ nor retired: {unknown}"
    rows = [line.split("|")[1].strip(" `") for line in readme.split("## Retired")[0].splitlines()
            if line.startswith("| `")]
    listed = {n.strip(" `") for row in rows for n in row.split(",")}
    assert {f"{n}.py" for n in ("gpu", "run", "score", "default_run", "split")} <= listed


def test_gpu_benchmark_stages_stream_rows_and_write_the_table_when_stopped(tmp_path, monkeypatch):
    """bench/gpu.py --only: the stages asked for, each row in the JSONL as it is made; the copies stage finds
    no bank-sized copy in a LoRA step; the attention stage names an SDPA backend per call shape. SIGTERM in
    a stage stops the run there and the table is still written; an unknown stage is refused by name."""
    import os
    import signal

    import pytest
    from bench import gpu
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    rows = gpu.main(["--smoke", "--device", "cpu", "--only", "copies,attention", "--out", "s"])
    assert {r["section"] for r in rows} == {"device", "copies", "attention"}
    assert [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()] == json.loads(json.dumps(rows))
    assert [r["minimoe"] for r in rows if r["section"] == "copies"] == [0]
    backends = {r["metric"]: r["note"] for r in rows if r["section"] == "attention" and "SDPA" in r["metric"]}
    assert len(backends) == 2 and all(b in ("flash_attention", "efficient_attention", "math", "cudnn_attention")
                                      for b in backends.values()), backends
    monkeypatch.setattr(gpu, "parity", lambda device, smoke: os.kill(os.getpid(), signal.SIGTERM))
    rows = gpu.main(["--smoke", "--device", "cpu", "--only", "parity,copies", "--out", "t"])
    assert [(r["section"], r["metric"]) for r in rows[-1:]] == [("parity", "stopped")]
    assert (tmp_path / "t.md").read_text().count("\n") == len(rows) + 2
    with pytest.raises(SystemExit):
        gpu.main(["--smoke", "--device", "cpu", "--only", "parity,nonsense"])


def test_gpu_benchmark_default_stage_makes_random_weights_of_the_default_models_shape(tmp_path):
    """A --default-model folder with config.json and tokenizer files only (what can travel to an offline
    GPU machine) gets random weights of that shape beside its tokenizer; a folder with weights is used as is."""
    import shutil
    from dataclasses import replace

    from bench.gpu_default import default_model
    from minimoe import load_tokenizer
    from minimoe.making.tiny import tiny_checkpoint
    light = tmp_path / "light"
    light.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(tiny_checkpoint() / name, light / name)
    folder, weights = default_model(light, torch.device("cpu"))
    assert weights.startswith("random") and folder != light
    model = from_pretrained(folder)
    assert replace(model.config, torch_dtype=None) == replace(from_pretrained(tiny_checkpoint()).config, torch_dtype=None)
    assert load_tokenizer(folder).encode("a question") == load_tokenizer(tiny_checkpoint()).encode("a question")
    assert default_model(tiny_checkpoint(), torch.device("cpu")) == (tiny_checkpoint(), "trained weights")


def test_chat_step_benchmark_times_packed_against_one_example_a_row(tmp_path, monkeypatch):
    """bench/chat_step.py --smoke: train.py's chat step on 4 SciQ conversations (the tiny model), both layouts
    timed; packed rows feed fewer rows and tokens (no padding between examples) for the same real tokens."""
    from bench import chat_step
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    one, packed = chat_step.main(["--smoke"])
    assert "one a row" in one.metric and "packed" in packed.metric and one.ratio == 1.0
    fed = [tuple(map(int, re.match(r"(\d+) rows, (\d+) tokens fed", r.note).groups())) for r in (one, packed)]
    assert fed[1][0] < fed[0][0] and fed[1][1] < fed[0][1] and one.ours > 0 and packed.ours > 0
    assert (tmp_path / "chat_step-smoke.md").is_file()


def test_gpu_benchmark_chat_stage_runs_the_chunked_and_the_plain_loss(tmp_path, monkeypatch):
    """bench/gpu.py --only chat --smoke on the CPU: the three layouts' rows, and the chunked loss ran (8-position
    chunks at smoke size) in the chunked layouts only."""
    from bench import gpu
    from minimoe.core.task import tokens
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    chunked, chunk_loss = [], tokens.chunked_token_ce
    monkeypatch.setattr(tokens, "chunked_token_ce", lambda head, h, t, chunk: chunked.append(chunk) or
                        chunk_loss(head, h, t, chunk))
    rows = gpu.main(["--smoke", "--device", "cpu", "--only", "chat", "--out", "c"])
    chat = {r["metric"]: r for r in rows if r["section"] == "chat"}
    assert set(chat) == {"tokens/s, one a row", "tokens/s, packed", "tokens/s, packed, plain loss"}, rows
    assert all(r["minimoe"] > 0 for r in chat.values()) and chat["tokens/s, one a row"]["ratio"] == 1.0
    assert chunked and set(chunked) == {8}  # 4 rounds x 2 chunked layouts x 2 micro-batches
    assert len(chunked) == 4 * 2 * 2


def test_gpu_benchmark_nf4_stage_swaps_one_models_base_between_the_three_forms(tmp_path, monkeypatch):
    """bench/gpu.py's nf4 stage on one model: use_base gives every packed module its base as a plain bf16 parameter
    (the LoRA bank's [W | s B] buffer again; dropped when a packed form comes back), as the whole-bank NF4Weight, or
    as PerExpertNF4 on the same packed values; the same logits in all three (the bf16 base is the NF4 weights
    dequantised), and the stage's rows."""
    pytest.importorskip("torchao")
    from bench import gpu
    from bench.gpu_common import config, random_model
    from bench.gpu_nf4 import PerExpertNF4, base_forms, use_base
    from minimoe.core.adaptation.lora import add_lora
    from minimoe.core.adaptation.quantized import NF4Weight, is_quantized, quantize_model
    model = add_lora(quantize_model(random_model(config("qwen3_moe", 1, True), torch.device("cpu")), "nf4"),
                     rank=4, dropout=0.0, targets=["q", "k", "v", "experts"]).eval()
    forms = base_forms(model)
    assert len(forms) == 6  # q, k, v, o and the two banks
    ids = torch.randint(2, 500, (1, 16), generator=torch.Generator().manual_seed(0))
    logits = {}
    for side, kind in (("bf16", None), ("nf4", NF4Weight), ("nf4 per expert", PerExpertNF4), ("bf16", None)):
        use_base(forms, side)
        assert all(is_quantized(m) == (kind is not None) and (kind is None or type(m.packed) is kind) for m in forms)
        banks = [m for m in forms if hasattr(m, "k")]
        assert all((m.stacked is not None) == (kind is None) for m in banks)
        if kind is None:  # the bank's weight views its stacked buffer, as add_lora made it
            assert all(m.weight.data_ptr() == m.stacked.data_ptr() for m in banks)
        else:  # no bf16 copy kept beside the packed base
            assert not [p for m in forms for p in m.parameters(recurse=False) if not p.requires_grad]
        with torch.no_grad():
            logits.setdefault(side, model(ids).logits)
    assert torch.equal(logits["bf16"], logits["nf4"]) and torch.equal(logits["nf4"], logits["nf4 per expert"])
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    rows = [r for r in gpu.main(["--smoke", "--device", "cpu", "--only", "nf4", "--out", "n"]) if r["section"] == "nf4"]
    assert [r["metric"].split(",")[1] for r in rows] == [" nf4 base (B2 x T64)", " nf4 per expert base (B2 x T64)"]
    assert all(r["minimoe"] > 0 and r["reference"] > 0 and "interleaved, one model" in r["note"] for r in rows), rows
