"""train.py and evaluate.py on chat and prompt/completion data (the tiny checkpoint, a ChatML template given by
--chat-template: the tiny model has none): every method trains, the held-out loss is scored, bad rows are
refused before a run folder exists, --resume ends on the straight run's bits."""
import json

import pytest
import torch
from safetensors.torch import load_file

from minimoe.cli import evaluate, train
from tests.kill import killed_after

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SMOKE = ["--model", "tiny", "--batch-size", "8", "--epochs", "1", "--quiet"]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def chat_rows(n=30):
    return [{"messages": [{"role": "system", "content": "Add."}, {"role": "user", "content": f"{i % 7}+{i}?"},
                          {"role": "assistant", "content": f"{i % 7 + i}"}, {"role": "user", "content": "Twice?"},
                          {"role": "assistant", "content": f"{2 * (i % 7 + i)}"}]} for i in range(n)]


@pytest.fixture
def chat(tmp_path):
    (tmp_path / "chatml.jinja").write_text(CHATML)
    return write_jsonl(tmp_path / "chat.jsonl", chat_rows()), tmp_path / "chatml.jinja"


def run_train(tmp_path, *flags, name="run"):
    train.main(["--out-dir", str(tmp_path), "--run-name", name, "--data-dir", str(tmp_path / "splits"), *SMOKE, *flags])
    return tmp_path / name


def records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("method", ["ce", "dual", "tes", "acs", "densemixer", "router", "esft"])
def test_every_method_trains_on_chat_data(tmp_path, chat, method):
    data, template = chat
    run = run_train(tmp_path, "--data", str(data), "--chat-template", str(template), "--method", method)
    steps = [r for r in records(run) if r["kind"] == "step"]
    epoch = [r for r in records(run) if r["kind"] == "epoch"][0]
    assert steps and all(torch.isfinite(torch.tensor(s["loss"])) for s in steps)
    assert epoch["val_loss"] > 0 and epoch["val_perplexity"] == pytest.approx(torch.tensor(epoch["val_loss"]).exp().item())
    if method in ("tes", "acs"):  # the supervised tokens' CE feeds the method term
        assert all(s["method"] > 0 for s in steps)
    metrics = json.loads((run / "eval" / "test" / "metrics.json").read_text())
    assert metrics["n_examples"] == 3 and metrics["supervised_tokens"] > 0
    assert json.loads((run / "selection.json").read_text())["rule"].startswith("minimum validation next-token loss")


def test_completion_data_trains_and_evaluates(tmp_path):
    data = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": f"{i}+3=", "completion": f" {i + 3}"} for i in range(30)])
    run = run_train(tmp_path, "--data", str(data), "--method", "tes")
    per_example = [json.loads(line) for line in (run / "eval" / "test" / "predictions.jsonl").read_text().splitlines()]
    metrics = evaluate.main(["--adapter", str(run), "--eval-dir", str(tmp_path / "ev"), "--quiet"])
    assert metrics["loss"] == pytest.approx(sum(r["ce_sum"] for r in per_example) / sum(r["tokens"] for r in per_example))
    assert metrics["loss"] == pytest.approx(json.loads((run / "eval" / "test" / "metrics.json").read_text())["loss"])


def test_generate_writes_greedy_completions_and_compare_pairs_the_losses(tmp_path, chat):
    """evaluate.py --generate 2 writes the last assistant turn generated greedily through the caches, equal to a
    cache-free argmax loop over full forwards; compare pairs two runs' per-example losses."""
    from minimoe import from_pretrained, load_tokenizer
    from minimoe.making.tiny import tiny_checkpoint
    data, template = chat
    runs = [run_train(tmp_path, "--data", str(data), "--chat-template", str(template), "--method", m, name=m)
            for m in ("ce", "tes")]
    manifests = json.loads((runs[0] / "config.json").read_text())["data"]
    evaluate.main(["--model", "tiny", "--data", manifests, "--chat-template", str(template), "--generate", "2",
                   "--eval-dir", str(tmp_path / "base"), "--quiet"])
    lines = [json.loads(line) for line in (tmp_path / "base" / "generations.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and lines[0]["prompt"].endswith("<|im_start|>assistant\n")
    model, tok = from_pretrained(tiny_checkpoint()), load_tokenizer(tiny_checkpoint())
    ids = tok.encode(lines[0]["prompt"], add_special_tokens=False)
    stop = tok.encode(lines[0]["reference"], add_special_tokens=False)[-1]
    new = []
    with torch.no_grad():
        for _ in range(len(tok.encode(lines[0]["reference"], add_special_tokens=False)) + 16):
            new.append(int(model(torch.tensor([ids + new])).logits[0, -1].argmax()))
            if new[-1] == stop:
                break
    assert lines[0]["generation"] == tok.decode(new, skip_special_tokens=False)
    result = evaluate.main(["compare", str(runs[0]), str(runs[1])])
    a, b = ([json.loads(line)["loss"] for line in (r / "eval" / "test" / "predictions.jsonl").read_text().splitlines()]
            for r in runs)
    assert result["examples"] == 3 and result["loss_difference"] == pytest.approx(sum(b) / 3 - sum(a) / 3)
    assert result["loss_interval"][0] <= result["loss_difference"] <= result["loss_interval"][1]


@pytest.mark.parametrize("bad, flags, match", [
    (lambda rows: rows, ["--model", "tiny"], "has no chat template .* --chat-template FILE"),
    (lambda rows: rows[:4] + [{"messages": []}] + rows[5:], [], r"chat.jsonl:5: an empty conversation"),
    (lambda rows: rows[:6] + [{"messages": rows[0]["messages"][:2]}] + rows[7:], [], r"chat.jsonl:7: no assistant turn"),
    (lambda rows: rows[:2] + [{"messages": [{"role": "robot", "content": "x"}]}] + rows[3:], [], r"chat.jsonl:3: .*'robot'"),
    (lambda rows: rows, ["--max-length", "24"], r"train.jsonl:\d+ \(train:\d+\): \d+ tokens, longer than --max-length 24"),
])
def test_bad_chat_data_is_refused_before_the_run_folder(tmp_path, chat, bad, flags, match):
    data, template = chat
    write_jsonl(data, bad(chat_rows()))
    template_flags = [] if flags == ["--model", "tiny"] else ["--chat-template", str(template)]
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        run_train(tmp_path, "--data", str(data), *template_flags, *flags)
    assert not (tmp_path / "run").exists()


def test_resume_on_chat_data_is_bit_identical(tmp_path, chat):
    data, template = chat
    flags = ["--data", str(data), "--chat-template", str(template), "--method", "tes", "--epochs", "2"]
    straight = run_train(tmp_path, *flags, name="straight")
    with pytest.raises(SystemExit, match="stopped after epoch 1"), killed_after(epochs=1):
        run_train(tmp_path, *flags, name="killed")
    resumed = run_train(tmp_path, *flags, "--resume", name="killed")
    one, two = (load_file(run / "checkpoints" / "epoch-2" / "adapter.safetensors") for run in (straight, resumed))
    assert all(torch.equal(one[k], two[k]) for k in one)
    assert [r["loss"] for r in records(straight) if r["kind"] == "step"] == [
        r["loss"] for r in records(resumed) if r["kind"] == "step"]


def test_packed_training_takes_the_unpacked_steps(tmp_path, chat, monkeypatch):
    """--pack puts several conversations in a row (max-length 400); without dropout and the load-balancing
    term, each step's loss and the trained adapter equal one example a row's, to fp32 rounding."""
    data, template = chat
    flags = ["--data", str(data), "--chat-template", str(template), "--method", "tes", "--lora-dropout", "0",
             "--max-length", "400", "--no-test-eval"]
    one = run_train(tmp_path, *flags, name="one")
    from minimoe.runs import training
    shapes, make = [], training.make_token_batch
    monkeypatch.setattr(training, "make_token_batch", lambda rows, *a, **k: shapes.append(
        (len(rows), (b := make(rows, *a, **k)).input_ids.shape[0])) or b)
    packed = run_train(tmp_path, *flags, "--pack", name="packed")
    assert all(r < x for x, r in shapes), shapes  # several examples a row
    assert json.loads((packed / "config.json").read_text())["pack"] is True
    losses = [[r["loss"] for r in records(run) if r["kind"] == "step"] for run in (one, packed)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    a, b = (load_file(run / "checkpoints" / "epoch-1" / "adapter.safetensors") for run in (one, packed))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=1e-6)
