"""Full-size checkpoints: load time and peak RSS (ours and transformers'), and the 24 GB run.

    python bench/load.py --make                       # write both random full-size checkpoints (~20 GB, minutes)
    python bench/load.py                              # time + peak RSS of each load, 2 fresh processes per side
    python bench/load.py --items fullsize             # OLMoE full size: load, forward, LoRA train step (bf16)

Every measurement runs in a fresh child process (`--child ...`), so one load's memory never hides
another's. Peak RSS is `ru_maxrss` at the end minus `ru_maxrss` right after the imports (the same
interpreter's baseline); it counts the safetensors pages that are mapped and touched, since they
are resident in the process. Wall times read the files from the page cache when they fit in it
(13.8 GB of 24 GB may not stay cached between loads), so they are noted as warm or cold.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common  # noqa: E402
from bench.common import Row  # noqa: E402

GiB = 2**30


def maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class RSSSampler:
    """Highest RSS seen by a 10 ms poll: a peak over one phase, which ru_maxrss (a lifetime max) cannot give."""

    def __init__(self):
        import psutil
        self.proc, self.peak, self._stop = psutil.Process(), 0, threading.Event()

    def __enter__(self):
        self.peak = self.proc.memory_info().rss
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def _poll(self):
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc):
        self._stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)


# ----------------------------------------------------------------------------- children

def child_load(impl: str, folder: str) -> dict:
    import torch
    import transformers  # noqa: F401  (both sides pay for the same imports before the baseline)
    import minimoe  # noqa: F401
    base = maxrss_bytes()
    t0 = time.perf_counter()
    if impl == "minimoe":
        model = common.load_ours(Path(folder), torch.bfloat16)
    else:
        from transformers import AutoModelForCausalLM
        transformers.logging.set_verbosity_error()
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    seconds = time.perf_counter() - t0
    out = {"seconds": seconds, "peak_bytes": maxrss_bytes() - base, **rss_split()}
    # A load may leave weights as untouched file mappings (read lazily by the first forward): reading
    # every weight once gives the time and memory until the model is really in memory.
    with torch.no_grad():
        for p in model.parameters():
            p.max()  # reads every byte, allocates nothing
    out.update(touched_seconds=time.perf_counter() - t0, touched_peak_bytes=maxrss_bytes() - base,
               param_bytes=sum(p.numel() * p.element_size() for p in model.parameters()))
    return out


def rss_split() -> dict:
    """Anonymous (copied) vs file-backed (mapped safetensors pages) resident memory now."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon", "RssFile")):
                key, kb = line.split(":")
                out[key] = int(kb.split()[0]) * 1024
    return out


def child_fullsize(folder: str, seq: int) -> dict:
    """OLMoE at full size in bf16 on this machine: load, one forward, one LoRA train step."""
    import torch
    from minimoe.core.adaptation.lora import add_lora
    base = maxrss_bytes()
    out = {}
    t0 = time.perf_counter()
    model = common.load_ours(Path(folder), torch.bfloat16)
    out["load_s"], out["load_peak_bytes"] = time.perf_counter() - t0, maxrss_bytes() - base
    ids = torch.randint(2, model.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    with RSSSampler() as s, torch.no_grad():
        t0 = time.perf_counter()
        logits = model(ids).logits
        out["forward_s"], out["forward_peak_bytes"] = time.perf_counter() - t0, None
    out["forward_peak_bytes"] = s.peak
    out["forward_finite"] = bool(torch.isfinite(logits.float()).all())
    del logits
    add_lora(model, rank=8, alpha=8, dropout=0.05, targets=("q", "k", "v", "experts"))
    model.train()
    out["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    with RSSSampler() as s:
        t0 = time.perf_counter()
        logits = model(ids).logits
        loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
        loss.backward()
        out["lora_step_s"] = time.perf_counter() - t0
    out["lora_step_peak_bytes"] = s.peak
    out["loss"] = loss.item()
    out["total_peak_bytes"] = maxrss_bytes()
    out["baseline_bytes"] = base
    return out


def run_child(*args, timeout=3600) -> dict:
    cmd = [sys.executable, __file__, "--child", *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:] }"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- items

def disk_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def load_rows(family: str, size: int, res: dict) -> list[Row]:
    """res: side -> [child results]. Memory is the peak once every weight has been read: a lazy
    (memory-mapped) load looks free until the first forward pulls the pages in."""
    ok = {k: [x for x in v if "error" not in x] for k, v in res.items()}
    if not ok["minimoe"] or not ok["transformers"]:
        return [Row("load", f"{family} full", "bf16", "load", float("nan"), None, "transformers", None,
                    note=f"failed: {res}")]
    med = lambda side, key: statistics.median(x[key] for x in ok[side])  # noqa: E731
    peak = {k: max(x["touched_peak_bytes"] for x in v) for k, v in ok.items()}
    model = f"{family} full ({size / 1e9:.1f} GB on disk)"
    m, t = ok["minimoe"][0], ok["transformers"][0]
    return [
        Row("load", model, "bf16", "seconds until every weight is in memory", med("minimoe", "touched_seconds"),
            med("transformers", "touched_seconds"), "transformers from_pretrained",
            med("transformers", "touched_seconds") / med("minimoe", "touched_seconds"), None,
            note=f"from_pretrained returns after {med('minimoe', 'seconds'):.1f} vs {med('transformers', 'seconds'):.1f}s "
                 f"(transformers maps the files lazily); {len(ok['minimoe'])} fresh process(es) per side, "
                 f"the first of each pair reads a colder page cache"),
        Row("load", model, "bf16", "peak RSS above baseline / checkpoint bytes", peak["minimoe"] / size,
            peak["transformers"] / size, "transformers from_pretrained", peak["transformers"] / peak["minimoe"], None,
            note=f"{peak['minimoe'] / GiB:.2f} vs {peak['transformers'] / GiB:.2f} GiB; right after loading ours holds "
                 f"{m['RssAnon'] / GiB:.1f} GiB copied + {m['RssFile'] / GiB:.1f} GiB mapped file pages, transformers "
                 f"{t['RssAnon'] / GiB:.1f} + {t['RssFile'] / GiB:.1f}; target <= 1.1"),
    ]


def bench_load(args) -> list[Row]:
    rows = []
    for family in args.families.split(","):
        folder = common.CHECKPOINTS / f"{family}-full"
        if not (folder / "config.json").is_file():
            print(f"[load] {folder} missing: run `python bench/load.py --make` first", file=sys.stderr)
            continue
        size = disk_bytes(folder)
        res = {"minimoe": [], "transformers": []}
        for r in range(args.rounds):  # alternate sides so that page-cache warmth is shared
            for impl in (("minimoe", "transformers") if r % 2 == 0 else ("transformers", "minimoe")):
                res[impl].append(run_child("load", impl, folder))
                print(f"[load {family} {impl}] {res[impl][-1]}", file=sys.stderr, flush=True)
        rows += load_rows(family, size, res)
    return rows


def bench_fullsize(args) -> list[Row]:
    folder = common.CHECKPOINTS / "olmoe-full"
    r = run_child("fullsize", folder, args.seq)
    print(f"[fullsize] {r}", file=sys.stderr)
    if "error" in r:
        return [Row("fullsize", "olmoe full", "bf16", "load + forward + LoRA step", float("nan"), None, "-", None,
                    note=r["error"])]
    size = disk_bytes(folder)
    base = r["baseline_bytes"]
    m = "olmoe full, 1x%d tokens" % args.seq
    return [
        Row("fullsize", m, "bf16", "load seconds / peak RSS GiB above baseline", r["load_s"], None, "-", None,
            note=f"peak {r['load_peak_bytes'] / GiB:.2f} GiB = {r['load_peak_bytes'] / size:.2f}x checkpoint"),
        Row("fullsize", m, "bf16", "forward seconds", r["forward_s"], None, "-", None,
            note=f"process RSS peak {r['forward_peak_bytes'] / GiB:.2f} GiB; finite logits: {r['forward_finite']}"),
        Row("fullsize", m, "bf16", "LoRA step seconds (r=8 q/k/v+experts)", r["lora_step_s"], None, "-", None,
            note=f"process RSS peak {r['lora_step_peak_bytes'] / GiB:.2f} GiB; trainable {r['trainable']:,}; "
                 f"loss {r['loss']:.3f}; lifetime max RSS {r['total_peak_bytes'] / GiB:.2f} GiB (baseline "
                 f"{base / GiB:.2f})"),
    ]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--make", action="store_true", help="write the random full-size checkpoints first")
    p.add_argument("--items", default="load,fullsize", help="comma list: load, fullsize")
    p.add_argument("--families", default="olmoe,granitemoe")
    p.add_argument("--rounds", type=int, default=2, help="fresh processes per side")
    p.add_argument("--seq", type=int, default=128, help="tokens of the full-size forward and LoRA step")
    p.add_argument("--name", default=None)
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        kind, *rest = args.child
        res = child_load(*rest) if kind == "load" else child_fullsize(rest[0], int(rest[1]))
        print(json.dumps(res))
        return
    if args.make:
        from bench.make_checkpoint import make
        for family in args.families.split(","):
            out = common.CHECKPOINTS / f"{family}-full"
            if not (out / "config.json").is_file():
                t0 = time.time()
                make(family, out)
                print(f"made {out}: {disk_bytes(out) / 1e9:.2f} GB, {time.time() - t0:.0f}s", file=sys.stderr)
    header = f"Machine: {common.machine()}\n\nCommand: `python bench/load.py {' '.join(argv or sys.argv[1:])}`"
    rows = []
    for item in args.items.split(","):
        rows += {"load": bench_load, "fullsize": bench_fullsize}[item](args)
    path = common.save(rows, args.name or "load-" + time.strftime("%Y%m%d-%H%M%S"), header)
    print(header + "\n\n" + common.markdown(rows))
    print(f"written {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
