"""The command `python -m minimoe.runs.memory`: what fits where, printed as a table (minimoe/runs/memory.py,
whose docstring is its --help)."""
from __future__ import annotations

import argparse

import torch

import minimoe.runs.memory as memory_module
from minimoe.cli import is_tiny, model_path, run_command
from minimoe.core.decoder.family_record import family_of
from minimoe.core.decoder.model import MoEForCausalLM
from minimoe.core.task.tokens import CHUNK
from minimoe.loading.checkpoint import DTYPES
from minimoe.runs.memory import Estimate, estimate, hub_weights, model_config, stored_weights, table


def main(argv=None) -> Estimate:
    from minimoe.runs.config import build_config
    from minimoe.runs.install import check_model_settings
    p = argparse.ArgumentParser(prog="python -m minimoe.runs.memory", description=memory_module.__doc__.split("\n\n")[0],
                                epilog=memory_module.__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a checkpoint folder, a hub model id, or tiny / tiny:<model_type> (as train.py)")
    p.add_argument("--gpus", type=int, default=1, help="GPUs (torchrun processes)")
    p.add_argument("--gpu-memory", type=float, default=80.0, help="GiB a GPU (default 80)")
    p.add_argument("--shard", choices=["ddp", "fsdp"], default="fsdp", help="train.py's --shard (default fsdp)")
    p.add_argument("--recipe", default=None, help="train.py's recipe (default: the model's family's)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="base weights' dtype")
    for flag in ("--batch-size", "--max-length", "--lora-rank", "--loss-chunk"):
        p.add_argument(flag, type=int, default=None, help=f"train.py's {flag} (default: the recipe's)")
    p.add_argument("--method", default="ce", help="train.py's --method (its heads count as trainable)")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--optim", choices=["adamw", "adamw8bit", "adamw4bit"], default="adamw",
                   help="train.py's --optim: AdamW's moments in fp32, or in 8 or 4 bits (torchao.optim)")
    p.add_argument("--lora-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="train.py's --lora-dtype: the adapters and their gradients in fp32 or bf16")
    p.add_argument("--quantize", choices=["nf4", "mxfp4"], default=None,
                   help="train.py's --quantize: the frozen base in 4 bits (mxfp4: gpt-oss's experts as released)")
    p.add_argument("--quantize-embedding", action="store_true",
                   help="train.py's --quantize-embedding: the embedding's table packed in NF4 too")
    p.add_argument("--data", choices=memory_module.DATA_KINDS, default="choice",
                   help="what the loss scores, for the logits: choice (the recipe's answer-choice benchmarks: the "
                        "candidates' tokens) or chat (chat and completion data: every position)")
    p.add_argument("--answer-tokens", type=int, default=memory_module.ANSWER_TOKENS,
                   help="--data choice: an example's candidates' answer tokens together (default "
                        f"{memory_module.ANSWER_TOKENS}: the largest of the study's benchmarks', 8 examples at a time)")
    args = p.parse_args(argv)
    if args.answer_tokens < 1:
        p.error(f"--answer-tokens {args.answer_tokens}: expected 1 or more")
    if args.gpus < 1:
        p.error(f"--gpus {args.gpus}: expected 1 or more")
    if not args.gpu_memory > 0:
        p.error(f"--gpu-memory {args.gpu_memory:g}: expected a GPU's memory in GiB, more than 0")
    if is_tiny(args.model):  # tiny or tiny:<model_type>, as train.py takes it: the smoke recipe's settings
        args.model, args.recipe = model_path(args.model), args.recipe or "tiny"
    config, folder = model_config(args.model)
    recipe = args.recipe or family_of(config.model_type).recipe
    settings = {"model": args.model, "dtype": args.dtype, "device": "cpu", "method": args.method,
                "shard": args.shard if args.gpus > 1 else "ddp", "batch_size": args.batch_size,
                "max_length": args.max_length, "lora_rank": args.lora_rank,
                "gradient_checkpointing": args.gradient_checkpointing or None, "quantize": args.quantize,
                "optim": args.optim, "lora_dtype": args.lora_dtype, "loss_chunk": args.loss_chunk,
                "quantize_embedding": args.quantize_embedding}
    cfg = build_config(settings, recipe)
    try:
        check_model_settings(cfg, config)  # train.py's own checks: what it refuses is not sized
    except ValueError as e:
        p.error(str(e))
    with torch.device("meta"):
        model = MoEForCausalLM(config).to(DTYPES[cfg.dtype])
    if folder is None:
        total = hub_weights(args.model)
    elif any(folder.glob("*.safetensors")):
        total = stored_weights(folder, DTYPES[cfg.dtype])
    else:  # config.json alone: the parameters the config makes, in the run's dtype
        total = None
    result = estimate(model, cfg, gpus=args.gpus, gpu_memory=int(args.gpu_memory * 2**30),
                      shard=args.shard if args.gpus > 1 else "ddp", weights_total=total, data=args.data,
                      answer_tokens=args.answer_tokens)
    print(f"{args.model}: {args.gpus} GPU(s) of {args.gpu_memory:g} GiB, {args.shard if args.gpus > 1 else 'one process'}"
          f", batch {cfg.batch_size} x {cfg.max_length} tokens, LoRA rank {cfg.lora_rank}, {cfg.dtype}"
          + (f", base in {cfg.quantize}" if cfg.quantize else "")
          + (", embedding in nf4" if cfg.quantize_embedding else "") + f", {cfg.optim}"
          + (", bf16 LoRA" if cfg.lora_dtype == "bfloat16" else "")
          + (", gradient checkpointing" if cfg.gradient_checkpointing else "")
          + (f", loss chunk {cfg.loss_chunk}" if cfg.loss_chunk != CHUNK else "")
          + (f", {args.data} data" + (f" ({args.answer_tokens} answer tokens an example)" if args.data == "choice" else "")))
    print(table(result))
    return result


def command():
    """The console entry point and `python -m minimoe.runs.memory`: main, its bad input as one line and exit status 2."""
    run_command(main, "python -m minimoe.runs.memory")


if __name__ == "__main__":
    command()
