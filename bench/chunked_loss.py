"""Peak memory of the chunked next-token loss against the plain one, on the CPU (core/task/tokens.py).

    python bench/chunked_loss.py                          # 151,936 vocabulary (Qwen), hidden 2048, 4096 tokens
    python bench/chunked_loss.py --tokens 1024 --modes plain

Each mode runs in its own child process (forward and backward of the CE summed over `--tokens`
supervised positions, fp32, the head a [V, D] Linear): the peak is the child's maximum resident set
(ru_maxrss) less its resident set just before the loss, so the weights and inputs do not count.
The plain loss holds the [tokens, V] logits, their softmax and their gradient; the chunked one a
chunk's at a time. At 4,096 x 151,936 the plain loss needs about 3 x 2.5 GB: over this machine's
share, measure it at fewer tokens (it grows linearly) and say so.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys


def child(mode: str, tokens: int, vocab: int, hidden: int, chunk: int) -> dict:
    import time

    import torch

    from minimoe.core.task.tokens import chunked_token_ce, token_ce
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    h = torch.randn(tokens, hidden, requires_grad=True)
    target = torch.randint(0, vocab, (tokens,))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    t0 = time.perf_counter()
    ce = token_ce(head, h, target) if mode == "plain" else chunked_token_ce(head, h, target, chunk)
    ce.sum().backward()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"mode": mode, "tokens": tokens, "vocab": vocab, "hidden": hidden, "chunk": chunk if mode != "plain" else None,
            "loss_peak_gib": round((peak - before) / 2**20, 3), "seconds": round(seconds, 2),
            "logits_gib": round(tokens * vocab * 4 / 2**30, 3)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--modes", nargs="+", default=["chunked", "plain"], choices=["chunked", "plain"])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.modes[0], args.tokens, args.vocab, args.hidden, args.chunk)))
        return
    for mode in args.modes:
        cmd = [sys.executable, __file__, "--child", "--modes", mode, "--tokens", str(args.tokens), "--vocab",
               str(args.vocab), "--hidden", str(args.hidden), "--chunk", str(args.chunk)]
        print(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
