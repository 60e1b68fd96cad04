"""The command `minimoe-upcycle` (= `python -m minimoe.making.upcycle`): a dense Llama (safetensors or GGUF)
upcycled into a Granite-MoE checkpoint (minimoe/making/upcycle.py, whose docstring is its --help)."""
from __future__ import annotations

import argparse

import torch

import minimoe.making.upcycle as upcycle_module
from minimoe.cli import run_command
from minimoe.loading.checkpoint import RUN_DTYPES
from minimoe.making.upcycle import upcycle


def main(argv=None):
    from minimoe.process_memory import keep_freed_memory
    from minimoe.making.split import SplitError, SplitSettings
    d = SplitSettings()
    p = argparse.ArgumentParser(prog="python -m minimoe.making.upcycle", description=upcycle_module.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="a .gguf file, or a LlamaForCausalLM safetensors folder or hub id")
    p.add_argument("out", help="output checkpoint folder (replaced whole, atomically)")
    p.add_argument("--mode", choices=["copy", "split"], default="copy",
                   help="copy: every expert is the dense MLP (exact); split: the neurons divided among the experts "
                        "with a fitted router (minimoe/making/split.py) (default copy)")
    p.add_argument("--experts", type=int, help="experts per layer (default 4 copy, 16 split)")
    p.add_argument("--top-k", type=int, help="experts run per token (default 2 copy, 8 split)")
    p.add_argument("--seed", type=int, default=0, help="router init seed (copy), clustering and text order (split) "
                                                       "(default 0)")
    p.add_argument("--dtype", choices=RUN_DTYPES, help="saved dtype (default: the source's)")
    copy = p.add_argument_group("copy mode")
    copy.add_argument("--noise", type=float, default=0.0,
                      help="symmetry-breaking noise, relative to each matrix's std (default 0: exact upcycling)")
    split = p.add_argument_group("split mode")  # defaults None: a split flag given in copy mode is refused
    split.add_argument("--shared", type=int, help="neurons in every expert, the most important "
                       f"(default {d.shared}; experts must divide intermediate_size - shared)")
    split.add_argument("--fit-tokens", type=int, help=f"tokens of fitting prose (default {d.fit_tokens})")
    split.add_argument("--router-std", type=float, help="per-token std of the router logits across experts; "
                       f"0: a zero router (default {d.router_std})")
    split.add_argument("--no-repair", dest="repair", action="store_false", default=None,
                       help="keep the dense down projections (scaled) instead of refitting them")
    args = p.parse_args(argv)
    split_flags = {"shared": args.shared, "fit_tokens": args.fit_tokens, "router_std": args.router_std,
                   "repair": args.repair}
    split_mode = args.mode == "split"
    if not split_mode and any(v is not None for v in split_flags.values()):
        given = [f"--{k.replace('_', '-')}" if k != "repair" else "--no-repair"
                 for k, v in split_flags.items() if v is not None]
        p.error(f"{', '.join(given)} only apply with --mode split (mode is copy)")
    keep_freed_memory()
    experts = args.experts or (d.num_experts if split_mode else 4)
    top_k = args.top_k or (d.top_k if split_mode else 2)
    defaults = {"shared": d.shared, "fit_tokens": d.fit_tokens, "router_std": d.router_std, "repair": d.repair}
    options = {k: defaults[k] if v is None else v for k, v in split_flags.items()} if split_mode else None
    try:
        out = upcycle(args.source, args.out, num_experts=experts, top_k=top_k, seed=args.seed, noise=args.noise,
                      dtype=getattr(torch, args.dtype) if args.dtype else None, mode=args.mode, split=options)
    except (OSError, ValueError, KeyError) as e:  # UpcycleError and SplitError are ValueErrors; each names the file
        p.exit(2, f"upcycle: error: {e}\n")
    print(f"upcycled ({args.mode}) {args.source} -> {out} ({experts} experts, top-{top_k})")


def command():
    """The console entry point and `python -m minimoe.making.upcycle`: main, its bad input as one line and exit status 2."""
    run_command(main, "python -m minimoe.making.upcycle")


if __name__ == "__main__":
    command()
