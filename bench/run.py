"""minimoe against transformers (4.57, eager and sdpa) on identical random weights, CPU.

    python bench/run.py                 # everything that fits in ~10 minutes per item
    python bench/run.py --quick         # bf16, smaller batches, fewer rounds: a few minutes
    python bench/run.py --items forward,moe --families olmoe --dtypes bf16

Each item builds (once, under bench/checkpoints/) a random minimoe model at the real widths, expert
counts and top-K of OLMoE-1B-7B or Granite-3.1-3B-A800M with fewer layers, saves it in the official
layout, and loads it with both `minimoe.from_pretrained` and `AutoModelForCausalLM.from_pretrained`.
Timings are interleaved rounds (see bench/common.py); ratios are per-round medians with their range.
The Markdown table goes to stdout and bench/results/<name>.md, the rows to bench/results/<name>.json.
The full-size loading and 24 GB items live in bench/load.py (they take longer).
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common  # noqa: E402
from bench.common import Row, interleaved  # noqa: E402
from minimoe.process_memory import keep_freed_memory  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def models(family, layers, dtype, train=False):
    folder = common.random_checkpoint(family, layers)
    ours, hf = common.load_ours(folder, dtype), common.load_hf(folder, dtype, "eager")
    for m in (ours, hf):
        m.train(train)
        m.requires_grad_(train)
    return ours, hf


def hf_call(hf, attn, fn):
    def run():
        common.set_attn(hf, attn)
        return fn()
    return run


def pick_baseline(timing):
    """The faster of transformers eager and sdpa (by median) is the baseline."""
    return min(("hf eager", "hf sdpa"), key=timing.median)


def parity(ours, hf, ids):
    with torch.no_grad():
        a = ours(ids).logits.float()
        b = hf(ids, use_cache=False).logits.float()
    return (a - b).abs().max().item(), (a.argmax(-1) == b.argmax(-1)).float().mean().item()


def against_hf(args, family, dtype_name, *, item, metric, batch, seed, step, note, train=False):
    """One Row of tokens/s: `step` on minimoe against the faster of transformers eager and sdpa.

    Both models load one random checkpoint; step(model, ids, **kw) gives the callable to time on
    batch x args.seq random ids, and note(timing, baseline, ours, hf, ids) the row's note.
    """
    ours, hf = models(family, args.layers, DTYPES[dtype_name], train)
    B, T = batch, args.seq
    ids = torch.randint(2, ours.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))
    t = interleaved({"minimoe": step(ours, ids), "hf eager": hf_call(hf, "eager", step(hf, ids, use_cache=False)),
                     "hf sdpa": hf_call(hf, "sdpa", step(hf, ids, use_cache=False))}, args.rounds, args.warmup)
    base = pick_baseline(t)
    text = note(t, base, ours, hf, ids)
    del ours, hf
    gc.collect()
    tok = B * T
    return [Row(item, f"{family}-{args.layers}L", dtype_name, f"{metric} ({B}x{T})",
                tok / t.median("minimoe"), tok / t.median(base), base, *_ratio(t, base), note=text,
                extra={"seconds": t.times})]


# ----------------------------------------------------------------------------- 1. forward

def bench_forward(args, family, dtype_name):
    def fwd(m, ids, **kw):
        @torch.no_grad()
        def run():
            return m(ids, **kw).logits
        return run

    def note(t, base, ours, hf, ids):
        common.set_attn(hf, "eager")  # parity against eager, as models() loads it (the timing switched it)
        diff, agree = parity(ours, hf, ids[:1, :64])
        return (f"logits max|diff| {diff:.2g}, argmax agree {agree:.1%}; {eager_sdpa(t)}; "
                f"round spread {t.spread('minimoe'):.0%}; {best(t, base)}")

    return against_hf(args, family, dtype_name, item="forward", metric="prefill tokens/s", batch=args.batch,
                      seed=1, step=fwd, note=note)


def _ratio(t, base):
    med, lo, hi = t.ratio(base, "minimoe")
    return med, (lo, hi)


def best(t, base):
    return f"best-of-rounds ratio {t.best_ratio(base, 'minimoe'):.2f}x"


def eager_sdpa(t):
    return f"eager/sdpa {t.median('hf eager'):.2f}/{t.median('hf sdpa'):.2f}s"


# ----------------------------------------------------------------------------- 2. train step

def next_token_ce(logits, ids):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def bench_train(args, family, dtype_name):
    def step(m, ids, **kw):
        def run():
            m.zero_grad(set_to_none=True)
            next_token_ce(m(ids, **kw).logits, ids).backward()
            m.zero_grad(set_to_none=True)  # the other model's step should not see these grads' memory
        return run

    def note(t, base, ours, hf, ids):
        return f"fwd+bwd, all weights trainable; {eager_sdpa(t)}; {best(t, base)}"

    return against_hf(args, family, dtype_name, item="train", metric="train tokens/s", batch=args.train_batch,
                      seed=2, step=step, note=note, train=True)


# ----------------------------------------------------------------------------- 4. decoding

def bench_decode(args, family, dtype_name):
    ours, hf = models(family, args.layers, DTYPES[dtype_name])
    rows = [decode_row(args, family, dtype_name, ours, hf, B) for B in args.decode_batches]
    del ours, hf
    gc.collect()
    return rows


def decode_row(args, family, dtype_name, ours, hf, B):
    from minimoe.core.decoder.generate import generate
    ids = torch.randint(2, ours.config.vocab_size, (B, args.prompt), generator=torch.Generator().manual_seed(3))
    n = args.new_tokens
    out = {}

    def mine():
        out["minimoe"] = generate(ours, ids, n)

    def theirs(attn):
        def run():
            common.set_attn(hf, attn)
            out[attn] = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                    do_sample=False, pad_token_id=0, eos_token_id=None)
        return run

    t = interleaved({"minimoe": mine, "hf eager": theirs("eager"), "hf sdpa": theirs("sdpa")}, args.rounds,
                    args.warmup)
    base = pick_baseline(t)
    same = (out["minimoe"] == out["eager"]).all(-1).float().mean().item()
    return Row("decode", f"{family}-{args.layers}L", dtype_name,
               f"new tokens/s (batch {B}, prompt {args.prompt}, {n} new, greedy)",
               B * n / t.median("minimoe"), B * n / t.median(base), base, *_ratio(t, base),
               note=f"identical greedy tokens in {same:.0%} of rows (bf16 ties may differ); {best(t, base)}")


# ----------------------------------------------------------------------------- 6. MoE layer roofline

def expert_flops(T, config):
    N = T * config.num_experts_per_tok
    D, I = config.hidden_size, config.intermediate_size
    return 2 * N * D * 2 * I + 2 * N * I * D


def bench_moe(args, family, dtype_name):
    """One MoEBlock forward on T tokens against dense matmuls of the same (N, in) x (in, out) shapes."""
    from minimoe.core.decoder import model
    from minimoe.core.layers import experts as mm
    dtype = DTYPES[dtype_name]
    config = common.shape(family, 1)
    block = model.MoEBlock(config).to(dtype)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02, generator=g)
    T = args.moe_tokens
    x = torch.randn(1, T, config.hidden_size, generator=g).to(dtype)
    N, D, I = T * config.num_experts_per_tok, config.hidden_size, config.intermediate_size
    a, h = torch.randn(N, D, dtype=dtype), torch.randn(N, I, dtype=dtype)
    w1, w2 = torch.randn(2 * I, D, dtype=dtype), torch.randn(D, I, dtype=dtype)  # [out, in] like nn.Linear

    def moe(grouped):
        @torch.no_grad()
        def run():
            mm.USE_GROUPED_MM = grouped
            block(x)
        return run

    def dense():  # the same two matmuls with one weight for all N rows
        F.linear(a, w1), F.linear(h, w2)

    cands = {"moe": moe(mm.USE_GROUPED_MM), "dense": dense}
    has_grouped = hasattr(F, "grouped_mm")
    if has_grouped:
        cands["moe loop"] = moe(False)
    t = interleaved(cands, args.rounds, args.warmup)
    mm.USE_GROUPED_MM = has_grouped
    flops = expert_flops(T, config)
    best = "moe" if not has_grouped or t.median("moe") <= t.median("moe loop") else "moe loop"
    med, lo, hi = t.ratio("dense", best)
    counts = torch.bincount(block.router(x[0], block.gate(x[0]).float()).experts.flatten(), minlength=config.num_experts)
    note = (f"expert matmul FLOPs only (6*N*D*I, N={N}); path: {'grouped_mm' if best == 'moe' else 'per-expert loop'}"
            + (f" (grouped_mm {flops / t.median('moe') / 1e9:.0f} / loop {flops / t.median('moe loop') / 1e9:.0f} GFLOP/s)"
               if has_grouped else "")
            + f"; rows/expert {counts.min().item()}-{counts.max().item()}")
    return [Row("moe-roofline", f"{family} MoEBlock T={T}", dtype_name, "GFLOP/s (expert matmuls)",
                flops / t.median(best) / 1e9, flops / t.median("dense") / 1e9, "dense matmul, same shapes",
                med, (lo, hi), note=note)]


# ----------------------------------------------------------------------------- 3. LoRA step

def bench_lora(args, family, dtype_name):
    folder = common.random_checkpoint(family, args.layers)
    B, T = args.train_batch, args.seq
    rows, times, peaks = [], {}, {}
    # Peak memory needs one model at a time: each side runs alone in a child process (bench/lora_peft.py).
    from bench.lora_peft import measure_in_child
    res = {side: measure_in_child(side, folder, dtype_name, B, T, args.rounds, args.warmup,
                                   keep=not args.glibc_defaults)
           for side in ("minimoe", "hf+peft")}
    for side, r in res.items():
        times[side], peaks[side] = r["times"], r["peak_bytes"]
    import statistics
    med = lambda s: statistics.median(times[s])  # noqa: E731
    ratios = sorted(a / b for a, b in zip(times["hf+peft"], times["minimoe"]))
    rows.append(Row("lora", f"{family}-{args.layers}L", dtype_name, f"LoRA step tokens/s ({B}x{T}, r=8 q/k/v+experts)",
                    B * T / med("minimoe"), B * T / med("hf+peft"), "hf eager + peft",
                    statistics.median(ratios), (ratios[0], ratios[-1]),
                    note=f"trainable params {res['minimoe']['trainable']:,} vs {res['hf+peft']['trainable']:,}; "
                         f"back to back in children, not interleaved"))
    rows.append(Row("lora", f"{family}-{args.layers}L", dtype_name, "LoRA step peak RSS above weights (GiB)",
                    peaks["minimoe"] / 2**30, peaks["hf+peft"] / 2**30, "hf eager + peft",
                    peaks["hf+peft"] / max(peaks["minimoe"], 1), None,
                    note=f"RSS peak over the steps minus RSS after load + wrap + touching all weights; process peak "
                         f"{(peaks['minimoe'] + res['minimoe']['rss_before']) / 2**30:.2f} vs "
                         f"{(peaks['hf+peft'] + res['hf+peft']['rss_before']) / 2**30:.2f} GiB"))
    return rows


# ----------------------------------------------------------------------------- CLI

ITEMS = {"forward": bench_forward, "train": bench_train, "decode": bench_decode, "moe": bench_moe, "lora": bench_lora}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("what to run")
    g.add_argument("--items", default="forward,train,decode,moe,lora", help="comma list of " + ",".join(ITEMS))
    g.add_argument("--families", default="olmoe,granitemoe", help="comma list: olmoe, granitemoe")
    g.add_argument("--dtypes", default=None, help="comma list: bf16, fp32 (default both; --quick: bf16)")
    g.add_argument("--quick", action="store_true", help="bf16, batch 1x128, 2 rounds, 8 new tokens: a few minutes")
    g.add_argument("--glibc-defaults", action="store_true",
                   help="skip minimoe.process_memory.keep_freed_memory(), which otherwise applies to both sides (and LoRA children)")
    s = p.add_argument_group("sizes")
    s.add_argument("--layers", type=int, default=2, help="decoder layers of the reduced-depth models")
    s.add_argument("--batch", type=int, default=4)
    s.add_argument("--seq", type=int, default=256)
    s.add_argument("--train-batch", type=int, default=2, help="batch of the train and LoRA steps")
    s.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds, after the warm-up")
    s.add_argument("--warmup", type=int, default=2,
                   help="untimed rounds (LoRA: steps) first; a train step's heap takes two to stop growing")
    s.add_argument("--prompt", type=int, default=32, help="decoding prompt length")
    s.add_argument("--new-tokens", type=int, default=32)
    s.add_argument("--decode-batches", default="1,8")
    s.add_argument("--moe-tokens", type=int, default=2048, help="tokens through the MoE layer roofline item")
    o = p.add_argument_group("output")
    o.add_argument("--name", default=None, help="results file stem (default: run-<time> or quick-<time>)")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.train_batch, args.seq, args.rounds, args.new_tokens, args.moe_tokens = 1, 1, 128, 2, 8, 512
        args.decode_batches = "1"
    args.dtypes = args.dtypes or ("bf16" if args.quick else "bf16,fp32")
    args.decode_batches = [int(b) for b in args.decode_batches.split(",")]
    torch.manual_seed(0)
    allocator = "glibc defaults" if args.glibc_defaults else f"keep_freed_memory() -> {keep_freed_memory()}"
    header = (f"Machine: {common.machine()}\n\nCommand: `python bench/run.py {' '.join(argv or sys.argv[1:])}`"
              f"\n\nAllocator (both sides): {allocator}")
    print(header, flush=True)
    rows = []
    for item in args.items.split(","):
        for family in args.families.split(","):
            for dt in args.dtypes.split(","):
                t0 = time.time()
                new = ITEMS[item](args, family, dt)
                rows += new
                for r in new:
                    print(common.markdown([r]).splitlines()[-1], flush=True)
                print(f"[{item} {family} {dt}: {time.time() - t0:.0f}s]", file=sys.stderr, flush=True)
    name = args.name or ("quick-" if args.quick else "run-") + time.strftime("%Y%m%d-%H%M%S")
    path = common.save(rows, name, header)
    print("\n" + common.markdown(rows))
    print(f"\nwritten {path} and .json", file=sys.stderr)


if __name__ == "__main__":
    main()
