"""LoRA adaptation of a sparse MoE with a routing method: the paper's training pipeline.

    python train.py                                   # default: SmolLM2-135M upcycled to 4 experts, SciQ, TES-IS
    python train.py --model tiny                      # offline smoke run: random tiny OLMoE, ARC-Challenge
    python train.py --model tiny:qwen3_moe            # the same on a random tiny model of any family (tiny:<model_type>)
    python train.py --config runs/RUN/config.json --seed 43 # a run's settings again, one of them changed
    python train.py --resume runs/RUN                 # continue a killed run with its recorded settings
    python train.py --model ibm-granite/granite-3.1-3b-a800m-base --recipe granite \\
        --data arc_challenge --method tes --objective is --seed 42
    torchrun --nproc_per_node 2 train.py ...          # data-parallel, same result as one process
    torchrun --nproc_per_node 2 train.py --shard fsdp ... # FSDP2: weights sharded (docs/distributed.md)

Every setting is a field of minimoe/runs/config.py's TrainConfig: its default, or the recipe's
(RECIPES, per backbone), unless a flag or a --config file gives it (flags win over the file);
--help shows both kinds of default.

A run folder (runs/<name>/) holds config.json (every setting, plus the method's label and the
model's config), metrics.jsonl, one checkpoint per epoch (adapter + method heads +
optimizer/scheduler/RNG state; with --save-every-steps N also the latest mid-epoch one,
checkpoints/step-<global step>), selection.json (the validation-NLL selection, fixed before any
test evaluation), eval/test-base/ (the base model before training, with --zero-shot), eval/test/
(the test scoring of the last epoch; eval/test-selected/ for the selected one, see
--test-checkpoint) and train.lock (held by the training process; see minimoe/runs/run_folder.py for the run
folder's rules).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import sys
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import minimoe
from minimoe.atomic import atomic_file
from minimoe.cli import is_tiny, model_path, run_command
from minimoe.core.task.choices import check_max_length, pad_id
from minimoe.core.decoder.family_record import family_of
from minimoe.core.decoder.model import MoEConfig, compile_layers
from minimoe.core.adaptation.packed_embedding import pack_embedding
from minimoe.core.adaptation.quantized import require as require_quantization
from minimoe.data.benchmarks import SPLITS, load_split
from minimoe.data.manifests import check_disjoint, split_sha256
from minimoe.data.chat import TokenRow
from minimoe.data.instruct import encode_splits
from minimoe.data.userdata import resolve_data
from minimoe.evaluation.folders import METRICS, eval_dir
from minimoe.process_memory import keep_freed_memory, limit_kernel_cache
from minimoe.loading.config_json import read_config
from minimoe.loading.hub import resolve_checkpoint
from minimoe.making.smollm import smollm_checkpoint
from minimoe.making.tiny import planned_config
from minimoe.runs.compat import read_run_config, read_settings, settings_of
from minimoe.runs.config import FIELDS, TrainConfig, build_config, differing, flag_name, loaded_settings
from minimoe.runs.device import pick_device, pick_dtype
from minimoe.runs import memory
from minimoe.runs.flags import add_flags
from minimoe.runs.naming import run_name, unread_flags
from minimoe.runs.provenance import provenance
from minimoe.runs.ranks import from_rank0, world
from minimoe.runs.run_folder import claim_run_folder, has_training_output, is_run_folder, run_lock, set_aside
from minimoe.runs.sharding import build_sharded, check_sharding
from minimoe.runs.install import check_install, check_model_settings, install_method, lora_trains, optimizer_class
from minimoe.runs.training import train


def parser() -> argparse.ArgumentParser:
    """Every setting's flag (flags.add_flags, from TrainConfig's fields and the methods' records), and the
    three that say what to do with the run folder."""
    p = argparse.ArgumentParser(prog="train.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = add_flags(p)["run"]
    g.add_argument("--config", metavar="FILE", help="start from the settings in FILE: a run's config.json, or any JSON "
                   "or YAML mapping of TrainConfig fields (minimoe/runs/config.py); flags given beside it override them")
    g.add_argument("--resume", nargs="?", const=True, metavar="RUN", help="continue a run from its latest complete "
                   "checkpoint (epoch or --save-every-steps): `--resume RUN` alone reads every setting from "
                   "RUN/config.json; bare --resume continues the folder the other flags name")
    g.add_argument("--rerun", action="store_true", help="start the run again from scratch: an existing run folder "
                   "is moved aside whole, to <run>.replaced-<UTC time>, not deleted")
    return p


# Flags that are no setting of the run: what to do with its folder; and `typed`, what parse_args read off the
# command line itself.
NOT_SETTINGS = ("resume", "rerun", "config", "typed")


class Unset:
    """A setting the command line did not give (parse_args' namespace starts with one per setting): falsy,
    so that --method-option's action merges over it as over nothing."""

    def __bool__(self):
        return False


UNSET = Unset()


def parse_args(argv=None):
    """The flags, over a --config file's settings or, for `--resume RUN`, the run's own (its config.json,
    of any version: compat.read_settings), over the defaults; flags typed win. The command line is parsed
    once: every setting starts UNSET, so what argparse sets is what was typed (`args.typed`, the settings
    typed off their defaults, for main's warning)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    args = p.parse_args(argv, namespace=argparse.Namespace(**dict.fromkeys(FIELDS, UNSET)))
    typed = {k: v for k, v in vars(args).items() if k in FIELDS and v is not UNSET}
    resume_run = None if args.resume in (None, True) else Path(args.resume)
    if resume_run is not None and args.config is not None:
        raise ValueError("--resume RUN reads the settings of RUN/config.json; pass no --config with it")
    settings = {}
    if resume_run is not None or args.config is not None:
        path = resume_run / "config.json" if resume_run is not None else Path(args.config)
        if resume_run is not None and not path.is_file():
            raise FileNotFoundError(f"--resume {resume_run}: no config.json in it; expected a run folder written by "
                                    f"train.py")
        settings = read_settings(path)
    for key in FIELDS:  # typed, else the file's, else the default; a typed --method-option over the file's
        value = typed.get(key, settings.get(key, p.get_default(key)))
        if key == "method_options" and key in typed and settings.get(key):
            value = {**settings[key], **typed[key]}
        setattr(args, key, value)
    if resume_run is not None:  # the run where it is now
        args.out_dir, args.run_name = str(resume_run.parent), resume_run.name
    args.resume = args.resume is not None
    args.typed = {k: v for k, v in typed.items() if v != p.get_default(k)}
    return args


def resolve_config(args, model_config) -> TrainConfig:
    """The run's TrainConfig, its method resolved once (config.build_config): the recipe's values
    (from the checkpoint's model_type unless --recipe), overridden by every setting given; then what the
    model and the machine decide (pad id, LoRA's targets unless given: the family's, device, dtype)."""
    family = family_of(model_config.model_type)
    settings = {k: v for k, v in vars(args).items() if k not in NOT_SETTINGS}
    cfg = build_config(settings, args.recipe or family.recipe)
    cfg.pad_token_id = pad_id(model_config)
    cfg.lora_targets = cfg.lora_targets or list(family.lora_targets)
    cfg.device = str(pick_device(cfg.device))
    cfg.dtype = pick_dtype(cfg.dtype, cfg.device)
    if cfg.compile and not cfg.device.startswith("cuda"):
        sys.exit(f"train.py: error: --compile needs a CUDA device (this run's is {cfg.device}): on the CPU, torch's "
                 f"compiled grouped_mm takes bf16 only, and the CPU recipe runs its LoRA branches in fp32")
    return cfg


def check_quantization(cfg: TrainConfig, model_config) -> None:
    """--quantize: its library installed (the quant extra), and what install.check_model_settings allows
    (mxfp4 for the families released in it and not with --shard fsdp, NF4's blocks: docs/quantization.md)."""
    try:
        require_quantization(cfg.quantize)
        if cfg.quantize_embedding:
            require_quantization("nf4")  # the table packs in NF4 whatever the base's format
    except ImportError as e:
        sys.exit(f"train.py: error: {e}")
    check_settings(cfg, model_config)


def check_settings(cfg: TrainConfig, model_config) -> None:
    """install.check_model_settings, the one check of a setting against the model that every command
    shares, as train.py's one-line refusal."""
    try:
        check_model_settings(cfg, model_config)
    except ValueError as e:
        sys.exit(f"train.py: error: {e}")


def preflight(args, model_config) -> TrainConfig:
    """The run's settings (resolve_config) and every refusal of them that needs neither the data nor the
    model's weights: the quantization library, the settings against the model (check_model_settings), the
    LoRA targets, layer scope, method options and memory on a meta model (check_install). train.py runs it
    before anything is loaded or built (a tiny model against the config it will have: a refusal leaves no
    weights/tiny-*); the sweep's dry run runs it for each cell."""
    cfg = resolve_config(args, model_config)  # the method, device and dtype are resolved here, once
    if cfg.quantize is not None:
        check_quantization(cfg, model_config)  # the library, the family, no mxfp4 with --shard fsdp
    try:
        optimizer_class(cfg.optim)  # --optim adamw8bit / adamw4bit: torchao installed
    except ImportError as e:
        sys.exit(f"train.py: error: {e}")
    check_settings(cfg, model_config)  # --aux-coef family and the rest
    check_install(model_config, cfg, cfg.device)
    return cfg


def ignored_flags(typed: dict, cfg: TrainConfig, model_config) -> list[str]:
    """The flags typed (`typed`: off their defaults) that change nothing in this run, each with why; train.py
    says so once, and runs (a sweep passes one set of flags after -- to all its rows, so they are not refused):
    a supervision setting of a method that supervises nothing, another method's option, --lora-targets where
    no LoRA trains (router-only tuning; ESFT's full form)."""
    method, notes = cfg.method, []
    if unread := unread_flags(typed, method):
        notes.append(f"{', '.join(unread)} ignored: {method.row} supervises no prediction, so it has no objective "
                     f"nor lambda (TES and ACS do)")
    if others := [flag_name(k) for k in typed.get("method_options") or {} if k not in method.declared]:
        notes.append(f"{', '.join(others)} ignored: options of other methods; {method.row} takes "
                     f"{', '.join(map(flag_name, method.declared)) or 'none'}")
    if typed.get("lora_targets") and not lora_trains(model_config, cfg):
        notes.append(f"--lora-targets ignored: {method.row} trains no LoRA (it stays at its zero start, frozen)")
    return notes


def check_command(argv) -> TrainConfig:
    """What train.main(argv) would refuse before reading data or weights (`preflight`), without running it:
    the sweep's dry run checks each cell's command line with it. SystemExit or ValueError names the refusal."""
    args = parse_args(argv)
    if is_tiny(args.model):
        args.recipe = args.recipe or "tiny"
        return preflight(args, planned_config(args.model))
    return preflight(args, memory.model_config(args.model)[0])  # a folder's or a hub id's config.json alone


def run_record(cfg: TrainConfig, model_config, data: dict, origin: dict) -> dict:
    """config.json: every setting (the configured method as one mapping: its Method.record), what the
    run's readers (evaluate.py, sweep.py, --resume) look up (among them each split's size, train as cut,
    and the sha256 of the manifest it was read from), and what produced it (`origin`:
    minimoe.runs.provenance)."""
    return {**vars(cfg), "method": cfg.method.record(), "label": cfg.method.row,
            "world_size": world()[1], "torch_version": torch.__version__,
            "model_config": model_config.flat() | {"extra": None}, "data_sizes": {s: len(v) for s, v in data.items()},
            "data_sha256": {s: split_sha256(cfg.data, s, cfg.data_dir) for s in data}, "provenance": origin}


def load_data(cfg: TrainConfig) -> tuple[dict, TrainConfig]:
    """The run's splits, and `cfg` with what loading resolved, for config.json: the recipe's training
    count (evaluation then rebuilds the same training population) and, for hub and your own data, the
    folder of the manifests written (evaluate.py and a relaunch read those back as they are; their
    splits.json records where they came from, the field map and the template)."""
    resolved = {}
    folder = resolve_data(cfg.data, cfg.data_dir, field_map=cfg.field_map, revision=cfg.data_revision,
                          prompt_template=cfg.prompt_template, seed=42)  # the same reader as evaluate.py's
    if folder != cfg.data:  # your own rows, now their manifests' folder
        resolved = {"data": folder, "field_map": None, "prompt_template": None, "data_revision": None}
        cfg = replace(cfg, **resolved)
    if Path(cfg.data).is_dir():
        data = {s: load_split(Path(cfg.data) / f"{s}.jsonl") for s in SPLITS}
    else:
        data = {s: load_split(cfg.data, s, data_dir=cfg.data_dir, seed=42, source=cfg.data_source,
                              revision=cfg.data_revision) for s in SPLITS}
        resolved = loaded_settings(cfg)  # the paper's count for this backbone and benchmark; hub: the manifests' folder
    cfg = replace(cfg, **resolved)
    check_disjoint(data, cfg.data)  # a test example seen in training would inflate every score
    if cfg.max_train_examples:
        if len(data["train"]) < cfg.max_train_examples:  # the one request about train that can go unmet
            print(f"train.py: warning: {cfg.data} train has {len(data['train'])} examples, fewer than the "
                  f"{cfg.max_train_examples} asked for (--max-train-examples, or the recipe's count); all are used",
                  file=sys.stderr)
        data["train"] = data["train"][:cfg.max_train_examples]
    return data, cfg


def main(argv=None):
    args = parse_args(argv)
    keep_freed_memory()  # big gradient and logit blocks are reused, not faulted in again every step
    limit_kernel_cache()  # bf16 on the CPU: one compiled kernel per matrix shape, a few hundred kept
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        # gloo beside nccl: global_sum reduces host numbers (counts, logged terms) as CPU tensors
        dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            args.device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
    rank = world()[0]
    if args.model is None:  # the default run: a real model, one epoch of SciQ, its zero-shot score first
        args.model, args.data = str(smollm_checkpoint()), args.data or "sciq"
        args.epochs, args.zero_shot = args.epochs or 1, args.zero_shot is not False
    args.data = args.data or "arc_challenge"
    cfg = None
    if is_tiny(args.model):  # tiny or tiny:<model_type>: the smoke recipe (random weights learn at 2e-3)
        args.recipe = args.recipe or "tiny"
        cfg = preflight(args, planned_config(args.model))  # before the tiny checkpoint is built
        args.model = cfg.model = model_path(args.model)
    folder = resolve_checkpoint(args.model, args.cache_dir, args.model_revision)  # a hub id: its snapshot
    tokenizer = minimoe.load_tokenizer(folder)
    model_config = read_config(folder)
    if cfg is None:
        cfg = preflight(args, model_config)  # before the model is loaded
    else:  # the tiny checkpoint as built: its tokenizer's pad id
        cfg.pad_token_id = pad_id(model_config)
    sharded = cfg.shard == "fsdp"  # then no rank ever holds the whole model (minimoe/runs/sharding.py)
    # In the run's dtype at once: loading fp32 and converting would hold both copies at the peak.
    model = None if sharded else minimoe.from_pretrained(folder, dtype=cfg.dtype, quantize=cfg.quantize,
                                                         device=cfg.device if cfg.quantize else None)
    if cfg.quantize_embedding:  # refused with --shard fsdp (install.check_model_settings)
        pack_embedding(model)
    for note in ignored_flags(args.typed, cfg, model_config):  # flags typed off their defaults, not a --config's
        print(f"train.py: warning: {note}", file=sys.stderr)
    run = Path(cfg.out_dir) / (cfg.run_name or run_name(vars(cfg), cfg.method))  # named by --data as given (sweep.py does so)
    data, cfg = load_data(cfg)  # a bad dataset or manifest fails here, before any run folder exists
    # chat and completion examples become their token rows (the model's chat template), each checked
    data = encode_splits(data, tokenizer, folder, cfg.chat_template, cfg.max_length, cfg.data)
    for split, examples in data.items():  # every setting is checked before the run folder is written
        if not isinstance(examples[0], TokenRow):
            check_max_length(examples, tokenizer, cfg.max_length, f"--max-length, {cfg.data} {split}")
    check_sharding(cfg, world()[1])  # --shard fsdp: torchrun, 2 ranks or more
    if args.resume and args.rerun:
        sys.exit("train.py: error: --resume and --rerun: pass one (continue the run, or start it again)")
    if args.resume and not (run / "config.json").is_file():
        sys.exit(f"train.py: error: --resume: {run} has no config.json; nothing to resume")
    if args.resume and not is_run_folder(run):
        sys.exit(f"train.py: error: --resume: {run} is not a train.py run folder (a model folder?); nothing to resume")
    if run.exists() and not args.resume and not args.rerun:
        sys.exit(f"train.py: error: run folder {run} exists; pass --resume to continue it, --rerun to start it again, "
                 f"or choose another --run-name")
    if args.rerun and run.exists() and rank == 0:
        claim_run_folder(run, resume=True)  # only a run folder is moved aside
        print(f"train.py: --rerun: the previous run is kept in {set_aside(run)}")
    if dist.is_initialized():
        dist.barrier()  # every rank has checked the run folder before rank 0 creates it

    torch.manual_seed(cfg.seed)  # LoRA init and dropout; every rank draws the same init
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    created = rank == 0 and claim_run_folder(run, resume=args.resume)
    try:
        if sharded:  # LoRA and the method installed as one process installs them, then sharded
            model, _ = build_sharded(folder, cfg, lambda m: install_method(m, cfg))
        else:
            model = model.to(device=cfg.device, dtype=getattr(torch, cfg.dtype))
        with rank0_lock(run, rank):  # one process per run folder; rank 0 writes it
            fit(model, tokenizer, data, cfg, run, args, rank, folder)
    except BaseException:
        if created and not has_training_output(run):  # the corrected rerun just works
            shutil.rmtree(run, ignore_errors=True)
            print(f"train.py: removed {run}: the start failed before any training output", file=sys.stderr)
        raise
    if rank == 0:
        print(f"run folder: {run}")
    if dist.is_initialized():
        dist.destroy_process_group()


def stop_every_rank(refusal: str | None, rank: int):
    """Under torchrun every rank stops on rank 0's refusal, not rank 0 alone (the others would go on into
    the collectives, or read another --shard's optimizer state): rank 0 prints it, every rank exits 1. A
    collective: every rank calls it, with rank 0's finding or None."""
    if refusal := from_rank0(refusal):
        sys.exit(refusal if rank == 0 else 1)


@contextmanager
def rank0_lock(run: Path, rank: int):
    """The run folder's lock (folder.run_lock), held by rank 0 inside the block; under torchrun, a lock that
    rank 0 cannot take (another process holds it) stops every rank."""
    if world()[1] == 1:
        with run_lock(run):
            yield
        return
    with ExitStack() as held:
        refusal = None
        if rank == 0:
            try:
                held.enter_context(run_lock(run))
            except OSError as e:
                refusal = f"train.py: error: {e}"
        stop_every_rank(refusal, rank)
        yield


def fit(model, tokenizer, data, cfg: TrainConfig, run: Path, args, rank: int, folder: Path):
    """Inside the run's lock: config.json (checked against the run's on --resume), the zero-shot
    score, training, and the test evaluation. `folder`: the model's checkpoint folder (provenance)."""
    refusal = None
    if rank == 0:
        record = run_record(cfg, model.config, data, provenance(args.model, folder, revision=cfg.model_revision,
                                                                device=cfg.device))
        if args.resume:
            before = read_run_config(run / "config.json")
            changed = changed_settings(before, cfg, record)
            if changed:
                refusal = (f"train.py: error: --resume with a different config: {changed} differ from "
                           f"{run}/config.json; pass --rerun to start the run again with these settings")
            # every launch of the run is kept: the first one's command line and code, then each resume's
            record["earlier_provenance"] = [*before.get("earlier_provenance", []), before.get("provenance")]
    stop_every_rank(refusal, rank)
    if rank == 0:
        if not (args.resume and (run / "selection.json").is_file()):  # a finished run's record stays as it is
            with atomic_file(run / "config.json") as tmp:
                tmp.write_text(json.dumps(record, indent=2, default=str))
        if cfg.zero_shot and not (eval_dir(run, checkpoint="base") / METRICS).is_file():
            from minimoe.runs.eval_run import evaluate_zero_shot  # before LoRA and the method exist
            base = evaluate_zero_shot(run, model, tokenizer, data["test"], cfg)
            print(f"zero-shot test {headline(base)} (base model)")
    if cfg.shard != "fsdp":  # a sharded model was built with them (cli main)
        install_method(model, cfg)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if cfg.compile:
        compile_layers(model)
    steps_run = train(model, tokenizer, data, cfg, run, resume=args.resume)

    def scored(checkpoint: str) -> bool:
        """Scored in full by an earlier call that finished training (a resume after a kill): not again."""
        folder = eval_dir(run, "test", checkpoint)
        path = folder / METRICS
        done = not steps_run and path.is_file() and json.loads(path.read_text()).get("n_examples") == len(data["test"])
        if done:
            print(f"test evaluation in {folder} already done; not run again")
        return done
    if cfg.shard == "fsdp" and not cfg.no_test_eval and rank == 0:
        print(f"train.py: --shard fsdp: the test split is not scored in these processes (rank 0 holds a shard of "
              f"the model); run: {'; '.join(evaluate_commands(run, cfg))}")
    if rank == 0 and not cfg.no_test_eval and cfg.shard != "fsdp":
        from minimoe.runs.eval_run import evaluate_run
        if cfg.test_checkpoint in ("last", "both") and not scored("last"):  # the in-memory model is the last epoch
            metrics = evaluate_run(run, split="test", model=model, tokenizer=tokenizer, examples=data["test"],
                                   quiet=cfg.quiet)
            print(f"test {headline(metrics)} (epoch {cfg.epochs})")
        if cfg.test_checkpoint in ("selected", "both") and not scored("selected"):
            del model  # the selected epoch is loaded afresh from the run folder
            metrics = evaluate_run(run, split="test", checkpoint="selected", batch_size=cfg.eval_batch_size,
                                   device=cfg.device, dtype=cfg.dtype, quiet=cfg.quiet)
            epoch = json.loads((run / "selection.json").read_text())["selected_epoch"]
            print(f"test {headline(metrics)} (validation-selected epoch {epoch})")


def headline(metrics: dict) -> str:
    """The printed score: answer-choice accuracy, or a chat or completion split's loss and perplexity."""
    if "accuracy" in metrics:
        return f"accuracy (mean-token): {metrics['accuracy']:.4f}"
    return f"loss per supervised token: {metrics['loss']:.4f} (perplexity {metrics['perplexity']:.3f})"


def evaluate_commands(run: Path, cfg: TrainConfig) -> list[str]:
    """evaluate.py on the run's test split, as train.py scores it in one process (--test-checkpoint): the
    commands a sharded run prints for it."""
    checkpoints = ("last", "selected") if cfg.test_checkpoint == "both" else (cfg.test_checkpoint,)
    return [shlex.join(["python", "evaluate.py", "--adapter", str(run), "--checkpoint", c, "--split", "test",
                        "--eval-dir", str(eval_dir(run, "test", c))]) for c in checkpoints]


# What config.json records beside the settings (run_record) that changes the trained result; of these,
# keys that older versions did not write are not compared when the run's record lacks them.
RECORDED = ("label", "world_size", "torch_version", "model_config", "data_sizes", "data_sha256")
RECORDED_LATER = ("data_sha256",)


def changed_settings(before: dict, cfg: TrainConfig, now: dict) -> list[str]:
    """What changes the trained result and differs between the run's config.json (`before`, as any version
    wrote it) and this launch (`cfg`, and its record `now`): the settings, both resolved as TrainConfigs
    (config.differing), and what the record holds beside them (the data's sizes and sha256, the model's
    config, the torch version, the world size)."""
    recorded = build_config(settings_of(before), before.get("recipe") or cfg.recipe)
    now = json.loads(json.dumps(now, default=str))  # compared as config.json stores them
    before, now = ({**r, "model_config": model_record(r.get("model_config"))} for r in (before, now))
    return sorted([*differing(recorded, cfg), *(k for k in RECORDED if before.get(k) != now.get(k)
                                               and not (k in RECORDED_LATER and k not in before))])


def model_record(record):
    """A recorded model_config as today's MoEConfig records it: a field added since (head_dim, the router's
    scoring, ...) takes the value the family's config gives it, and the options of a mixer no layer runs
    (recorded for every model before the mixers held their own) are dropped, so an older run's record still
    matches. Anything else (not a model config, or one that no longer builds) is returned as it is."""
    if not isinstance(record, dict) or "model_type" not in record:
        return record
    try:
        config = MoEConfig.from_flat({k: v for k, v in record.items() if k != "extra"})
    except (TypeError, ValueError):
        return record
    return json.loads(json.dumps(config.flat() | {"extra": None}, default=str))


def command():
    """minimoe-train, and python train.py: bad input, corrupt files, a full disk, a locked run folder end in
    one line naming the file or flag, exit status 1."""
    run_command(main, "train.py", status=1)


if __name__ == "__main__":
    command()
