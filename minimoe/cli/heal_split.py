"""The command `python -m minimoe.making.heal`: the split test bed healed by distillation from the dense model
(minimoe/making/heal.py, whose docstring is its --help)."""
from __future__ import annotations

import argparse
from dataclasses import asdict

import minimoe.making.heal as heal_module
from minimoe.cli import run_command
from minimoe.loading.checkpoint import RUN_DTYPES
from minimoe.making.heal import HealSettings, STAGES, TEXTS, heal


def main(argv=None):
    d = HealSettings()
    p = argparse.ArgumentParser(prog="python -m minimoe.making.heal", description=heal_module.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("student", help="a split model's folder (with split.json)")
    p.add_argument("out", help="the healed model's folder (replaced whole, atomically)")
    p.add_argument("--teacher", required=True, help="a folder computing the dense model's logits, same tokenizer")
    what = p.add_argument_group("what is trained, on what")
    what.add_argument("--stage", choices=list(STAGES), default=d.stage,
                      help="routers: routers and per-expert output scales; experts: the expert banks and routers; "
                           "both: routers, then experts (default %(default)s)")
    what.add_argument("--tokens", type=int, default=d.tokens, help="training tokens per stage (default %(default)s)")
    what.add_argument("--text", choices=TEXTS, default=d.text,
                      help="prose: the split's fitting documents; generated: the teacher's samples (default %(default)s)")
    what.add_argument("--seed", type=int, default=d.seed, help="text order, prompts, sampling (default %(default)s)")
    how = p.add_argument_group("optimisation")
    how.add_argument("--seq-len", type=int, default=d.seq_len)
    how.add_argument("--batch-rows", type=int, default=d.batch_rows, help="rows per step (default %(default)s)")
    how.add_argument("--router-lr", type=float, default=d.router_lr)
    how.add_argument("--scale-lr", type=float, default=d.scale_lr)
    how.add_argument("--expert-lr", type=float, default=d.expert_lr)
    how.add_argument("--dtype", choices=RUN_DTYPES, default=d.dtype,
                     help="teacher and frozen weights; bf16 is ~2-3x faster on a CPU with bf16 instructions")
    args = p.parse_args(argv)
    settings = HealSettings(**{k: getattr(args, k) for k in asdict(d)})
    try:
        record = heal(args.student, args.out, args.teacher, settings)
    except (OSError, ValueError, KeyError) as e:  # HealError and SplitError are ValueErrors naming the folder
        p.exit(2, f"heal: error: {e}\n")
    for r in record["stages"]:
        print(f"{r['stage']}: probe KL {r['kl_before']:.4f} -> {r['kl_after']:.4f} in {r['steps']} steps")
    print(f"healed {args.student} -> {args.out}")


def command():
    """The console entry point and `python -m minimoe.making.heal`: main, its bad input as one line and exit status 2."""
    run_command(main, "python -m minimoe.making.heal")


if __name__ == "__main__":
    command()
