"""Export a train.py run's adapter in peft's format (adapter_config.json + adapter_model.safetensors),
or with --merged as a plain checkpoint with the adapter merged into the base weights.

    python export.py runs/olmoe-arc_challenge-ACS-IS-seed42 exported/olmoe-arc-acs
    python export.py runs/<run> OUT --checkpoint selected --model allenai/OLMoE-1B-7B-0924-SFT
    python export.py runs/<run> OUT --merged      # config.json, model*.safetensors, tokenizer files
    python export.py runs/<run> OUT --transformers 5   # for transformers 5.x (its fused experts)

Then, with peft and transformers installed:
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), OUT)
or, for --merged, with transformers alone (or any server that loads the base model):
    model = AutoModelForCausalLM.from_pretrained(OUT)
Runs of a method that routes natively (CE, ACS) export, with or without affinity tuning; the others are
refused, saying why (their heads change the routing function: routing.Method.not_exportable). See
minimoe/integrations/hf_export.py for the layout.
"""
from __future__ import annotations

import argparse

from minimoe.cli import model_path, old_name, run_command
from minimoe.integrations.hf_export import export_merged_adapter, export_peft
from minimoe.runs.config import MODEL_HELP


def main(argv=None):
    p = argparse.ArgumentParser(prog="export.py", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("adapter", metavar="RUN",
                   help="a run folder written by train.py, or one adapter folder (RUN/checkpoints/epoch-N)")
    p.add_argument("out", help="output folder for adapter_config.json + adapter_model.safetensors, or with --merged "
                               "the merged checkpoint (replaced whole)")
    p.add_argument("--merged", action="store_true", help="write the base model with the adapter merged in (official "
                   "layout, the base's dtype and tokenizer files) instead of a peft adapter")
    p.add_argument("--transformers", type=int, choices=(4, 5), help="the transformers major version that will load "
                   "the peft adapter: 5 holds routed experts fused, as 3-D parameters that peft adapts by name "
                   "(target_parameters); 4.57 most as per-expert modules (default: 4 for a family transformers 4.57 "
                   "holds, else 5). An adapter loads right only on the version it was written for")
    p.add_argument("--checkpoint", choices=("last", "selected"),
                   help="for a run folder: 'last' (default, the paper's endpoint) or 'selected' (minimum validation NLL)")
    p.add_argument("--model", help=f"base_model_name_or_path to write, or with --merged the base to merge into: "
                                   f"{MODEL_HELP} (default: the model the adapter was trained on, as recorded with it)")
    p.add_argument("--allow-other-base", action="store_true",
                   help="with --merged: merge into a --model whose weights differ from the ones the adapter was "
                        "trained on (same shapes); refused by default")
    old_name(p, "--base-model", "--model")
    args = p.parse_args(argv)
    if args.merged and args.transformers:
        p.error("--transformers names the transformers a peft adapter is written for; a --merged checkpoint, in the "
                "official layout, loads in 4.57 and 5 alike")
    base_model = model_path(args.model)
    try:
        if args.merged:
            out = export_merged_adapter(args.adapter, args.out, checkpoint=args.checkpoint, base_model=base_model,
                                        allow_other_base=args.allow_other_base)
            print(f"merged checkpoint: {out}")
        else:
            out = export_peft(args.adapter, args.out, checkpoint=args.checkpoint, base_model=base_model,
                              transformers=args.transformers)
            print(f"peft adapter: {out}")
    except (OSError, ValueError, KeyError) as e:  # bad input, a refused OUT, a full disk: one line naming the file
        p.exit(2, f"export.py: error: {e}\n")


def command():
    """minimoe-export, and python export.py (main already ends bad input in one line, exit status 2)."""
    run_command(main, "export.py")


if __name__ == "__main__":
    command()
