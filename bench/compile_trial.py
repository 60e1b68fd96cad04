"""torch.compile on the CPU path of the default model: compile time, and step time against eager.

    python bench/compile_trial.py                        # bf16 on a bf16 CPU, 3 rounds
    python bench/compile_trial.py --target experts --rounds 5

The default run's model with its method (TES-IS, recipe granite), as train.py installs it; one
training micro-batch (--examples SciQ train examples, forward + backward, no optimizer step) and
one scoring batch (16 test examples, packed, inference mode). --target picks what is compiled:
`model` (the whole forward, torch.compile(model)) or `experts` (each layer's expert block, the
routed SwiGLU with its grouped LoRA). One process: the compiled copy shares the eager model's
modules, the first compiled call of each kind is timed as its compile, then the rounds alternate
eager and compiled (order rotating), and the outputs are compared. The table goes to stdout and
bench/results/compile-trial.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from minimoe.core.scoring import pad_id  # noqa: E402
from minimoe.core.scoring import forward_choices, make_choice_batch  # noqa: E402
from minimoe.data.benchmarks import load_split  # noqa: E402
from minimoe.loading.allocator import keep_freed_memory  # noqa: E402
from minimoe.loading.checkpoint import from_pretrained, load_tokenizer  # noqa: E402
from minimoe.loading.smollm import smollm_checkpoint  # noqa: E402
from minimoe.runs.config import RECIPES, TrainConfig, method_for  # noqa: E402
from minimoe.runs.folder import pick_dtype  # noqa: E402
from minimoe.runs.training import install_method  # noqa: E402
from bench.common import write_report  # noqa: E402



def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def spread(xs) -> str:
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--target", choices=["model", "experts"], default="model")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--examples", type=int, default=8, help="training micro-batch (default: %(default)s)")
    p.add_argument("--data-dir", default="runs/splits")
    args = p.parse_args(argv)
    keep_freed_memory()
    folder = smollm_checkpoint()
    dtype = pick_dtype(args.dtype, "cpu")
    tok = load_tokenizer(folder)
    model = from_pretrained(folder, dtype=getattr(torch, dtype))
    torch.manual_seed(0)
    cfg = TrainConfig(**RECIPES["granite"], device="cpu", dtype=dtype, pad_token_id=pad_id(tok))
    install_method(model, cfg, method_for(cfg))
    train = make_choice_batch(load_split("sciq", "train", data_dir=args.data_dir)[:args.examples], tok,
                              cfg.pad_token_id, cfg.max_length)
    test = make_choice_batch(load_split("sciq", "test", data_dir=args.data_dir)[:16], tok, cfg.pad_token_id,
                             cfg.max_length)
    blocks = [layer.mlp.experts for layer in model.model.layers]
    eager_forwards = [b.forward for b in blocks]
    if args.target == "model":
        compiled_model = torch.compile(model, dynamic=True)
    else:  # each layer's expert block; one compiled callable per block, made once
        compiled_forwards = [torch.compile(f, dynamic=True) for f in eager_forwards]

    def use(kind):
        """The module to call for `kind`, with each expert block's forward set for it."""
        if args.target == "model":
            return compiled_model if kind == "compiled" else model
        for b, f, c in zip(blocks, eager_forwards, compiled_forwards):
            b.forward = c if kind == "compiled" else f
        return model

    def step(kind):  # forward + backward of the training micro-batch, train mode (dropout: fixed seed)
        m = use(kind)
        model.train()
        torch.manual_seed(1)
        out, logp = forward_choices(m, train)
        loss = -logp.mean()
        loss.backward()
        grads = [q.grad.clone() for q in model.parameters() if q.grad is not None]
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads

    def score(kind):
        m = use(kind)
        model.eval()
        with torch.inference_mode():
            return forward_choices(m, test)[1]

    lines = [f"model {folder.name} in {dtype}, target {args.target}, torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads; training micro-batch {tuple(train.input_ids.shape)}, scoring batch "
             f"{tuple(test.input_ids.shape)}"]
    compile_s = {}
    try:
        compile_s["step"], (c_loss, c_grads) = timed(lambda: step("compiled"))
    except Exception as e:  # torch 2.13: grouped_mm's fake kernel takes bf16 only; the CPU LoRA branch is fp32
        use("eager")
        lines += ["", f"compiling the training step failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}"]
        write_report("\n".join(lines), f"compile-trial-{args.target}")
        return
    compile_s["score"], c_logp = timed(lambda: score("compiled"))
    e_loss, e_grads = step("eager")
    e_logp = score("eager")
    diff = {"loss": (c_loss - e_loss).abs().item(),
            "grads": max((a.float() - b.float()).abs().max().item() for a, b in zip(c_grads, e_grads)),
            "score logp": (c_logp - e_logp).abs().max().item()}
    times = {(k, w): [] for k in ("eager", "compiled") for w in ("step", "score")}
    for r in range(args.rounds):
        for kind in (["eager", "compiled"] if r % 2 == 0 else ["compiled", "eager"]):
            times[kind, "step"].append(timed(lambda: step(kind))[0])
            times[kind, "score"].append(timed(lambda: score(kind))[0])
        print(f"round {r + 1}: " + ", ".join(f"{k} {w} {v[-1]:.2f}" for (k, w), v in times.items()),
              file=sys.stderr, flush=True)
    lines += ["", f"first compiled call (compile + run): step {compile_s['step']:.1f} s, scoring batch "
              f"{compile_s['score']:.1f} s; compiled vs eager: |d loss| {diff['loss']:.2e}, max |d grad| "
              f"{diff['grads']:.2e}, max |d answer log-prob| {diff['score logp']:.2e}", "",
              f"{args.rounds} interleaved rounds, seconds, median [min-max]; load average "
              f"{os.getloadavg()[0]:.1f}", "", "| | eager | compiled | eager / compiled (median) |", "|---|---|---|---|"]
    for w in ("step", "score"):
        e, c = times["eager", w], times["compiled", w]
        lines.append(f"| {w} | {spread(e)} | {spread(c)} | {statistics.median(e) / statistics.median(c):.2f} |")
    write_report("\n".join(lines), f"compile-trial-{args.target}")


if __name__ == "__main__":
    main()
