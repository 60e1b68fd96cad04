"""Where the default run's peak memory goes: resident size per phase of `python train.py`, in one process.

    python bench/memory_phases.py                      # the default run's phases (auto: bf16 on a native-bf16 CPU)
    python bench/memory_phases.py --dtype bfloat16 --steps 4

The phases are train.py's, run through its own functions on the default run's settings (SciQ,
TES-IS, recipe granite): load the model, the zero-shot test scoring (500 questions, diagnostics
on), LoRA + method + AdamW, the training steps (--steps, default all 28 of the epoch, in the
epoch's order), the validation, the test scoring with its train population (TES predicts the
error, so evaluation scores the 448 training examples too). Per phase: the resident size before it,
its peak (Linux's VmHWM, reset before each phase through /proc/self/clear_refs) and after it. With
keep_freed_memory() (train.py calls it) freed memory stays in the process, so the run's peak is the
largest phase peak, and a phase's rise over the resident size it started from is what it adds.

Attributed alongside: the weights' and the trainable state's bytes (parameters, gradients, AdamW's
two moments), and for the largest training micro-batch the tensors autograd saves for backward (a
saved_tensors_hooks count, each storage once) and the LM head's fp32 logits. The table goes to
stdout and bench/results/memory-phases.md.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from minimoe.loading.allocator import keep_freed_memory, limit_kernel_cache  # noqa: E402
from bench.common import write_report  # noqa: E402

GiB = 2**30


def status(field: str) -> float:
    """A /proc/self/status size in GiB (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024 / GiB
    raise KeyError(field)


class Phases:
    def __init__(self):
        self.rows = []

    def __call__(self, name, fn, *a, **kw):
        before = status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)
        t0 = time.perf_counter()
        result = fn(*a, **kw)
        self.rows.append((name, before, status("VmHWM"), status("VmRSS"), time.perf_counter() - t0))
        print(f"{name}: rss {before:.2f} -> peak {self.rows[-1][2]:.2f}, after {self.rows[-1][3]:.2f} GiB, "
              f"{self.rows[-1][4]:.0f} s", file=sys.stderr, flush=True)
        return result


def saved_for_backward(model, batch) -> tuple[float, float]:
    """(GiB autograd saves over one forward of `batch`, GiB of the LM head's fp32 logits): each storage
    once, the model's parameters left out (autograd keeps a reference to them, no copy)."""
    from minimoe.core.scoring import forward_choices
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}  # saved by reference, not new
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in weights:
            storages[s.data_ptr()] = s.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, logp = forward_choices(model, batch)
    logits = out.logits.numel() * 4
    del out, logp
    return sum(storages.values()) / GiB, logits / GiB


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="auto", help="train.py's --dtype (default: %(default)s)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the whole epoch)")
    p.add_argument("--no-zero-shot", action="store_true", help="skip the zero-shot phase")
    p.add_argument("--onednn-cache", choices=["limited", "default"], default="limited",
                   help="limited: allocator.limit_kernel_cache(), as train.py; default: oneDNN's 1024 kernels")
    args = p.parse_args(argv)
    keep_freed_memory()
    if args.onednn_cache == "limited":
        limit_kernel_cache()  # as train.py does
    import minimoe
    from minimoe.evaluation.accuracy import evaluate_split
    from minimoe.loading.smollm import smollm_checkpoint
    from minimoe.runs.folder import pick_device, pick_dtype
    from minimoe.runs.training import install_method, make_optimizer, micro_batches, optimizer_step, score_split
    try:
        import minimoe.cli.train as cli  # once train.py moves into the package
    except ImportError:
        import train as cli

    phases = Phases()
    phases.rows.append(("start (imports)", 0.0, status("VmHWM"), status("VmRSS"), 0.0))
    folder = smollm_checkpoint()
    dtype = pick_dtype(args.dtype, pick_device("auto"))
    targs = cli.parse_args(["--model", str(folder), "--data", "sciq", "--epochs", "1", "--dtype", dtype])
    tok = minimoe.load_tokenizer(folder)
    model = phases("load model", minimoe.from_pretrained, folder, dtype=getattr(torch, dtype))
    cfg, method = cli.resolve_config(targs, model.config)
    data, cfg = cli.load_data(cfg)
    weights = sum(t.numel() * t.element_size() for t in {id(t): t for t in model.state_dict().values()}.values())
    eval_kw = dict(batch_size=cfg.eval_batch_size, max_length=cfg.max_length, packed=cfg.packed)
    if not args.no_zero_shot:
        phases("zero-shot test scoring (500)", evaluate_split, model, tok, data["test"], **eval_kw)
    torch.manual_seed(cfg.seed)
    phases("LoRA + method + AdamW", install_method, model, cfg, method)
    optimizer = make_optimizer(model, cfg, method)
    trainable = [p for g in optimizer.param_groups for p in g["params"]]
    n_trainable = sum(p.numel() for p in trainable)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    model.train()
    per_step = cfg.batch_size * cfg.grad_accum
    order = torch.randperm(len(data["train"]), generator=torch.Generator().manual_seed(cfg.seed + 1)).tolist()
    steps = [[data["train"][j] for j in order[s:s + per_step]] for s in range(0, len(order), per_step)]
    steps = steps[:args.steps] if args.steps else steps
    largest = max((b for s in steps for b in micro_batches(s, tok, cfg, 0, 1)), key=lambda b: b.input_ids.numel())

    def train():
        for i, examples in enumerate(steps):
            optimizer_step(model, micro_batches(examples, tok, cfg, 0, 1), len(examples), optimizer, scheduler,
                           cfg, method, 1, i + 1)
    phases(f"training ({len(steps)} steps of {per_step})", train)
    saved, logits = saved_for_backward(model, largest)
    phases(f"validation ({len(data['val'])})", score_split, model, tok, data["val"], cfg)
    phases("test scoring (500)", evaluate_split, model, tok, data["test"], **eval_kw)
    phases(f"train population scoring ({len(data['train'])})", evaluate_split, model, tok, data["train"], **eval_kw)

    R, T = largest.input_ids.shape
    lines = [f"oneDNN kernel cache {os.environ.get('LRU_CACHE_CAPACITY', 'default (1024)')}; "
             f"model {folder.name} in {dtype}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
             f"load average {os.getloadavg()[0]:.1f}", "",
             "| phase | RSS before GiB | peak GiB | RSS after GiB | s |", "|---|---|---|---|---|"]
    lines += [f"| {n} | {b:.2f} | {h:.2f} | {a:.2f} | {s:.0f} |" for n, b, h, a, s in phases.rows]
    lines += ["", f"- weights: {weights / GiB:.2f} GiB ({dtype})",
              f"- trainable: {n_trainable / 1e6:.2f} M parameters; fp32 values + gradients + AdamW moments "
              f"{16 * n_trainable / GiB:.3f} GiB",
              f"- largest training micro-batch: {R} rows x {T} tokens ({int(largest.attention_mask.sum())} real); "
              f"autograd saves {saved:.2f} GiB for its backward; its LM-head logits [{largest.target.numel()}, "
              f"{model.config.vocab_size}] in fp32 are {logits:.3f} GiB"]
    write_report("\n".join(lines), f"memory-phases-{dtype}-{args.onednn_cache}")


if __name__ == "__main__":
    main()
