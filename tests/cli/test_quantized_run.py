"""A --quantize nf4 run read back as any run is: --resume RUN, evaluate, the peft adapter on the original base,
and export --merged into the dequantised base."""
import json

import pytest
import torch

pytest.importorskip("torchao")  # the quant extra (and the test extra)

from minimoe.cli import train  # noqa: E402
from minimoe.core.adaptation.quantized import is_quantized  # noqa: E402
from minimoe.loading.checkpoint import from_pretrained  # noqa: E402
from minimoe.making.tiny import tiny_checkpoint  # noqa: E402
from minimoe.runs.adapters import load_adapter  # noqa: E402
from tests.kill import killed_after  # noqa: E402

FLAGS = ["--model", "tiny", "--quantize", "nf4", "--method", "ce", "--max-train-examples", "16", "--batch-size", "8",
         "--epochs", "2", "--no-test-eval", "--quiet", "--lora-dropout", "0"]


@pytest.mark.parametrize("embedding", [[], ["--quantize-embedding"]])
def test_a_quantized_run_resumes_evaluates_and_exports(tmp_path, embedding):
    """With --quantize-embedding the embedding's table is packed in training, in evaluation and in the merged export's
    dequantised base alike (the export's logits are the packed model's)."""
    flags = ["--out-dir", str(tmp_path), "--run-name", "q", "--data-dir", str(tmp_path / "splits"), *FLAGS, *embedding]
    with pytest.raises(SystemExit, match="stopped after epoch 1"), killed_after(epochs=1):
        train.main(flags)
    train.main(["--resume", str(tmp_path / "q")])  # every setting, --quantize among them, from config.json
    run = tmp_path / "q"
    assert json.loads((run / "config.json").read_text())["quantize"] == "nf4"
    assert (run / "checkpoints" / "epoch-2" / "adapter.safetensors").is_file()

    from minimoe.runs.eval_run import load_evaluation
    evaluation = load_evaluation(adapter=run, max_examples=2, data_dir=tmp_path / "splits", device="cpu",
                                 dtype="float32")
    packed = evaluation.model
    assert any(is_quantized(m) for m in packed.modules())  # scored on the base it trained on
    assert is_quantized(packed.model.embed_tokens) == bool(embedding)
    assert json.loads((run / "config.json").read_text())["quantize_embedding"] == bool(embedding)

    # The adapter's base digest is the checkpoint's: it loads onto the original, unquantized base.
    load_adapter(from_pretrained(tiny_checkpoint()), run / "checkpoints" / "epoch-2")

    # --merged: the dequantised base plus the LoRA delta, a dense checkpoint computing what the packed model does.
    from minimoe.integrations.hf_export import export_merged_adapter
    merged = from_pretrained(export_merged_adapter(run, tmp_path / "merged"))
    assert not any(is_quantized(m) for m in merged.modules())
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, packed.eval()(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("flags,message", [
    (["--quantize", "mxfp4"], "--quantize mxfp4 keeps released MXFP4 experts packed, as gpt_oss stores them; this model is olmoe"),
    (["--model", "tiny:gpt_oss", "--quantize", "mxfp4", "--shard", "fsdp"],
     "--quantize mxfp4 with --shard fsdp is not supported"),
    (["--quantize", "nf4"], r'needs torchao, which is not installed: pip install -e "\.\[quant\]"'),
])
def test_bad_quantize_settings_stop_before_any_run_folder(tmp_path, monkeypatch, flags, message):
    if "torchao" in message:
        monkeypatch.setitem(__import__("sys").modules, "torchao", None)  # the library missing
    with pytest.raises(SystemExit, match=message):
        train.main(["--model", "tiny", "--out-dir", str(tmp_path / "runs"), "--run-name", "r", *flags])
    assert not (tmp_path / "runs").exists()
