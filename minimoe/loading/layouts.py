"""The checkpoint's tensor layouts: how a tensor stored otherwise than our parameter converts, both ways.

A family's record (core/decoder/families.py) says where each tensor is; a `Converted` entry there names
its layout here, by name (`LAYOUTS`), so that the record stays a table of facts and the conversions stay
with the loading and saving that run them (core imports nothing of loading).

The banks stored as x @ W. gpt-oss (transformers 4.57's GptOssExperts, and the official checkpoint):
gate_up_proj [E, D, 2I] with column 2i the gate of unit i and column 2i+1 its up, gate_up_proj_bias
[E, 2I] interleaved the same way, down_proj [E, I, D]; or, in openai/gpt-oss-20b, the matrices as MXFP4
blocks and scales of [E, out, in] (gate_up's 2I rows interleaved as above). Llama 4: gate_up_proj
[E, D, 2I] gate columns first, down_proj [E, I, D]. Ours: [E, out, in], gate rows then up rows.

Layouts of a whole file (`as_our_keys`), for a family whose hub files differ from what transformers' save_pretrained
writes and we write: keys under another prefix (Family.key_prefixes: Qwen3.5's model.language_model.), and expert
banks stored fused where the record reads them per expert (Family.fused_banks), seen in the safetensors header as
the per-expert matrices they hold, so that every reader (the whole load, the sharded one) reads them unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Layout:
    """How a tensor stored in another layout than our parameter's converts (a `Converted` entry names one).
    Each acts within an expert (the first dimension), so a rank's shard of experts converts alone."""
    name: str
    from_disk: Callable  # the stored tensor -> ours
    to_disk: Callable  # ours -> as stored: what we save, in the layout transformers reads
    # MXFP4 (loading/mxfp4.py) stores a matrix as [E, out, in] whatever its dense layout: what the decoded
    # matrix goes through to be ours, a permutation of its rows (dim 1), so that MXFP4Weight applies it to the
    # blocks and scales instead; None: never stored so (a bias), an MXFP4 form is refused
    from_packed: Callable | None = None


def split_interleaved(x, dim: int):
    """[..., 2I, ...] with gate/up alternating along `dim` -> the gates, then the ups."""
    x = x.movedim(dim, -1)
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1).movedim(-1, dim)


def interleave(x, dim: int):
    """split_interleaved's inverse: gates then ups along `dim` -> alternating."""
    x = x.movedim(dim, -1)
    gate, up = x.chunk(2, dim=-1)
    return torch.stack((gate, up), dim=-1).flatten(-2).movedim(-1, dim)


def transposed(w):  # [E, a, b] -> [E, b, a]: a bank stored as x @ W ([E, in, out]) <-> ours ([E, out, in])
    return w.transpose(1, 2).contiguous()


def gate_up_from_disk(w):  # [E, D, 2I] as x @ W, gate/up columns interleaved -> [E, 2I, D] gate rows first
    return split_interleaved(w.transpose(1, 2), dim=1).contiguous()


def gate_up_to_disk(w):  # [E, 2I, D] -> [E, D, 2I] interleaved
    return interleave(w, dim=1).transpose(1, 2).contiguous()


LAYOUTS = {layout.name: layout for layout in (
    Layout("gate_up_interleaved", gate_up_from_disk, gate_up_to_disk,
           from_packed=lambda w: split_interleaved(w, dim=1)),  # MXFP4's [E, 2I, D]: rows interleaved
    Layout("bias_interleaved", lambda b: split_interleaved(b, dim=1).contiguous(),
           lambda b: interleave(b, dim=1).contiguous()),  # [E, 2I]: no MXFP4 form
    Layout("transposed", transposed, transposed, from_packed=lambda w: w),  # MXFP4's [E, out, in] is ours
)}


def layout_of(disk) -> Layout:
    """The Layout a record's `Converted` entry names; an unknown name is an error naming the layouts there are."""
    layout = LAYOUTS.get(disk.layout)
    if layout is None:
        raise ValueError(f"checkpoint key {disk.key!r}: unknown layout {disk.layout!r}; expected one of {sorted(LAYOUTS)}")
    return layout


def as_our_keys(entries: dict, prefixes: dict, fused_banks: dict, itemsize, aliases=None) -> tuple[dict, dict]:
    """A safetensors header's entries ({key: {dtype, shape, data_offsets}}) under the keys the record reads: a key
    under one of `prefixes` (disk prefix -> ours) renamed; a layer's key of `aliases` (Family.key_aliases) read as the
    one it stands for; a fused bank of `fused_banks` (its key in a layer, e.g.
    mlp.experts.gate_up_proj [E, out, in] -> the per-expert patterns it holds, splitting out evenly in order) seen as
    those per-expert matrices: expert j's rows are contiguous on disk, so each is a byte range of the same tensor,
    nothing copied. itemsize(dtype name) -> bytes. Returns (the entries, each disk key -> the keys it became)."""
    out, became = {}, {}
    for disk, entry in entries.items():
        key = next((ours + disk[len(p):] for p, ours in prefixes.items() if disk.startswith(p)), disk)
        head, _, rest = key.partition(".layers.")
        index, _, local = rest.partition(".")
        if rest and local in (aliases or {}):
            local = aliases[local]
            key = f"{head}.layers.{index}.{local}"
        parts = fused_banks.get(local) if rest else None
        if parts is None or len(entry["shape"]) != 3:
            out[key], became[disk] = entry, [key]
            continue
        E, rows, cols = entry["shape"]
        if rows % len(parts):
            raise ValueError(f"checkpoint key {disk!r}: a fused bank of shape {entry['shape']}; expected its "
                             f"{rows} rows to split evenly into {len(parts)} parts ({', '.join(parts)})")
        rows //= len(parts)  # each part's rows (gate, then up)
        size, begin = rows * cols * itemsize(entry["dtype"]), entry["data_offsets"][0]
        split = {f"{head}.layers.{index}." + pattern.format(j=j): {
            "dtype": entry["dtype"], "shape": [rows, cols],
            "data_offsets": [begin + (j * len(parts) + p) * size, begin + (j * len(parts) + p + 1) * size]}
            for j in range(E) for p, pattern in enumerate(parts)}
        out.update(split)
        became[disk] = list(split)
    return out, became
