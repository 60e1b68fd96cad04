"""Checkpoint I/O: official safetensors <-> MoEForCausalLM (config.json: config_json.py; where the files come
from: hub.py; the tokenizer: tokenizer.py).

Our module names equal the checkpoint keys wherever the families agree; each family's record
(core/decoder/families.py: `Family.layer_keys`, `renames`, `config_fields`) is the whole table for the rest. Loading is strict: a missing, unexpected or wrongly shaped key, an
unknown model_type, a missing config field or an unreadable file raises an error naming it.

Loading builds the model on the meta device (no random weights are ever allocated), then reads
every tensor with plain file reads straight into its parameter (OLMoE's per-expert matrices into
their slice of the stacked `[E, out, in]` banks), so peak memory stays at the checkpoint's size:
no mmap pages held beside the copies, no second copy of any bank (weight_file.py's `WeightFile`). `entry_reads`
is the one map from an entry of the family's record to the reads (and conversion) that fill our
tensor, whole or a range of its rows: the sharded load (runs/sharding.py) reads through it too.
`dtype=None` keeps the dtype the checkpoint records (`torch_dtype`).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import save_file

from minimoe.atomic import atomic_directory
from minimoe.core.decoder.family_record import Converted, family_of
from minimoe.core.decoder.model import MoEConfig, MoEForCausalLM
from minimoe.core.adaptation.quantized import pack, quantize_module, quantized_modules
from minimoe.core.adaptation.quantized import require as require_quantization
from minimoe.process_memory import advise_huge_pages, mapped_big_blocks
from minimoe.loading.config_json import config_to_dict, read_config
from minimoe.loading.hub import resolve_checkpoint
from minimoe.loading.layouts import as_our_keys, layout_of
from minimoe.loading.mxfp4 import MXFP4Weight, dequantize_mxfp4
# runs/memory.py imports WeightFile, SAFETENSORS_DTYPES and _weight_files from here
from minimoe.loading.weight_file import SAFETENSORS_DTYPES, WeightFile, _weight_files


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
RUN_DTYPES = ("float32", "bfloat16")  # what a model is run and saved in: every --dtype's choices (float16 is only read)


# ----------------------------------------------------------------------------- name table

def checkpoint_layout(config: MoEConfig) -> dict[str, tuple[str, ...] | str | Converted]:
    """Our parameter name -> its on-disk key (str), per-expert keys (tuple, in concatenation order) or a
    Converted key (stored in another layout: its `Layout` converts it).

    Read off the model's own parameters (built on the meta device), each under its own name unless the
    family's `layer_keys` renames it: whatever modules a family's config switches on (biases, q/k norms,
    dense layers, shared experts) are in the table without being listed here."""
    with torch.device("meta"):
        names = tensor_names(MoEForCausalLM(config))
    family = family_of(config.model_type)
    table = family.layer_keys
    layout = {}
    for name in names:
        _, _, rest = name.partition(".layers.")
        if not rest:
            layout[name] = family.outer_keys.get(name, name)
            continue
        index, _, local = rest.partition(".")
        at = f"{family.layers_prefix}{index}."
        disk = table.get(local, local)
        if isinstance(disk, tuple):
            layout[name] = tuple(at + pat.format(j=j) for j in range(config.num_experts) for pat in disk)
        elif isinstance(disk, Converted):
            layout[name] = Converted(at + disk.key, disk.layout)
        else:
            layout[name] = at + disk
    return layout


def tensor_names(model) -> list[str]:
    """What a checkpoint holds of `model`: its parameters (a tied head is the embedding's) and persistent buffers
    (DeepSeek-V4's integer tid2eid table, which no optimizer or requires_grad_ may touch)."""
    buffers = {n for n, _ in model.named_buffers()}
    return [n for n, _ in model.named_parameters()] + [n for n in model.state_dict(keep_vars=True) if n in buffers]


def model_tensor(model, name: str) -> torch.Tensor:
    """A parameter or buffer of `model` by its name."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    return module._parameters[leaf] if leaf in module._parameters else module._buffers[leaf]


def mxfp4_keys(key: str) -> tuple[str, str]:
    """The blocks and scales that stand for `key` in an MXFP4 checkpoint (loading/mxfp4.py)."""
    return key + "_blocks", key + "_scales"


def in_mxfp4(disk, where: dict) -> bool:
    """Whether the checkpoint (`where`: its keys) stores record entry `disk`, a Converted key, as MXFP4
    blocks and scales instead of itself."""
    return isinstance(disk, Converted) and disk.key not in where and mxfp4_keys(disk.key)[0] in where


def mxfp4_stored(layout: dict, where: dict) -> set[str]:
    """The Converted keys that a checkpoint stores as MXFP4 blocks and scales instead of themselves."""
    return {disk.key for disk in layout.values() if in_mxfp4(disk, where)}


def from_mxfp4(disk: Converted, blocks, scales, dtype):
    """A Converted key's MXFP4 blocks and scales (its matrix as [E, out, in]) -> our tensor, through its layout."""
    return layout_of(disk).from_packed(dequantize_mxfp4(blocks, scales, dtype, disk.key))


# ----------------------------------------------------------------------------- loading

def from_pretrained(name_or_path, *, dtype=None, device=None, cache_dir=None, revision=None,
                    quantize: str | None = None) -> MoEForCausalLM:
    """Load an official checkpoint of any family in core/decoder/families.py from a folder or a hub repo id.
    quantize: "nf4" packs the frozen base's large matrices (core/adaptation/quantized.py) as they are read, one matrix
    at a time, so the unpacked model never is whole; "mxfp4" keeps gpt-oss's MXFP4 experts as stored."""
    if quantize is not None:
        require_quantization(quantize)  # before any file is read
    folder = resolve_checkpoint(name_or_path, cache_dir, revision)
    config = read_config(folder)
    if isinstance(dtype, str):
        dtype = DTYPES[dtype]
    dtype = dtype or DTYPES.get(config.torch_dtype or "", torch.float32)
    device = torch.device(device or "cpu")
    with torch.device("meta"):
        model = MoEForCausalLM(config)
    layout = checkpoint_layout(config)
    files, where = weight_index(folder, config)
    if quantize == "mxfp4":  # the experts the checkpoint stores in MXFP4, kept so; the rest as loaded
        packed = {n for n, disk in layout.items() if in_mxfp4(disk, where)}
        if not packed:
            raise ValueError(f"{folder}: --quantize mxfp4 keeps MXFP4 expert blocks as loaded, and this "
                             f"{config.model_type} checkpoint stores none; use --quantize nf4")
    else:
        packed = set() if quantize is None else {f"{m}.weight" for m in quantized_modules(model)}
    targets = []  # (record entry, the parameter it fills): every unpacked parameter at its final dtype and device
    for name, disk in layout.items():
        if name not in packed:
            meta = model_tensor(model, name)  # an integer table (DeepSeek-V4's tid2eid) keeps its dtype
            targets.append((disk, place(model, name, torch.empty(meta.shape, device=device, dtype=dtype
                                                                 if meta.is_floating_point() else meta.dtype)), None))
    read_entries(files, where, targets, config.num_experts, str(folder))
    # --quantize: each packed parameter read whole into one reused staging buffer, then packed, one after the
    # other, so the unpacked model never is whole. One buffer, not one allocation each: under
    # keep_freed_memory the heap is never trimmed, and a freed block does not always fit the next matrix.
    largest = max((model_tensor(model, n).numel() for n in packed), default=0) if quantize == "nf4" else 0
    stage = torch.empty(largest, dtype=dtype, device=device)
    for name in (n for n in layout if n in packed):
        disk, meta = layout[name], model_tensor(model, name)
        module_name = name.rpartition(".")[0]
        module = model.get_submodule(module_name)
        if quantize == "mxfp4":  # the blocks and scales as read, no dense bank at all
            planned, _ = entry_reads(disk, torch.empty(meta.shape, device="meta"), where, config.num_experts,
                                     str(folder))
            read_keys(files, where, planned)
            blocks, scales = (planned[k][0] for k in mxfp4_keys(disk.key))
            quantize_module(module, MXFP4Weight(blocks.to(device), scales.to(device), dtype,
                                                layout_of(disk).from_packed, disk.key))
            continue
        value = place(model, name, stage[:meta.numel()].view(meta.shape))
        read_entries(files, where, [(disk, value, None)], config.num_experts, str(folder))
        with mapped_big_blocks():  # the packing's transients, unmapped when freed (process_memory.py says why)
            quantize_module(module, pack(value, quantize, module_name))
    model.tie_weights()
    still_meta = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    if still_meta:
        raise KeyError(f"{folder}: no checkpoint key fills parameter {still_meta[0]!r}")
    return model.eval()


def disk_keys(disk, mxfp4: set[str]) -> tuple[str, ...]:
    """The disk keys that fill one parameter of `checkpoint_layout` (mxfp4: the Converted keys stored packed)."""
    if isinstance(disk, Converted):
        return mxfp4_keys(disk.key) if disk.key in mxfp4 else (disk.key,)
    return (disk,) if isinstance(disk, str) else disk


def entry_reads(disk, out: torch.Tensor, where: dict, num_experts: int, source: str,
                first_row: int | None = None) -> tuple[dict, object]:
    """One entry of the family's record (checkpoint_layout: a key, per-expert keys, or a Converted key, dense
    or as MXFP4 blocks and scales when `where`, the checkpoint's keys, says so) -> the reads that fill `out`
    with our parameter: ({disk key: (tensor its values go to, first row read or None)}, then a conversion
    to call once they are read, or None). With `first_row`, `out` holds rows [first_row, first_row +
    len(out)) of our parameter's first dimension and only those are read (a rank's shard, runs/sharding.py);
    rows are experts for per-expert and Converted keys, whose conversions act within an expert. The one map
    from a record entry to our tensor: from_pretrained and the sharded load both read through it, so that
    no family loads one way whole and another way in shards."""
    if isinstance(disk, str):
        return {disk: (out, first_row)}, None
    if isinstance(disk, Converted):  # read as stored (its shape: ours taken to the disk layout), then converted
        if in_mxfp4(disk, where):
            if layout_of(disk).from_packed is None:
                raise KeyError(f"{source}: {disk.key!r} is stored as MXFP4 blocks and scales; it must be dense")
            E, R, C = out.shape  # MXFP4 stores [E, out, in] as 32-value blocks along in
            blocks = torch.empty(E, R, C // 32, 16, dtype=torch.uint8)
            scales = torch.empty(E, R, C // 32, dtype=torch.uint8)
            planned = dict(zip(mxfp4_keys(disk.key), ((blocks, first_row), (scales, first_row))))
            return planned, lambda: out.copy_(from_mxfp4(disk, blocks, scales, out.dtype))
        buffer = torch.empty(layout_of(disk).to_disk(torch.empty(out.shape, device="meta")).shape, dtype=out.dtype)
        return {disk.key: (buffer, first_row)}, lambda: out.copy_(layout_of(disk).from_disk(buffer))
    # per-expert keys in (expert, part) order; part p fills rows [p * width, (p + 1) * width) of its expert
    parts = len(disk) // num_experts
    width = out.shape[1] // parts
    first, end = (0, num_experts) if first_row is None else (first_row, first_row + len(out))
    return {key: (out[j - first, p * width:(p + 1) * width], None)
            for i, key in enumerate(disk) for j, p in [divmod(i, parts)] if first <= j < end}, None


def read_entries(files: dict, where: dict, targets: list, num_experts: int, source: str) -> int:
    """Fill each (record entry, our tensor, first row or None) of `targets` (entry_reads) from the files
    weight_index found: one file at a time and front to back in each, then the conversions; returns the
    tensor bytes read."""
    reads, conversions = {}, []
    for disk, out, first_row in targets:
        planned, convert = entry_reads(disk, out, where, num_experts, source, first_row)
        reads.update(planned)
        conversions += [convert] if convert else []
    done = read_keys(files, where, reads)
    for convert in conversions:
        convert()
    return done


def read_keys(files: dict, where: dict, reads: dict) -> int:
    """Each read of `reads` ({disk key: (tensor, first row or None)}, entry_reads'), one file at a time and
    front to back in each; returns the tensor bytes read."""
    done = 0
    for file, weights in files.items():
        mine = [key for key in weights.keys() if key in reads and where.get(key) == file]
        if not mine:
            continue
        before = weights.bytes_read
        with open(weights.path, "rb", buffering=0) as f:
            for key in mine:
                out, first_row = reads[key]
                weights.read_into(key, out, f, first_row=first_row)
        done += weights.bytes_read - before
    return done


def place(model, name: str, value: torch.Tensor) -> torch.Tensor:
    """`value` made parameter (or buffer) `name` of the meta-built model (its requires_grad kept); returns it."""
    meta = model_tensor(model, name)
    advise_huge_pages(value)  # 512x fewer first-touch page faults while the file is copied in
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    if leaf in module._buffers:
        module._buffers[leaf] = value
    else:
        module._parameters[leaf] = nn.Parameter(value, requires_grad=meta.requires_grad)
    return value


def weight_index(folder: Path, config: MoEConfig) -> tuple[dict[str, WeightFile], dict[str, str]]:
    """(safetensors file -> WeightFile, its header read; disk key -> its file), checked strictly
    against `checkpoint_layout(config)`: a missing or unexpected key raises, naming it."""
    layout = checkpoint_layout(config)
    family = family_of(config.model_type)
    files, where = {}, {}  # file -> WeightFile (header only), disk key -> file
    for file, keys in _weight_files(folder).items():
        weights = files[file] = WeightFile(folder / file)
        for key in keys or ():
            if key not in weights.entries:
                raise KeyError(f"{folder}: the shard index puts {key!r} in {file}, which does not hold it")
        # the hub's other layouts (Family.key_prefixes, fused_banks), read under the record's keys
        weights.entries, became = as_our_keys(weights.entries, family.key_prefixes, family.fused_banks,
                                              lambda dtype: SAFETENSORS_DTYPES[dtype].itemsize, family.key_aliases)
        for key in weights.entries if keys is None else [k for disk in keys for k in became[disk]]:
            where[key] = file
    quantized = mxfp4_stored(layout, where)
    expected = {key for disk in layout.values() for key in disk_keys(disk, quantized)}
    ignored = {"lm_head.weight"} if config.tie_word_embeddings else set()  # tied: the embedding serves
    prefixes = family.ignored_prefixes
    ignored |= {k for k in where if prefixes and k.startswith(prefixes)}
    unexpected = sorted(set(where) - expected - ignored)
    if unexpected:
        raise KeyError(f"{folder}: unexpected key {unexpected[0]!r} in {where[unexpected[0]]} "
                       f"({len(unexpected)} in all); is this a {config.model_type} checkpoint?")
    missing = sorted(expected - set(where))
    if missing:
        raise KeyError(f"{folder}: missing key {missing[0]!r} ({len(missing)} in all) for model_type {config.model_type!r}")
    return files, where


# ----------------------------------------------------------------------------- saving

def to_disk_layout(config: MoEConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors named like our parameters -> tensors named and split like the official checkpoint."""
    out = {}
    for name, disk in checkpoint_layout(config).items():
        value = tensors[name]
        if isinstance(disk, str):
            out[disk] = value.contiguous()
            continue
        if isinstance(disk, Converted):  # saved dense, in the layout transformers reads (MXFP4 is never written)
            out[disk.key] = layout_of(disk).to_disk(value)
            continue
        parts = len(disk) // config.num_experts
        rows = value.shape[1] // parts
        for j in range(config.num_experts):
            for p in range(parts):
                out[disk[j * parts + p]] = value[j, p * rows:(p + 1) * rows].contiguous()
    return out


def checkpoint_tensors(model: MoEForCausalLM) -> dict[str, torch.Tensor]:
    """The official on-disk tensors of `model` (base weights only; LoRA and method heads are not in the table)."""
    names = checkpoint_layout(model.config)
    return to_disk_layout(model.config, {n: model_tensor(model, n).detach().cpu() for n in names})


def save_pretrained(model: MoEForCausalLM, path, *, max_shard_bytes: int = 5 * 2**30):
    """Write config.json and safetensors in the official layout (sharded past max_shard_bytes), atomically."""
    with atomic_directory(path, "model") as tmp:
        write_checkpoint(model, tmp, max_shard_bytes=max_shard_bytes)


def write_checkpoint(model: MoEForCausalLM, folder: Path, *, max_shard_bytes: int = 5 * 2**30):
    """save_pretrained's files, written into an existing folder (callers own its atomicity)."""
    tensors = checkpoint_tensors(model)
    shards, current, size = [], {}, 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[key] = t
        size += nbytes
    shards.append(current)
    config = config_to_dict(model.config)
    config["torch_dtype"] = str(model.dtype).removeprefix("torch.")
    with open(folder / "config.json", "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(folder / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
