"""A checkpoint's safetensors files read with plain file reads (`WeightFile`), straight into tensors we own, and
which file holds which key (`_weight_files`: the shard index or the single file). checkpoint.py maps the keys onto
our parameters; this file knows only the safetensors format."""
from __future__ import annotations

import json
from pathlib import Path

import torch


def _weight_files(folder: Path) -> dict[str, list[str]]:
    """safetensors file -> the keys it holds, from the shard index or the single file."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files: dict[str, list[str]] = {}
        for key, file in weight_map.items():
            files.setdefault(file, []).append(key)
        return files
    single = folder / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{folder}: no model.safetensors or model.safetensors.index.json")
    return {"model.safetensors": None}


# safetensors header dtype names -> torch dtypes (the ones a language-model checkpoint uses).
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}


class WeightFile:
    """One safetensors file, read with plain `readinto` calls straight into tensors we own.

    Not `safe_open`: it memory-maps the file, and every page a read touches stays resident while any
    tensor taken from that file is alive, so copying OLMoE's per-expert matrices into stacked banks
    would hold the banks and the mapped files at once (bench/RESULTS.md). Plain reads keep the peak
    at the checkpoint's size, plus one tensor when the dtype changes. `safe_open` stays the reference
    reader: tests/loading/test_checkpoint.py holds the two equal on every key. The format is an 8-byte
    little-endian header length, a JSON header {key: {dtype, shape, data_offsets}}, then the bytes.
    """

    def __init__(self, path: Path):
        if not path.is_file():
            raise FileNotFoundError(f"{path}: weight file named by the checkpoint is missing")
        self.path, size = path, path.stat().st_size
        try:
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                if not 2 <= n <= size - 8:
                    raise ValueError(f"header length {n} does not fit a {size}-byte file")
                header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise ValueError(f"{path}: not a readable safetensors file (truncated or corrupt?): {e}") from e
        if 8 + n + end > size:
            raise ValueError(f"{path}: not a readable safetensors file (truncated or corrupt?): "
                             f"its tensors end at byte {8 + n + end}, the file has {size}")
        self.entries, self.data_start = header, 8 + n
        self.bytes_read = 0  # tensor bytes read so far: what a rank of a sharded load reads (tests)

    def keys(self) -> list[str]:
        """In file order, so that reading them in turn reads the file front to back."""
        return sorted(self.entries, key=lambda k: self.entries[k]["data_offsets"][0])

    def read_into(self, key: str, out: torch.Tensor, f, first_row: int | None = None) -> None:
        """Copy tensor `key` into `out` (same shape, any dtype and device); f: this file, opened 'rb'.
        With `first_row`, only rows [first_row, first_row + len(out)) of its first dimension are read
        (a rank's shard, minimoe/runs/sharding.py): rows are contiguous on disk, so one seek and one read."""
        entry = self.entries[key]
        shape = tuple(entry["shape"])
        if first_row is not None:
            if shape[1:] != tuple(out.shape[1:]) or not 0 <= first_row <= first_row + len(out) <= shape[0]:
                raise ValueError(f"{self.path}: {key!r} has shape {shape}; rows {first_row}:{first_row + len(out)} "
                                 f"of shape {tuple(out.shape)} do not fit in it")
            shape = tuple(out.shape)
        if shape != tuple(out.shape):
            raise ValueError(f"{self.path}: {key!r} has shape {shape}; expected {tuple(out.shape)}")
        disk_dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
        if disk_dtype is None:
            raise ValueError(f"{self.path}: {key!r} has dtype {entry['dtype']}; expected one of {list(SAFETENSORS_DTYPES)}")
        begin, end = entry["data_offsets"]
        direct = out.dtype == disk_dtype and out.device.type == "cpu" and out.is_contiguous()
        buffer = out if direct else torch.empty(out.shape, dtype=disk_dtype)
        data = memoryview(buffer.reshape(-1).view(torch.uint8).numpy())
        if first_row is not None:  # the rows' byte range inside the tensor's
            row_bytes = (end - begin) // max(1, entry["shape"][0])
            begin, end = begin + first_row * row_bytes, begin + first_row * row_bytes + len(data)
        if end - begin != len(data):
            raise ValueError(f"{self.path}: {key!r} spans {end - begin} bytes; its dtype and shape need {len(data)}")
        self.bytes_read += len(data)
        f.seek(self.data_start + begin)
        done = 0
        while done < len(data):  # one read() returns at most ~2 GiB on Linux
            got = f.readinto(data[done:])
            if not got:
                raise ValueError(f"{self.path}: cannot read {key!r}: the file ends early (truncated?)")
            done += got
        if not direct:
            out.copy_(buffer)
