"""Where the default run's time goes: torch.profiler over one training step and one scoring batch.

    python bench/profile_default.py                          # bf16 and fp32, top ten ops each
    python bench/profile_default.py --dtypes float32 --top 20

The default run's model (weights/smollm2-135m-moe, built on first use) with its method (TES-IS,
recipe granite: LoRA r8 on q, k, v and the experts), as train.py installs it. "train step" is one
micro-batch of 8 SciQ train examples, forward and backward, plus AdamW's step; "scoring batch" is
one evaluate_split batch of 16 test examples (packed rows, diagnostics on). Each is run --warmup
times (2) before the profiled run, so that the allocator's heap and oneDNN's kernel cache are warm.
The tables (self CPU time per op, its share of the profiled total) go to stdout and
bench/results/profile-default.md.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minimoe.core.scoring import pad_id  # noqa: E402
from minimoe.core.scoring import make_choice_batch  # noqa: E402
from minimoe.core.step import step_loss  # noqa: E402
from minimoe.data.benchmarks import load_split  # noqa: E402
from minimoe.evaluation.accuracy import evaluate_split  # noqa: E402
from minimoe.loading.allocator import keep_freed_memory  # noqa: E402
from minimoe.loading.checkpoint import from_pretrained, load_tokenizer  # noqa: E402
from minimoe.loading.smollm import smollm_checkpoint  # noqa: E402
from minimoe.runs.config import RECIPES, TrainConfig, method_for  # noqa: E402
from minimoe.runs.training import install_method, loss_settings, make_optimizer  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def top_ops(prof, n: int) -> tuple[float, list[tuple[str, float, int]]]:
    """(total self CPU seconds, [(op, seconds, calls)] of the n largest)."""
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events) / 1e6
    events.sort(key=lambda e: -e.self_cpu_time_total)
    return total, [(e.key, e.self_cpu_time_total / 1e6, e.count) for e in events[:n]]


def profiled(fn, warmup: int):
    for _ in range(warmup):
        fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return prof


def table(title: str, prof, n: int) -> str:
    total, ops = top_ops(prof, n)
    lines = [f"**{title}**: {total:.2f} s self CPU in all", "", "| op | s | share | calls |", "|---|---|---|---|"]
    lines += [f"| `{name}` | {s:.3f} | {s / total:.1%} | {calls} |" for name, s, calls in ops]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="default: the default run's model, weights/smollm2-135m-moe")
    p.add_argument("--dtypes", default="bfloat16,float32", help="comma list (default: %(default)s)")
    p.add_argument("--top", type=int, default=10, help="ops per table (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="unprofiled runs first (default: %(default)s)")
    p.add_argument("--data-dir", default="runs/splits", help="where the SciQ split manifests are built")
    args = p.parse_args(argv)
    keep_freed_memory()  # as train.py does
    folder = args.model or str(smollm_checkpoint())
    tok = load_tokenizer(folder)
    train = load_split("sciq", "train", data_dir=args.data_dir)[:8]
    test = load_split("sciq", "test", data_dir=args.data_dir)[:16]
    out = [f"model {Path(folder).name}, torch {torch.__version__}, {torch.get_num_threads()} threads"]
    for dtype in args.dtypes.split(","):
        torch.manual_seed(0)
        cfg = TrainConfig(**RECIPES["granite"], device="cpu", dtype=dtype, pad_token_id=pad_id(tok))
        model = from_pretrained(folder, dtype=getattr(torch, dtype))
        method = method_for(cfg)
        install_method(model, cfg, method)
        optimizer = make_optimizer(model, cfg, method)
        batch = make_choice_batch(train, tok, cfg.pad_token_id, cfg.max_length)
        counts = {"examples": len(train), "tokens": int(batch.supervised_mask.sum()), "rows": batch.input_ids.shape[0]}

        def train_step():
            model.train()
            step_loss(model, [batch], method, counts, 1, **loss_settings(cfg))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        out.append(table(f"{dtype}, train step (8 examples, {int(batch.attention_mask.sum())} tokens)",
                         profiled(train_step, args.warmup), args.top))
        print(out[-1], flush=True)
        out.append(table(f"{dtype}, scoring batch (16 examples)",
                         profiled(lambda: evaluate_split(model, tok, test, batch_size=16), args.warmup), args.top))
        print(out[-1], flush=True)
        del model, optimizer
    text = "\n\n".join(out) + "\n"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "profile-default.md").write_text(text)


if __name__ == "__main__":
    main()
