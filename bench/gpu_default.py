"""bench/gpu.py's default stage: the default run's epoch (train.py, eager and --compile) and the scoring of the 500
SciQ test questions, on the default model: its weights, or random weights of its shape for a folder that holds only
its config.json and tokenizer files (`default_model`: timing only)."""
from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.gpu_common import Budget, random_model, row, timed
from minimoe.loading.checkpoint import from_pretrained, save_pretrained


def default_model(folder: Path, device) -> tuple[Path, str]:
    """The default model's folder, or for one holding only config.json and tokenizer files, a temporary
    folder with random weights of its shape beside a copy of them (timing only)."""
    if any(folder.glob("*.safetensors")):
        return folder, "trained weights"
    from minimoe.loading.config_json import read_config
    out = Path(tempfile.mkdtemp())
    save_pretrained(random_model(read_config(folder), device), out)
    for f in folder.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, out / f.name)
    return out, "random weights of its shape (timing only)"


def default_run(device, folder: Path, budget: Budget):
    """The default run's epoch (train.py, the step seconds in metrics.jsonl) and the scoring of the 500
    SciQ test questions, on the default model."""
    folder, weights = default_model(folder, device)
    row("default run", folder.name, "weights", note=weights)
    from minimoe import load_tokenizer
    from minimoe.data.benchmarks import load_split
    from minimoe.evaluation.accuracy import evaluate_split
    examples = load_split("sciq", "test", data_dir=Path(tempfile.mkdtemp()) / "splits")
    model = from_pretrained(folder, dtype=torch.bfloat16).to(device)
    tokenizer = load_tokenizer(folder)
    score = lambda: evaluate_split(model, tokenizer, examples, batch_size=64, device=device, diagnostics=False)  # noqa: E731
    times = timed(score, device, steps=3, warmup=1)
    row("default run", folder.name, f"score {len(examples)} SciQ test questions, s", statistics.median(times),
        note="bf16, batch 64; target <= 2 s")
    model = None  # free the GPU for train.py
    for flags in ([], ["--compile"]):
        if budget.left() < 90:
            row("default run", folder.name, f"epoch {' '.join(flags)}: skipped", note="time budget spent")
            continue
        with tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, str(Path(__file__).resolve().parents[1] / "train.py"), "--model", str(folder),
                   "--data", "sciq", "--epochs", "1", "--no-zero-shot", "--no-test-eval", "--quiet",
                   "--device", str(device), "--out-dir", out, "--run-name", "r", *flags]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(60, budget.left()))
            if proc.returncode:
                raise RuntimeError(f"train.py {' '.join(flags)} failed: {proc.stderr[-1500:]}")
            steps = [json.loads(line) for line in open(Path(out) / "r" / "metrics.jsonl")]
            epoch = sum(r["seconds"] for r in steps if r["kind"] == "step")
            row("default run", folder.name, f"epoch s (sum of step seconds) {' '.join(flags)}".strip(), epoch,
                note=f"process wall {time.perf_counter() - t0:.0f} s; target <= 5 s")
