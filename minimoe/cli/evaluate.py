"""Evaluate a model, or a trained adapter, on a benchmark split; or tabulate many evaluations.

Example (a finished run: the model and dataset come from RUN/config.json, the adapter from
RUN/checkpoints/epoch-<last_epoch>, the paper's primary endpoint):

    python evaluate.py --adapter runs/granite-arc-TES-IS-seed42 --split test --eval-dir runs/granite-arc-TES-IS-seed42/eval/test

The base model alone (routing diagnostics of its final layer):

    python evaluate.py --model allenai/OLMoE-1B-7B-0924-SFT --data arc_challenge --eval-dir runs/olmoe-native-arc

The paper's accuracy table, mean ± sample std over seeds, from every metrics.json under the folders:

    python evaluate.py report runs/*/eval/test --seeds 42 43 45 --out table.md

Two methods on the same questions, one pair of runs (or evaluation folders) per seed, B against A:

    python evaluate.py compare runs/m-sciq-CE-seed42 runs/m-sciq-TES-IS-seed42 runs/m-sciq-CE-seed43 runs/m-sciq-TES-IS-seed43

Outputs in --eval-dir (written to a temp folder beside it, then swapped in whole; an existing --eval-dir must be
an earlier evaluation, recognised by its .minimoe-written marker, or empty: anything else is refused):
  predictions.jsonl   one line per example: gold, predictions and per-candidate log-probabilities
  metrics.json        accuracy (mean-token, the paper's), accuracy_sum, accuracy_per_char, choice_nll,
                      identity keys for the report, and "diagnostics" per diagnosed MoE layer
  tokens-<split>.npz  per gold-answer-token CE, target id, C_t (and e_hat where the method predicts the error)
  error-prediction-layer<l>.png  such methods only: standardised decile curves, train vs evaluated split
See minimoe/evaluation/accuracy.py for what each number is and the paper equation it follows.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from minimoe.cli import model_path, old_name, run_command
from minimoe.data.benchmarks import DEFAULT_DATA_DIR, SPLITS
from minimoe.evaluation.diagnostics import PAPER_SEEDS
from minimoe.loading.checkpoint import RUN_DTYPES
from minimoe.runs.config import CACHE_DIR_HELP, MODEL_HELP, device
from minimoe.runs.flags import flag_type

EXAMPLES = """examples:
  a finished run (model and data from RUN/config.json; adapter of the last epoch):
    python evaluate.py --adapter runs/granite-arc-TES-IS-seed42 --eval-dir runs/granite-arc-TES-IS-seed42/eval/test
  its validation-NLL-selected epoch instead:
    python evaluate.py --adapter runs/granite-arc-TES-IS-seed42 --checkpoint selected --eval-dir runs/granite-arc-TES-IS-seed42/eval/test-selected
  a base model, 50 examples, on a GPU in bf16:
    python evaluate.py --model allenai/OLMoE-1B-7B-0924-SFT --data arc_challenge --max-examples 50 --dtype bfloat16 --eval-dir runs/olmoe-native-arc
  training curves of several runs on one figure:
    python evaluate.py plot runs/run-a runs/run-b --out curves.png
  the accuracy table (mean ± sample std over seeds) of many evaluations:
    python evaluate.py report runs/*/eval/test --seeds 42 43 45 --out table.md   (more: python evaluate.py report --help)
  B against A on the same questions, one pair per seed (accuracy difference with a bootstrap interval, McNemar p):
    python evaluate.py compare runs/CE-seed42 runs/TES-IS-seed42 runs/CE-seed43 runs/TES-IS-seed43 --out cmp.json
"""


def evaluate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="evaluate.py", description=__doc__.split("\n\n")[0], epilog=EXAMPLES,
                                usage="%(prog)s [--model MODEL] [--adapter ADAPTER] --eval-dir DIR [options]\n"
                                      "       %(prog)s report DIR [DIR ...] [--seeds ...] [--split ...] [--out OUT]\n"
                                      "       %(prog)s compare A B [A B ...] [--out OUT.json]\n"
                                      "       %(prog)s plot RUN [RUN ...] --out PNG",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = p.add_subparsers(dest="command", title="commands", prog="evaluate.py",
                                description="left out: evaluate one model or adapter, with the options below")
    add_report_command(commands)
    add_compare_command(commands)
    add_plot_command(commands)
    what = p.add_argument_group("what to evaluate")
    what.add_argument("--model", help=f"the base: {MODEL_HELP}. May be left out when --adapter is a run folder: "
                                      "its config.json names it")
    what.add_argument("--model-revision", metavar="REV",
                      help="hub branch, tag or commit of the model (default: the run's, else main; metrics.json "
                           "records the commit it resolved to)")
    what.add_argument("--cache-dir", help=CACHE_DIR_HELP)
    what.add_argument("--adapter", type=Path,
                      help="a run folder written by train.py (config.json, checkpoints/, selection.json) or one "
                           "adapter folder (adapter.safetensors + adapter_config.json, e.g. RUN/checkpoints/epoch-2). "
                           "Left out: the base model with native routing")
    what.add_argument("--allow-other-base", action="store_true",
                      help="apply an adapter to base weights other than those it was trained on (same shapes); "
                           "refused by default, since its numbers would not mean what they seem")
    what.add_argument("--checkpoint", choices=("last", "selected"),
                      help="for a run folder: 'last' (default; the final epoch, the paper's primary endpoint) or "
                           "'selected' (minimum validation choice NLL, from selection.json)")
    data = p.add_argument_group("data")
    data.add_argument("--data", help="benchmark name (arc_challenge, arc_easy, openbookqa, sciq, medmcqa; registered "
                                     "splits are built under --data-dir on first use), a folder of train/val/test.jsonl "
                                     "manifests, one split's manifest (a file named <--split>.jsonl in manifest form), "
                                     "or your own data read as train.py reads it (a CSV or JSONL file or folder, a "
                                     "datasets folder, a hub id; with the --field-map and --prompt-template it "
                                     "trained with, the same splits are built). Default with a run folder: the "
                                     "run's data")
    data.add_argument("--field-map", metavar="FIELD=COLUMN,...",
                      help="your own --data's columns, as train.py's --field-map (minimoe/data/userdata.py)")
    data.add_argument("--prompt-template", metavar="FORMAT", help="your own --data's prompt, as train.py's")
    data.add_argument("--chat-template", metavar="FILE", help="chat --data: the jinja2 chat template (default: the "
                      "run's --chat-template, else the model's own)")
    data.add_argument("--generate", type=int, default=0, metavar="N",
                      help="chat or completion --data: also write greedy completions of the first N examples' last "
                           "assistant turn (or completion) to EVAL_DIR/generations.jsonl")
    data.add_argument("--data-revision", metavar="REV", help="your own --data as a hub dataset: the revision to read")
    data.add_argument("--split", default="test", choices=SPLITS, help="split to score (default: %(default)s)")
    data.add_argument("--data-dir", type=Path,
                      help=f"where benchmark manifests live (default: the run's, else {DEFAULT_DATA_DIR})")
    data.add_argument("--max-examples", type=int, metavar="N",
                      help="score only the first N examples (of the train population too); for quick checks")
    data.add_argument("--max-length", type=int, metavar="T",
                      help="longest prompt + candidate in tokens, prompts cut from the left (default: the run's, "
                           "else no limit)")
    out = p.add_argument_group("output")
    # Required here, not by argparse: `report` takes none.
    out.add_argument("--eval-dir", type=Path,
                     help="output folder (required); replaced as a whole only once everything is written, and only "
                          "if it is empty or an earlier evaluation (a run folder, say, is refused)")
    # --out-dir is where train.py and sweep.py make run folders; here it named the evaluation folder itself.
    old_name(out, "--out-dir", "--eval-dir", type=Path)
    old_name(out, "--out", "--eval-dir", type=Path)
    out.add_argument("--quiet", action="store_true", help="no progress bars")
    diag = p.add_argument_group("routing diagnostics")
    diag.add_argument("--train-split-diagnostics", action=argparse.BooleanOptionalAction, default=None,
                      help="also score the train split, for train-vs-evaluated diagnostics and the train moments "
                           "that standardise the e_hat decile curves (default: on for adapters whose method predicts "
                           "the error, off otherwise)")
    compute = p.add_argument_group("compute")
    compute.add_argument("--eval-batch-size", type=int, default=16, metavar="N",
                         help="examples per forward; all their candidates run together (default: %(default)s)")
    old_name(compute, "--batch-size", "--eval-batch-size", type=int, metavar="N")
    compute.add_argument("--per-candidate-rows", action="store_true",
                         help="one row per (prompt, candidate), the reference path; default: one packed row per "
                              "example, its prompt run once")
    compute.add_argument("--device", default="auto", type=flag_type(device),
                         help="auto (cuda if present), cpu, cuda, cuda:1 ... (default: %(default)s)")
    compute.add_argument("--dtype", default="auto", choices=("auto", *RUN_DTYPES),
                         help="model weights and activations; routing math and scores are fp32 either way "
                              "(auto: bfloat16 on CUDA and on CPUs with native bf16 matrix instructions, else float32; "
                              "$MINIMOE_CPU_DTYPE sets the CPU's choice; as "
                              "train.py; default: %(default)s)")
    return p


def add_report_command(commands):
    p = commands.add_parser(
        "report", help="the paper's accuracy table from many evaluations (evaluate.py report --help)",
        description="Gather metrics.json files into the paper's accuracy table: one row per (model, method), one "
                    "column per dataset, mean ± sample std in percent over the seeds. Evaluations without a seed "
                    "(base models) or of another split are skipped. A run folder stands for its test evaluation "
                    "(RUN/eval/test, or RUN/eval/test-selected, as compare reads it) and its zero-shot one; other "
                    "folders under RUN/eval (a re-evaluation) are left out.")
    p.add_argument("paths", nargs="+", type=Path, metavar="DIR", help="metrics.json files, run folders, or folders "
                                                                     "searched recursively")
    p.add_argument("--seeds", type=int, nargs="+", default=list(PAPER_SEEDS),
                   help=f"seeds to include (default: {' '.join(map(str, PAPER_SEEDS))})")
    p.add_argument("--split", default="test", choices=SPLITS, help="split to tabulate (default: %(default)s)")
    p.add_argument("--out", type=Path, help="also write the Markdown table here; an existing file is replaced only "
                                            "if evaluate.py wrote it and it is unchanged since")


def add_compare_command(commands):
    p = commands.add_parser(
        "compare", help="B against A on the same questions: accuracy difference, McNemar p (evaluate.py compare --help)",
        description="Compare method B with control A, paired by question (and by seed, one pair per seed): the "
                    "accuracy difference B - A with a 95% interval from a paired bootstrap over questions and "
                    "seeds (fixed resampling seed), the exact McNemar p per seed (scipy's binomial test on the "
                    "discordant questions), the mean choice-NLL difference and how many questions' predictions "
                    "differ. A run folder stands for the evaluation its report uses (RUN/eval/test, or "
                    "RUN/eval/test-selected where the run was scored at its selected epoch); evaluations of "
                    "different questions are refused. See minimoe/study/compare.py.",
        epilog="example: python evaluate.py compare runs/m-sciq-CE-seed42 runs/m-sciq-ACS-IS-seed42 "
               "runs/m-sciq-CE-seed43 runs/m-sciq-ACS-IS-seed43 --out ce-vs-acs.json")
    p.add_argument("pairs", nargs="+", type=Path, metavar="A B",
                   help="run or evaluation folders, in pairs: control A then method B, one pair per seed")
    p.add_argument("--results", type=Path, metavar="RESULTS", help="A and B are run names in this results folder "
                   "(minimoe/study/results.py), not folders: the comparison from the recorded outcomes alone")
    p.add_argument("--out", type=Path, help="also write the numbers as JSON here; an existing file is replaced only "
                                            "if evaluate.py wrote it and it is unchanged since")


def compare(args) -> dict:
    from minimoe.atomic import check_owned_file, write_owned_file
    from minimoe.study.compare import compare_paths, pair_table
    if args.out is not None:
        check_owned_file(args.out)  # before the work: never a file evaluate.py did not write
    if args.results is not None:
        from minimoe.study.results import compare_runs
        result = compare_runs(args.results, args.pairs)
    else:
        result = compare_paths(args.pairs)
    print(pair_table(result), end="")
    if args.out is not None:
        write_owned_file(args.out, json.dumps(result, indent=2) + "\n")
    return result


def add_plot_command(commands):
    p = commands.add_parser(
        "plot", help="training curves of one or more runs on one figure (evaluate.py plot --help)",
        description="Draw the training curves in RUN/metrics.jsonl (total loss, task and method terms, load-balancing "
                    "loss, learning rate, validation choice NLL) against the optimizer step, one colour per run.")
    p.add_argument("runs", nargs="+", type=Path, metavar="RUN", help="run folders written by train.py")
    p.add_argument("--out", type=Path, required=True, help="the PNG to write")


def report(args) -> str:
    from minimoe.atomic import check_owned_file, write_owned_file
    from minimoe.runs.eval_run import accuracy_report
    if args.out is not None:
        check_owned_file(args.out)  # before the work: replaces only a report it wrote before, never README.md
    table, notes = accuracy_report(args.paths, seeds=args.seeds, split=args.split)
    for note in notes:
        print(note, file=sys.stderr)
    print(table, end="")
    if args.out is not None:
        write_owned_file(args.out, table)
    return table


def own_data(args, parser) -> str | None:
    """--data as train.py reads it (userdata.data_kind, one reader for both): your own rows (a CSV, a JSONL
    of your questions, a hub id) become the manifests train.py builds from them (the same folder for the
    same rows and flags), under the run's --data-dir; a file named <--split>.jsonl in manifest form is
    that split as it is."""
    from minimoe.data.userdata import FieldMapForBenchmark, resolve_data
    if args.data is None:
        if args.field_map is not None or args.prompt_template is not None:
            parser.error("--field-map and --prompt-template apply to your own --data (a file, folder or hub id); "
                         "got no --data")
        return None
    config = args.adapter / "config.json" if args.adapter is not None else None
    run_dir = json.loads(config.read_text(encoding="utf-8")).get("data_dir") if config and config.is_file() else None
    try:
        return resolve_data(args.data, args.data_dir or run_dir or DEFAULT_DATA_DIR, field_map=args.field_map,
                            prompt_template=args.prompt_template, revision=args.data_revision, seed=42,
                            split=args.split)
    except FieldMapForBenchmark as e:
        parser.error(str(e))


def check_options(parser, argv) -> None:
    """An unknown option before the command, or with no command, is named as unknown: argparse would take
    its value for the command ("argument command: invalid choice: '8'") and never name the option."""
    commands = ("report", "compare", "plot")
    head = argv[:next((i for i, a in enumerate(argv) if a in commands), len(argv))]
    known = list(parser._option_string_actions)
    unknown = [flag for a in head if a.startswith("--") and len(a) > 2
               for flag in [a.split("=", 1)[0]] if not any(k.startswith(flag) for k in known)]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} (evaluate.py --help lists the options)")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = evaluate_parser()
    check_options(parser, argv)
    args = parser.parse_args(argv)
    if args.command in ("report", "compare", "plot"):
        defaults = vars(parser.parse_args([]))  # an option before the command would be dropped without a word
        own = {"command", "out", "split"} if args.command == "report" else {"command", "out"}
        before = [k for k, v in defaults.items() if k not in own and getattr(args, k, v) != v]
        if before:
            parser.error(f"{', '.join('--' + k.replace('_', '-') for k in before)} before '{args.command}': those "
                         f"options evaluate one model; {args.command} takes its own, after it")
        if args.command == "compare" and len(args.pairs) % 2:
            parser.error(f"compare: expected pairs A B [A B ...] (control, then method, one pair per seed), "
                         f"got {len(args.pairs)} folders")
        if args.command == "plot":
            from minimoe.runs.tracking import plot_training_curves
            print(f"training curves: {plot_training_curves(args.runs, args.out)}")
            return None
        return report(args) if args.command == "report" else compare(args)
    if args.eval_dir is None:
        parser.error("the following arguments are required: --eval-dir")
    if args.model is None and args.adapter is None:
        parser.error("pass --model, or --adapter with a run folder that names its model")
    for flag, value in (("--eval-batch-size", args.eval_batch_size), ("--max-examples", args.max_examples),
                        ("--max-length", args.max_length)):
        if value is not None and value < 1:
            parser.error(f"argument {flag}: {value}: expected an integer >= 1")
    args.data, args.model = own_data(args, parser), model_path(args.model)
    from minimoe.atomic import check_replaceable
    from minimoe.process_memory import keep_freed_memory, limit_kernel_cache
    from minimoe.runs.eval_run import load_evaluation, score  # after argument checks: torch takes seconds to import
    keep_freed_memory()  # each batch's logits block is reused, not faulted in again
    limit_kernel_cache()  # bf16 on the CPU: one compiled kernel per matrix shape, a few hundred kept
    check_replaceable(args.eval_dir, "evaluation")  # never replace a run, runs/ or an adapter; fail before loading
    evaluation = load_evaluation(
        base_model=args.model, adapter=args.adapter, checkpoint=args.checkpoint, data=args.data, split=args.split,
        data_dir=args.data_dir, max_examples=args.max_examples, max_length=args.max_length,
        batch_size=args.eval_batch_size, packed=not args.per_candidate_rows,
        train_split_diagnostics=args.train_split_diagnostics, device=args.device, dtype=args.dtype,
        model_revision=args.model_revision, cache_dir=args.cache_dir, allow_other_base=args.allow_other_base,
        chat_template=args.chat_template, generate=args.generate)
    metrics = score(evaluation, args.eval_dir, quiet=args.quiet)
    if "accuracy" not in metrics:  # chat or completion data
        print(f"{metrics['method']} on {metrics['dataset']} {metrics['split']} ({metrics['n_examples']} examples, "
              f"{metrics['supervised_tokens']} supervised tokens): loss {metrics['loss']:.4f}, perplexity "
              f"{metrics['perplexity']:.3f} -> {args.eval_dir}")
        return metrics
    print(f"{metrics['method']} on {metrics['dataset']} {metrics['split']} ({metrics['n_examples']} examples): "
          f"accuracy {metrics['accuracy']:.4f} (sum {metrics['accuracy_sum']:.4f}, per-char "
          f"{metrics['accuracy_per_char']:.4f}), choice NLL {metrics['choice_nll']:.4f} -> {args.eval_dir}")
    return metrics


def command():
    """minimoe-eval, and python evaluate.py: bad input, a refused --eval-dir, a full disk end in one line naming
    the file, exit status 2."""
    run_command(main, "evaluate.py")


if __name__ == "__main__":
    command()
