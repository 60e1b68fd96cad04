"""Which bf16 rounding changes what training sees? One adapter, scaled, scored in fp32 and in bf16 variants.

    python bench/bf16_fidelity.py measure RUN --dtype float32 --out fp32.pt
    python bench/bf16_fidelity.py measure RUN --dtype bfloat16 --out bf16.pt   # under each variant's code
    python bench/bf16_fidelity.py compare fp32.pt bf16.pt [more.pt ...]

`measure` loads RUN's base model in --dtype and RUN's trained adapter (checkpoints/epoch-1), multiplies
every LoRA B by each --scales value (0.1 is about where the default run's B stands after its first
few steps, 1 where it ends), and runs the training objective (minimoe/core/step.py's `step_loss`: task CE + the
method term, in eval mode, so no dropout) on the first --steps optimizer steps of epoch 1's order.
It records the loss and the gradient of every LoRA tensor. Run it under one tree per variant (its
own PYTHONPATH): the variants differ in code, not in flags. `compare` gives, per scale and variant:
- seen: the loss change the adapter causes, L(scale) - L(0), as a share of fp32's; a delta rounded
  away in the forward is a change training does not see (1 = all of it);
- the cosine between the variant's LoRA gradient and fp32's, over all LoRA tensors, and over the
  attention (q, k, v) and expert ones apart.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def measure(args):
    import minimoe
    from minimoe.cli.train import load_data, parse_args, resolve_config
    from minimoe.core.step import step_loss
    from minimoe.runs.adapters import load_adapter
    from minimoe.runs.folder import global_sum
    from minimoe.runs.training import loss_settings, micro_batches

    run = Path(args.run)
    targs = parse_args(["--config", str(run / "config.json"), "--dtype", args.dtype, "--device", "cpu"])
    folder = Path(targs.model)
    model = minimoe.from_pretrained(folder, dtype=getattr(torch, args.dtype))
    cfg, method = resolve_config(targs, model.config)
    data, cfg = load_data(cfg)
    tokenizer = minimoe.load_tokenizer(folder)
    load_adapter(model, run / "checkpoints" / "epoch-1")
    model.eval()
    lora = {n: p for n, p in model.named_parameters() if n.endswith(("lora_A", "lora_B"))}
    trained_B = {n: p.detach().clone() for n, p in lora.items() if n.endswith("lora_B")}
    per_step = cfg.batch_size * cfg.grad_accum
    order = torch.randperm(len(data["train"]), generator=torch.Generator().manual_seed(cfg.seed + 1)).tolist()
    steps = [micro_batches([data["train"][j] for j in order[s * per_step:(s + 1) * per_step]], tokenizer, cfg, 0, 1)
             for s in range(args.steps)]
    result = {"dtype": args.dtype, "scales": {}}
    for scale in [0.0, *args.scales]:
        with torch.no_grad():
            for n, B in trained_B.items():
                lora[n].copy_(B * scale)
        loss, grads = 0.0, {n: torch.zeros_like(p, dtype=torch.float32) for n, p in lora.items()}
        for batches in steps:
            model.zero_grad(set_to_none=True)
            counts = {"examples": per_step, "tokens": global_sum(sum(b.supervised_mask.sum().item() for b in batches)),
                      "rows": global_sum(sum(b.input_ids.shape[0] for b in batches))}
            logs = step_loss(model, batches, method, counts, 1, **loss_settings(cfg))
            loss += logs["task"] + cfg.lambda_ * logs["method"]
            for n, p in lora.items():
                grads[n] += p.grad.float()
        result["scales"][scale] = {"loss": loss / len(steps), "grads": grads}
        print(f"scale {scale}: loss {loss / len(steps):.6f}", file=sys.stderr, flush=True)
    torch.save(result, args.out)


def cosine(a: dict, b: dict, keep) -> float:
    x = torch.cat([a[n].flatten().double() for n in a if keep(n)])
    y = torch.cat([b[n].flatten().double() for n in b if keep(n)])
    return (x @ y / (x.norm() * y.norm())).item()


def compare(args):
    ref, *variants = [torch.load(p) for p in args.files]
    names = [Path(p).stem for p in args.files[1:]]
    base = ref["scales"][0.0]["loss"]
    lines = ["| scale of B | variant | loss | seen (share of fp32's loss change) "
             "| grad cosine to fp32: all | attention | experts |", "|---|---|---|---|---|---|---|"]
    for scale in ref["scales"]:
        r = ref["scales"][scale]
        lines.append(f"| {scale} | fp32 ({Path(args.files[0]).stem}) | {r['loss']:.5f} | 1 | 1 | 1 | 1 |")
        for name, v in zip(names, variants):
            s = v["scales"][scale]
            seen = (s["loss"] - v["scales"][0.0]["loss"]) / (r["loss"] - base) if scale else float("nan")
            cos = [cosine(s["grads"], r["grads"], keep) for keep in
                   (lambda n: True, lambda n: "self_attn" in n, lambda n: "experts" in n)]
            cells = [f"{scale}", name, f"{s['loss']:.5f}", f"{seen:.3f}", *(f"{c:.4f}" for c in cos)]
            lines.append("| " + " | ".join(cells) + " |")
    print("\n".join(lines))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure")
    m.add_argument("run", help="a train.py run folder with checkpoints/epoch-1")
    m.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    m.add_argument("--scales", type=float, nargs="+", default=[0.1, 0.3, 1.0])
    m.add_argument("--steps", type=int, default=2, help="optimizer steps of epoch 1's order to score")
    m.add_argument("--out", required=True)
    c = sub.add_parser("compare")
    c.add_argument("files", nargs="+", help="the fp32 measurement first, then the variants'")
    args = p.parse_args(argv)
    measure(args) if args.command == "measure" else compare(args)


if __name__ == "__main__":
    main()
