"""Peak RSS of LoRA steps on the CPU: a bf16 base against an NF4 one, AdamW in fp32 against 8 bits.

    python bench/qlora_rss.py --make            # a random 0.69 GB bf16 checkpoint (OLMoE, 6 layers of 16 experts)
    python bench/qlora_rss.py                   # bf16 + adamw, bf16 + adamw8bit, nf4 + adamw, nf4 + adamw8bit

Each side runs in a fresh process (`--child BASE OPTIM`): load (keep_freed_memory on, as train.py), LoRA rank 8 on
q, k, v, o and the experts, two steps of 2 x 256 tokens under bf16 autocast, the loss over every position. Peak RSS
is ru_maxrss less its value right after the imports. torchao's optimizer update runs eagerly (its torch.compile
of each parameter shape takes minutes on this CPU): its transients are those of the eager update.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

FOLDER = Path("weights/bench-qlora-rss")
SIDES = [("bf16", "adamw"), ("bf16", "adamw8bit"), ("nf4", "adamw"), ("nf4", "adamw8bit")]


def maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def make():
    import torch
    from minimoe.core.decoder.model import MoEForCausalLM
    from minimoe.loading.checkpoint import save_pretrained
    from minimoe.making.tiny import tiny_config
    torch.manual_seed(0)
    config = tiny_config("olmoe", hidden_size=1024, intermediate_size=1024, num_experts=16, num_hidden_layers=6,
                         num_attention_heads=8, num_key_value_heads=8, vocab_size=8192)
    model = MoEForCausalLM(config).to(torch.bfloat16)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    save_pretrained(model, FOLDER)


def child(base: str, optim: str) -> dict:
    import torch
    torch.compile = lambda fn, **options: fn  # torchao's update, eagerly (module docstring)
    from minimoe.loading.checkpoint import from_pretrained
    from minimoe.process_memory import keep_freed_memory
    from minimoe.runs.config import build_config
    from minimoe.runs.training import install_method, make_optimizer
    keep_freed_memory()
    start, t0 = maxrss(), time.perf_counter()
    model = from_pretrained(FOLDER, dtype="bfloat16", quantize=None if base == "bf16" else base)
    loaded, load_s = maxrss(), time.perf_counter() - t0
    cfg = build_config({"method": "ce", "optim": optim, "dtype": "bfloat16",
                        "lora_targets": ["q", "k", "v", "o", "experts"]}, "tiny")
    install_method(model, cfg)
    optimizer = make_optimizer(model, cfg)
    ids = torch.randint(0, model.config.vocab_size, (2, 256), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"base": base, "optim": optim, "loaded_gb": (loaded - start) / 1e9, "peak_gb": (maxrss() - start) / 1e9,
            "load_s": round(load_s, 1)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--make", action="store_true", help="write the checkpoint first")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    if args.make:
        make()
    for base, optim in SIDES:
        done = subprocess.run([sys.executable, __file__, "--child", base, optim], capture_output=True, text=True,
                              check=True)
        print(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
