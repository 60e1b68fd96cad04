"""Answer-choice scoring and training throughput of packed rows, on a real upcycled MoE, CPU.

    python bench/score.py --model FOLDER                       # eval A/B, 500 SciQ test examples, + training
    python bench/score.py --model FOLDER --max-examples 40 --max-train-examples 32 --rounds 1   # smoke run

FOLDER is a Granite-MoE checkpoint with tokenizer.json (the README's upcycled SmolLM2-135M: 4 experts, top-2).
Every measurement runs in a fresh subprocess, so that its peak RSS (ru_maxrss) is its own; rounds are
interleaved (the order rotates each round), the machine's load then hits both sides of a ratio alike.
- eval: `evaluate_split` as evaluate.py runs it (packed rows, diagnostics on, batch 16 examples)
  against an lm-eval-style scorer on transformers' own GraniteMoeForCausalLM: every (prompt, candidate)
  pair a row, rows sorted by length, right-padded batches of 64, log_softmax over the full logits.
  Both read the same folder and the same token ids (`make_choice_batch(..., packed=False)`); wall time
  includes loading. The scores are compared (max |difference| of the mean answer log-probs).
- train: one CE epoch of `train.py --recipe granite` micro-steps (LoRA, step_loss, AdamW) over the
  offline SciQ train examples, per-candidate rows (before) against packed rows (after): tokens fed per
  example, tokens/s, seconds per epoch. No validation or checkpoint writing inside the timed loop.
The Markdown table goes to stdout and bench/results/score.md, the rows to bench/results/score.json.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minimoe.core.task.choices import pad_id  # noqa: E402
from minimoe.core.task.choices import make_choice_batch  # noqa: E402
from minimoe.data.benchmarks import load_split  # noqa: E402
from minimoe.evaluation.accuracy import evaluate_split  # noqa: E402
from minimoe.process_memory import keep_freed_memory  # noqa: E402
from minimoe.loading.checkpoint import from_pretrained
from minimoe.loading.tokenizer import load_tokenizer  # noqa: E402
from bench.common import RESULTS, write_report  # noqa: E402


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def eval_minimoe(args, examples, packed: bool) -> dict:
    t0 = time.perf_counter()
    model, tok = from_pretrained(args.model, dtype=args.dtype), load_tokenizer(args.model)
    t1 = time.perf_counter()
    records, metrics, _ = evaluate_split(model, tok, examples, batch_size=16, packed=packed)
    t2 = time.perf_counter()
    tokens = sum(int(make_choice_batch([ex], tok, 0, packed=packed).attention_mask.sum()) for ex in examples)
    return {"load_s": t1 - t0, "score_s": t2 - t1, "total_s": t2 - t0, "tokens": tokens,
            "accuracy": metrics["accuracy"], "mean_logprobs": [r["logprob_mean"] for r in records]}


def eval_transformers(args, examples, batch_rows: int = 64) -> dict:
    from transformers import GraniteMoeForCausalLM
    t0 = time.perf_counter()
    model = GraniteMoeForCausalLM.from_pretrained(args.model, torch_dtype=getattr(torch, args.dtype)).eval()
    tok = load_tokenizer(args.model)
    t1 = time.perf_counter()
    pad = pad_id(tok)
    rows = []  # (ids, answer length, example, choice)
    for x, ex in enumerate(examples):
        b = make_choice_batch([ex], tok, pad, packed=False)
        for r in range(b.input_ids.shape[0]):
            n = int(b.n_tokens[r])
            rows.append((b.input_ids[r, :int(b.attention_mask[r].sum())].tolist(), n, x, r))
    rows.sort(key=lambda r: -len(r[0]))
    scores = [[0.0] * len(ex.choices) for ex in examples]
    tokens = 0
    with torch.inference_mode():
        for s in range(0, len(rows), batch_rows):
            chunk = rows[s:s + batch_rows]
            T = max(len(r[0]) for r in chunk)
            ids = torch.full((len(chunk), T), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), T), dtype=torch.long)
            for i, (r, *_) in enumerate(chunk):
                ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
            tokens += int(mask.sum())
            logp = F.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), dim=-1)  # [R, T, V]
            for i, (r, n, x, c) in enumerate(chunk):
                L = len(r)
                picked = logp[i, L - n - 1:L - 1].gather(-1, ids[i, L - n:L, None])
                scores[x][c] = picked.sum().item() / n
    t2 = time.perf_counter()
    acc = sum(max(range(len(s)), key=s.__getitem__) == ex.answer for s, ex in zip(scores, examples)) / len(examples)
    return {"load_s": t1 - t0, "score_s": t2 - t1, "total_s": t2 - t0, "tokens": tokens, "accuracy": acc,
            "mean_logprobs": scores}


def train_epoch(args, examples, packed: bool) -> dict:
    from minimoe.core.task.step import step_loss
    from minimoe.runs.config import build_config
    from minimoe.runs.training import install_method, loss_settings, make_optimizer
    torch.manual_seed(0)
    model, tok = from_pretrained(args.model, dtype=args.dtype), load_tokenizer(args.model)
    cfg = build_config({"method": "ce", "device": "cpu", "dtype": args.dtype}, "granite")
    method = cfg.method
    install_method(model, cfg)
    optimizer = make_optimizer(model, cfg)
    model.train()
    per_step, tokens, pad = cfg.batch_size * cfg.grad_accum, 0, pad_id(tok)
    t0 = time.perf_counter()
    for s in range(0, len(examples), per_step):
        ids = examples[s:s + per_step]
        micro = [ids[i:i + cfg.batch_size] for i in range(0, len(ids), cfg.batch_size)]
        batches = [make_choice_batch(m, tok, pad, 512, packed=packed) for m in micro]
        counts = {"examples": len(ids), "tokens": 0, "rows": sum(b.input_ids.shape[0] for b in batches)}
        step_loss(model, batches, method, counts, 1, **loss_settings(cfg))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += sum(int(b.attention_mask.sum()) for b in batches)
    seconds = time.perf_counter() - t0
    return {"epoch_s": seconds, "tokens": tokens, "tokens_per_example": tokens / len(examples),
            "tokens_per_s": tokens / seconds}


PARTS = {"eval-packed": lambda a, d: eval_minimoe(a, d["test"], True),
         "eval-rows": lambda a, d: eval_minimoe(a, d["test"], False),
         "eval-transformers": lambda a, d: eval_transformers(a, d["test"]),
         "train-rows": lambda a, d: train_epoch(a, d["train"], False),
         "train-packed": lambda a, d: train_epoch(a, d["train"], True)}


def run_part(args):
    keep_freed_memory()  # as train.py and evaluate.py do; the transformers side gets it too
    torch.set_num_threads(args.threads)
    data = {"test": load_split("sciq", "test", data_dir=args.data_dir)[:args.max_examples],
            "train": load_split("sciq", "train", data_dir=args.data_dir)[:args.max_train_examples]}
    out = PARTS[args.part](args, data)
    out["peak_rss_mib"] = peak_mib()
    print(json.dumps(out))


def spawn(args, part: str) -> dict:
    cmd = [sys.executable, __file__, "--model", args.model, "--part", part, "--data-dir", args.data_dir,
           "--threads", str(args.threads), "--dtype", args.dtype, "--max-examples", str(args.max_examples),
           "--max-train-examples", str(args.max_train_examples)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{part} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def interleave(args, parts: list[str]) -> dict[str, list[dict]]:
    runs = {p: [] for p in parts}
    for r in range(args.rounds):
        for p in parts[r % len(parts):] + parts[:r % len(parts)]:
            runs[p].append(spawn(args, p))
            print(f"round {r + 1} {p}: " + ", ".join(f"{k} {v:.1f}" for k, v in runs[p][-1].items()
                                                      if isinstance(v, float) and k != "accuracy"), file=sys.stderr)
    return runs


def spread(values) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="upcycled Granite-MoE folder with tokenizer.json")
    p.add_argument("--data-dir", default="runs/splits", help="where the SciQ split manifests are built")
    p.add_argument("--max-examples", type=int, default=500, help="SciQ test examples to score (default 500)")
    p.add_argument("--max-train-examples", type=int, default=448, help="SciQ train examples per epoch (default 448)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds per comparison")
    p.add_argument("--threads", type=int, default=2, help="torch threads in every measured process")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="both sides' weights (default: %(default)s, as the issue 11 measurement ran)")
    p.add_argument("--skip", default="", help="comma list of: eval, train")
    p.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)  # one measurement, in a subprocess
    args = p.parse_args(argv)
    if args.part:
        return run_part(args)
    lines = [f"model {Path(args.model).name}, {args.dtype}, CPU threads {args.threads}, {args.rounds} interleaved round(s); "
             "median (min-max)", ""]
    result = {}
    if "eval" not in args.skip:
        runs = interleave(args, ["eval-packed", "eval-transformers"])
        a, b = runs["eval-packed"], runs["eval-transformers"]
        ratio = [y["total_s"] / x["total_s"] for x, y in zip(a, b)]
        diff = max(abs(u - v) for x, y in zip(a[0]["mean_logprobs"], b[0]["mean_logprobs"]) for u, v in zip(x, y))
        lines += [f"Scoring {args.max_examples} SciQ test examples (whole process incl. loading):", "",
                  "| scorer | tokens fed | score s | total s | peak RSS MiB | accuracy |", "|---|---|---|---|---|---|"]
        for name, rs in (("minimoe evaluate_split, packed", a), ("transformers GraniteMoe, rows of 64", b)):
            lines.append(f"| {name} | {rs[0]['tokens']} | {spread([r['score_s'] for r in rs])} | "
                         f"{spread([r['total_s'] for r in rs])} | {spread([r['peak_rss_mib'] for r in rs])} | "
                         f"{rs[0]['accuracy']:.3f} |")
        lines += ["", f"speed-up (total, per round): {spread(ratio)}x; max |mean log-prob difference| {diff:.2e}", ""]
        result["eval"] = {k: [{kk: vv for kk, vv in r.items() if kk != "mean_logprobs"} for r in v] for k, v in runs.items()}
        result["eval"]["max_abs_mean_logprob_diff"] = diff
    if "train" not in args.skip:
        runs = interleave(args, ["train-rows", "train-packed"])
        a, b = runs["train-rows"], runs["train-packed"]
        ratio = [x["epoch_s"] / y["epoch_s"] for x, y in zip(a, b)]
        lines += [f"One CE epoch, recipe granite, {args.max_train_examples} SciQ train examples:", "",
                  "| rows | tokens / example | tokens/s | s / epoch | peak RSS MiB |", "|---|---|---|---|---|"]
        for name, rs in (("per candidate (before)", a), ("packed (after)", b)):
            lines.append(f"| {name} | {rs[0]['tokens_per_example']:.1f} | {spread([r['tokens_per_s'] for r in rs])} | "
                         f"{spread([r['epoch_s'] for r in rs])} | {spread([r['peak_rss_mib'] for r in rs])} |")
        lines += ["", f"speed-up per epoch (per round): {spread(ratio)}x", ""]
        result["train"] = runs
    write_report("\n".join(lines), "score")
    (RESULTS / "score.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
