"""minimoe.runs.tracking: routing statistics against evaluate.py's diagnostics, TensorBoard event files that
tensorboard's own reader loads, an offline W&B run's records (on answer-choice and on chat data), and the
training-curve plot."""
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from minimoe.cli import evaluate
from minimoe.cli import train
from minimoe.core.task.choices import pad_id
from minimoe.core.task.choices import forward_choices, make_choice_batch
from minimoe.core.routing_methods.methods import set_router
from minimoe.data.benchmarks import load_split
from minimoe.evaluation.accuracy import evaluate_split
from minimoe.loading.checkpoint import from_pretrained
from minimoe.loading.tokenizer import load_tokenizer
from minimoe.making.tiny import tiny_checkpoint
from minimoe.runs.tracking import RoutingStats
from tests.cli.test_train_chat import CHATML, chat_rows, write_jsonl

SMOKE = ["--model", "tiny", "--max-train-examples", "16", "--batch-size", "8", "--epochs", "2", "--no-test-eval",
         "--quiet"]


def test_routing_stats_equal_a_direct_count_and_the_evaluation_diagnostics(tmp_path):
    """Expert load = a per-token count of the executed experts over real tokens; mean C_t, e_hat and token
    loss at the gold answer tokens = the means of evaluate_split's per-token arrays (its own code path)."""
    model = from_pretrained(tiny_checkpoint()).eval()
    set_router(model, "tes", layers="all")
    with torch.no_grad():  # a non-constant error head, so e_hat varies per token
        for layer in model.model.layers:
            layer.mlp.router.error_head.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    tokenizer = load_tokenizer(tiny_checkpoint())
    examples = load_split("arc_challenge", "val", data_dir=tmp_path, seed=42)[:6]
    batch = make_choice_batch(examples, tokenizer, pad_id(tokenizer))
    cfg = model.config
    stats = RoutingStats(list(range(cfg.num_hidden_layers)), cfg.num_experts, cfg.num_experts_per_tok)
    with torch.no_grad():
        out, logp = forward_choices(model, batch)
        stats.add(out.routings, batch, batch.at_supervised(-logp))
    summary = stats.summary(has_e_hat=True)
    _, _, arrays = evaluate_split(model, tokenizer, examples, batch_size=len(examples))
    real = batch.attention_mask.flatten().tolist()
    for l in range(cfg.num_hidden_layers):
        counts = [0] * cfg.num_experts
        for t, chosen in enumerate(out.routings[l].experts.tolist()):
            if real[t]:
                for e in chosen:
                    counts[e] += 1
        assert summary[f"layer{l}"]["load"] == pytest.approx([c / sum(counts) for c in counts], abs=1e-6)
        assert summary[f"layer{l}"]["c_t"] == pytest.approx(arrays.concentration[l].mean(), rel=1e-5)
        assert summary[f"layer{l}"]["e_hat"] == pytest.approx(arrays.e_hat[l].mean(), rel=1e-5)
        assert summary[f"layer{l}"]["token_loss"] == pytest.approx(arrays.token_ce.mean(), rel=1e-5)
    assert np.std(arrays.e_hat[0]) > 1e-3  # the comparison is not between constants


# what a TES run of SMOKE reports: layer3 is the tiny model's final layer (TES's default scope), 8 experts
EXPECTED_TAGS = {f"train/{k}" for k in ("loss", "task", "method", "aux", "grad_norm", "lr", "tokens_per_s", "seconds")}
EXPECTED_TAGS |= {"val/seconds"}
EXPECTED_TAGS |= {f"routing/layer3/{k}" for k in ("c_t", "e_hat", "token_loss")}
EXPECTED_TAGS |= {f"routing/layer3/load/expert{e}" for e in range(8)}
# each kind of data: the validation metric followed (as in metrics.jsonl) and the tags it adds to EXPECTED_TAGS
VALIDATION = {"choices": ("val_choice_nll", {"val/choice_nll", "val/accuracy"}),
              "chat": ("val_loss", {"val/loss", "val/perplexity"})}


def data_flags(kind: str, tmp_path: Path) -> list[str]:
    """The tiny model's default benchmark (answer choices), or 30 ChatML conversations (tests/cli/test_train_chat.py)."""
    if kind == "choices":
        return []
    (tmp_path / "chatml.jinja").write_text(CHATML)
    return ["--data", str(write_jsonl(tmp_path / "chat.jsonl", chat_rows())), "--chat-template",
            str(tmp_path / "chatml.jinja")]


@pytest.mark.parametrize("kind", VALIDATION)
def test_tensorboard_event_files_hold_every_metrics_line(tmp_path, kind):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    train.main(["--out-dir", str(tmp_path), "--run-name", "run", "--data-dir", str(tmp_path / "splits"), *SMOKE,
                "--method", "tes", "--report-to", "tensorboard", *data_flags(kind, tmp_path)])
    val, val_tags = VALIDATION[kind]
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    reader = event_accumulator.EventAccumulator(str(run / "tensorboard"))
    reader.Reload()
    last = "layer3"  # the tiny model's final layer: TES's default scope
    assert set(reader.Tags()["scalars"]) == EXPECTED_TAGS | val_tags
    steps = [r for r in records if r["kind"] == "step"]
    assert [e.step for e in reader.Scalars("train/loss")] == [r["step"] for r in steps] == [1, 2, 3, 4]
    assert [e.value for e in reader.Scalars("train/loss")] == pytest.approx([r["loss"] for r in steps], rel=1e-6)
    assert [e.value for e in reader.Scalars(f"routing/{last}/e_hat")] == pytest.approx(
        [r["routing"][last]["e_hat"] for r in steps], rel=1e-6)
    epochs = [r for r in records if r["kind"] == "epoch"]
    tag = "val/" + val.removeprefix("val_")
    assert [e.step for e in reader.Scalars(tag)] == [r["step"] for r in epochs] == [2, 4]
    assert [e.value for e in reader.Scalars(tag)] == pytest.approx([r[val] for r in epochs], rel=1e-6)
    loads = [sum(r["routing"][last]["load"]) for r in steps]
    assert loads == pytest.approx([1.0] * len(steps), abs=1e-5)


def wandb_records(path: Path):
    """The protobuf Records of an offline run's .wandb file: a 7-byte W&B header, then LevelDB's log format
    (32 KiB blocks of chunks: crc32 u32, length u16, type u8 = 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2
    data, block, pos, pending = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B", path
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


@pytest.mark.parametrize("kind", VALIDATION)
def test_wandb_offline_run_holds_every_metrics_line(tmp_path, monkeypatch, kind):
    pytest.importorskip("wandb")
    val, val_tags = VALIDATION[kind]
    for name, value in (("WANDB_MODE", "offline"), ("WANDB_SILENT", "true"), ("WANDB_DIR", str(tmp_path)),
                        ("WANDB_CONFIG_DIR", str(tmp_path / "config")), ("WANDB_CACHE_DIR", str(tmp_path / "cache"))):
        monkeypatch.setenv(name, value)
    train.main(["--out-dir", str(tmp_path), "--run-name", "run", "--data-dir", str(tmp_path / "splits"), *SMOKE,
                "--method", "tes", "--report-to", "wandb", *data_flags(kind, tmp_path)])
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    [log] = run.glob("wandb/offline-run-*/run-*.wandb")
    history, config = {}, {}
    for record in wandb_records(log):
        if record.WhichOneof("record_type") == "history":
            # a key with "/" is stored split, in nested_key
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.setdefault(record.history.step.num, {}).update(items)
        elif record.WhichOneof("record_type") == "run":
            config = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                      for item in record.run.config.update}
    assert config["method"]["name"] == "tes" and config["report_to"] == "wandb"  # the run's config.json
    assert set().union(*history.values()) - {"_step", "_runtime", "_timestamp"} == EXPECTED_TAGS | val_tags
    steps = [r for r in records if r["kind"] == "step"]
    assert sorted(history) == [r["step"] for r in steps] == [1, 2, 3, 4]
    assert [history[r["step"]]["train/loss"] for r in steps] == pytest.approx([r["loss"] for r in steps], rel=1e-6)
    assert [history[r["step"]]["routing/layer3/load/expert0"] for r in steps] == \
        pytest.approx([r["routing"]["layer3"]["load"][0] for r in steps], rel=1e-6)
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert [history[r["step"]]["val/" + val.removeprefix("val_")] for r in epochs] == pytest.approx(
        [r[val] for r in epochs])


@pytest.mark.plain
def test_plot_draws_several_runs_on_one_png(tmp_path, capsys, monkeypatch):
    """Answer-choice runs and a chat run on one figure: each validation curve gets its panel."""
    from minimoe.runs import tracking
    for name, method, kind in (("a", "ce", "choices"), ("b", "acs", "choices"), ("c", "tes", "chat")):
        train.main(["--out-dir", str(tmp_path), "--run-name", name, "--data-dir", str(tmp_path / "splits"), *SMOKE,
                    "--method", method, *data_flags(kind, tmp_path)])
    import matplotlib.axes
    titles = []
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title", lambda ax, title, **k: titles.append(title))
    evaluate.main(["plot", *(str(tmp_path / n) for n in "abc"), "--out", str(tmp_path / "fig" / "curves.png")])
    assert {dict(tracking.CURVES)[k] for k in ("val_choice_nll", "val_loss")} <= set(titles)
    png = tmp_path / "fig" / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        evaluate.main(["plot", str(tmp_path / "splits"), "--out", str(tmp_path / "x.png")])
