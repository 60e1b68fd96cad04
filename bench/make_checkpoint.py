"""Write a random checkpoint with the exact official shapes and layout, streaming tensor by tensor.

    python bench/make_checkpoint.py --family olmoe        # ~13.8 GB: 16 layers, 64 experts, 3 shards + index
    python bench/make_checkpoint.py --family granitemoe   # ~6.7 GB: 32 layers, 40 fused experts, tied embeddings

The on-disk key names and shapes come from minimoe.loading.checkpoint's name table (per-expert keys for OLMoE,
fused `input_linear`/`output_linear` for Granite, no `lm_head.weight` when tied). Each shard is written
as a safetensors file by hand: the header (every key's dtype, shape and byte range) first, then each
tensor drawn, converted to bf16, written and dropped, so memory holds one tensor at a time, never the
model. Values: N(0, 0.02) matrices, ones for the norms; good enough to load and run.
"""
from __future__ import annotations

import argparse
import json
import struct
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common  # noqa: E402
from minimoe.core.decoder.model import MoEForCausalLM  # noqa: E402
from minimoe.loading.checkpoint import atomic_directory, checkpoint_layout
from minimoe.loading.config_json import config_to_dict  # noqa: E402

SAFETENSORS_DTYPE = {torch.bfloat16: "BF16", torch.float32: "F32"}


def disk_tensors(config) -> list[tuple[str, tuple[int, ...]]]:
    """(on-disk key, shape) in checkpoint order, read off the loader's own name table."""
    with torch.device("meta"):
        model = MoEForCausalLM(config)
    out = []
    for name, disk in checkpoint_layout(config).items():
        shape = tuple(model.get_parameter(name).shape)
        if isinstance(disk, str):
            out.append((disk, shape))
        else:  # per-expert keys: the bank [E, out, in] splits into E * parts matrices [out / parts, in]
            parts = len(disk) // config.num_experts
            out += [(key, (shape[1] // parts, shape[2])) for key in disk]
    return out


def shard(tensors, dtype, max_bytes: int) -> list[list[tuple[str, tuple]]]:
    size = torch.tensor([], dtype=dtype).element_size()
    shards, current, used = [], [], 0
    for key, shp in tensors:
        nbytes = size * torch.Size(shp).numel()
        if current and used + nbytes > max_bytes:
            shards.append(current)
            current, used = [], 0
        current.append((key, shp))
        used += nbytes
    return shards + [current]


def random_tensor(key: str, shp, dtype, generator) -> torch.Tensor:
    if key.endswith("norm.weight"):
        return torch.ones(shp, dtype=dtype)
    return (torch.randn(shp, generator=generator) * 0.02).to(dtype)


def write_safetensors(path: Path, entries, dtype, generator) -> int:
    """entries: [(key, shape)]. Header first (8-byte length, JSON padded to 8 bytes), then the data."""
    size = torch.tensor([], dtype=dtype).element_size()
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for key, shp in entries:
        nbytes = size * torch.Size(shp).numel()
        header[key] = {"dtype": SAFETENSORS_DTYPE[dtype], "shape": list(shp), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for key, shp in entries:
            t = random_tensor(key, shp, dtype, generator)
            f.write(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            del t
    return offset


def make(family: str, out: Path, *, layers: int | None = None, max_shard_bytes: int = 5 * 10**9,
         dtype=torch.bfloat16, seed: int = 0, config=None) -> Path:
    """config: another MoEConfig to write instead of the official shape (tests use tiny ones)."""
    config = config or common.shape(family, layers)
    groups = shard(disk_tensors(config), dtype, max_shard_bytes)
    generator = torch.Generator().manual_seed(seed)
    with atomic_directory(out, "model") as tmp:
        weight_map, total = {}, 0
        for i, entries in enumerate(groups, 1):
            name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
            t0 = time.time()
            total += write_safetensors(tmp / name, entries, dtype, generator)
            weight_map.update(dict.fromkeys((k for k, _ in entries), name))
            print(f"  {name}: {len(entries)} tensors, {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
        with open(tmp / "model.safetensors.index.json", "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        cfg = config_to_dict(config)
        cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
        with open(tmp / "config.json", "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", required=True, choices=sorted(common.OFFICIAL))
    p.add_argument("--out", type=Path, default=None, help="folder (default bench/checkpoints/<family>-full)")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the official (default: official)")
    p.add_argument("--max-shard-bytes", type=int, default=5 * 10**9, help="OLMoE-1B-7B ships 3 shards of <= 5 GB")
    args = p.parse_args(argv)
    out = args.out or common.CHECKPOINTS / f"{args.family}-full"
    t0 = time.time()
    make(args.family, out, layers=args.layers, max_shard_bytes=args.max_shard_bytes)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"{out}: {size / 1e9:.2f} GB in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
