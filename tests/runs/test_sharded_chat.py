"""The chunked next-token loss under --shard fsdp (two gloo processes on the CPU, tests/fsdp_worker.py): past CHUNK
supervised positions core/task/tokens.py runs the LM head after the model's forward, on the root unit's weight,
which FSDP2 keeps gathered until the backward ends (runs/sharding.py). A TES run on chat rows, every micro-batch
past the chunk (--loss-chunk 4), its layers checkpointed (--gradient-checkpointing), equals one process running
the head inside its forward (the default chunk of 1,024), no checkpointing:
each step's loss terms, and the adapter after 4 updates, to the reduction order's rounding (as
tests/runs/test_sharding.py bounds it). With the root resharded after its forward, the sharded run stops on the
head's sharded weight (seen: "aten.mm.default got mixed torch.Tensor and DTensor"). 13 s on 2 cores."""
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from minimoe.cli import train
from minimoe.core.task import tokens
from tests.cli.test_train_chat import CHATML, chat_rows, write_jsonl
from tests.runs.test_sharding import torchrun

LR, STEPS, CHUNK = 2e-3, 4, 4  # a micro-batch holds 6 supervised tokens or more (two assistant turns an example)
FLAGS = ["--model", "tiny", "--method", "tes", "--max-train-examples", str(8 * STEPS), "--batch-size", "8",
         "--epochs", "1", "--warmup", "0", "--lora-dropout", "0", "--recipe", "tiny", "--no-test-eval", "--quiet",
         "--dtype", "float32", "--device", "cpu"]


def steps(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "step"]


def test_a_sharded_chunked_loss_equals_one_process(tmp_path):
    (tmp_path / "chatml.jinja").write_text(CHATML)
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(40))
    flags = [*FLAGS, "--data", str(data), "--chat-template", str(tmp_path / "chatml.jinja"),
             "--data-dir", str(tmp_path / "splits")]
    train.main(["--out-dir", str(tmp_path / "one"), "--run-name", "chat", *flags])
    done = torchrun(tmp_path, [{"flags": ["--out-dir", str(tmp_path / "fsdp"), "--run-name", "chat", "--shard", "fsdp",
                                          *flags, "--gradient-checkpointing", "--loss-chunk", str(CHUNK)]}])
    assert done.returncode == 0, done.stderr[-4000:]
    one, two = tmp_path / "one" / "chat", tmp_path / "fsdp" / "chat"
    a, b = steps(one), steps(two)
    recorded = [json.loads((run / "config.json").read_text())["loss_chunk"] for run in (one, two)]
    assert recorded == [tokens.CHUNK, CHUNK]  # the setting is the run's record, as every other
    assert len(a) == len(b) == STEPS and all(r["method"] > 0 for r in b)  # TES reads the chunked CE
    for key in ("loss", "task", "method", "grad_norm"):
        torch.testing.assert_close(torch.tensor([r[key] for r in b]), torch.tensor([r[key] for r in a]),
                                   rtol=1e-5, atol=1e-7, msg=key)
    x, y = (load_file(run / "checkpoints" / "epoch-1" / "adapter.safetensors") for run in (one, two))
    assert x.keys() == y.keys()
    diffs = torch.cat([(y[k] - x[k]).abs().flatten() for k in x])
    assert diffs.max() <= 2 * LR * STEPS and (diffs > 1e-6).float().mean() <= 0.001
