"""Checkpoint I/O: official safetensors <-> MoEForCausalLM, config.json <-> MoEConfig, tokenizer.

Our module names equal the checkpoint keys wherever the families agree; each family's record
(core/families.py: `Family.layer_keys`, `renames`, `config_fields`) is the whole table for the rest. Loading is strict: a missing, unexpected or wrongly shaped key, an
unknown model_type, a missing config field or an unreadable file raises an error naming it.

Loading builds the model on the meta device (no random weights are ever allocated), then reads
every tensor with plain file reads straight into its parameter (OLMoE's per-expert matrices into
their slice of the stacked `[E, out, in]` banks), so peak memory stays at the checkpoint's size:
no mmap pages held beside the copies, no second copy of any bank (see `WeightFile`).
`dtype=None` keeps the dtype the checkpoint records (`torch_dtype`).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import save_file

from minimoe.atomic import atomic_directory
from minimoe.core.families import CONFIG_FIELDS, Converted, family_of
from minimoe.core.model import MoEConfig, MoEForCausalLM, config_field_names
from minimoe.loading import gpt_oss
from minimoe.loading.allocator import advise_huge_pages

# Converted keys (core/families.py): layout -> (disk -> ours, ours -> disk, MXFP4 blocks and scales -> ours
# or None). Only gpt-oss needs them so far (loading/gpt_oss.py says why).
CONVERSIONS = {
    "gate_up_interleaved": (gpt_oss.gate_up_from_disk, gpt_oss.gate_up_to_disk, gpt_oss.gate_up_from_mxfp4),
    "bias_interleaved": (gpt_oss.gate_up_bias_from_disk, gpt_oss.gate_up_bias_to_disk, None),
    "transposed": (gpt_oss.down_from_disk, gpt_oss.down_to_disk, gpt_oss.down_from_mxfp4),
}
QUANTIZED_ON_DISK = ("mxfp4",)  # quantization_config.quant_method values we dequantise on load

REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads", "num_experts", "num_experts_per_tok")
HUB_FILES = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json",
             "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
RUN_DTYPES = ("float32", "bfloat16")  # what a model is run and saved in: every --dtype's choices (float16 is only read)


# ----------------------------------------------------------------------------- config

def config_from_dict(d: dict, source: str = "config.json") -> MoEConfig:
    family = family_of(d.get("model_type"), source)
    d = {family.renames.get(k, k): v for k, v in d.items()}
    d = {**family.defaults, **d}
    if family.layer_kinds:  # a hybrid: each layer's kind in config.json -> its token mixer (core/mixers.py)
        kinds = d.get("mixer_types")
        if not isinstance(kinds, list) or not set(kinds) <= set(family.layer_kinds):
            raise ValueError(f"{source}: layer_types {kinds!r}; expected a list of {sorted(family.layer_kinds)}, "
                             f"one per layer, for model_type {family.model_type!r}")
        d["mixer_types"] = [family.layer_kinds[k] for k in kinds]
    d.setdefault("num_key_value_heads", d.get("num_attention_heads"))
    missing = [f for f in REQUIRED_FIELDS if d.get(f) is None]
    if missing:
        raise ValueError(f"{source}: missing field(s) {missing} for model_type {family.model_type!r}")
    quant = (d.get("quantization_config") or {}).get("quant_method")
    if quant is not None:  # dequantised on load and saved dense: the saved config.json says no quantization
        if quant not in QUANTIZED_ON_DISK:
            raise ValueError(f"{source}: quantization_config quant_method {quant!r} is not supported; expected "
                             f"one of {QUANTIZED_ON_DISK} (dequantised on load) or none")
        d = {k: v for k, v in d.items() if k != "quantization_config"}
    ours = set(config_field_names()) - set(family.fixed)  # a fixed field is the family's, whatever the file says
    known = {k: v for k, v in d.items() if k in ours}
    extra = {k: v for k, v in d.items() if k not in ours}
    return MoEConfig(**known, extra=extra)


def config_to_dict(config: MoEConfig) -> dict:
    """config.json as the family's transformers config writes it: the shared fields, the family's own
    (`Family.config_fields`) under its names, and whatever unknown fields were read."""
    family = family_of(config.model_type)
    written = CONFIG_FIELDS | family.config_fields
    back = {v: k for k, v in family.renames.items()}
    # A field left None where the family's transformers config has a default (Llama 4's no_rope_layer_interval,
    # in a config built here rather than read) is left out: transformers then fills in that default, not null.
    d = {**config.extra, **{back.get(k, k): getattr(config, k) for k in config_field_names() if k in written
                            and not (getattr(config, k) is None and family.defaults.get(k) is not None)}}
    d["architectures"] = [family.architecture]
    if family.layer_kinds:  # each layer's token mixer -> config.json's name for its kind
        back_kinds = {v: k for k, v in family.layer_kinds.items()}
        d["layer_types"] = [back_kinds[m] for m in config.mixer_types]
    if "layer_types" in written and d.get("layer_types") is None:  # gpt-oss's config would alternate them otherwise
        d["layer_types"] = ["sliding_attention" if config.window(i) else "full_attention"
                            for i in range(config.num_hidden_layers)]
    if "attention_multiplier" in written and d.get("attention_multiplier") is None:
        d["attention_multiplier"] = config.attention_scale
    return d


def read_config(folder: Path) -> MoEConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no config.json; a checkpoint folder needs config.json and safetensors")
    try:
        with open(path) as f:
            d = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e}); the file is truncated or corrupt: restore or "
                         f"re-download the checkpoint") from None
    return config_from_dict(d, str(path))


# ----------------------------------------------------------------------------- name table

def checkpoint_layout(config: MoEConfig) -> dict[str, tuple[str, ...] | str | Converted]:
    """Our parameter name -> its on-disk key (str), per-expert keys (tuple, in concatenation order) or a
    Converted key (stored in another layout: CONVERSIONS).

    Read off the model's own parameters (built on the meta device), each under its own name unless the
    family's `layer_keys` renames it: whatever modules a family's config switches on (biases, q/k norms,
    dense layers, shared experts) are in the table without being listed here."""
    with torch.device("meta"):
        names = [n for n, _ in MoEForCausalLM(config).named_parameters()]  # a tied head is the embedding's
    table = family_of(config.model_type).layer_keys
    layout = {}
    for name in names:
        prefix, _, rest = name.partition(".layers.")
        if not rest:
            layout[name] = name
            continue
        index, _, local = rest.partition(".")
        at = f"{prefix}.layers.{index}."
        disk = table.get(local, local)
        if isinstance(disk, tuple):
            layout[name] = tuple(at + pat.format(j=j) for j in range(config.num_experts) for pat in disk)
        elif isinstance(disk, Converted):
            layout[name] = Converted(at + disk.key, disk.layout)
        else:
            layout[name] = at + disk
    return layout


def mxfp4_keys(key: str) -> tuple[str, str]:
    """The blocks and scales that stand for `key` in an MXFP4 checkpoint (loading/mxfp4.py)."""
    return key + "_blocks", key + "_scales"


def mxfp4_stored(layout: dict, where: dict) -> set[str]:
    """The Converted keys that a checkpoint stores as MXFP4 blocks and scales instead of themselves."""
    return {disk.key for disk in layout.values()
            if isinstance(disk, Converted) and disk.key not in where and mxfp4_keys(disk.key)[0] in where}


# ----------------------------------------------------------------------------- loading

def default_weights_dir() -> str:
    """Where minimoe writes the checkpoints it builds (the default model, the tiny one): $MINIMOE_WEIGHTS,
    else the repository's weights/ folder."""
    return os.environ.get("MINIMOE_WEIGHTS") or str(Path(__file__).resolve().parents[2] / "weights")


def hub_cache_dir(cache_dir=None) -> str | None:
    """Where hub ids download: `cache_dir`, else $MINIMOE_WEIGHTS, else None, which is huggingface_hub's own
    cache ($HF_HUB_CACHE, $HF_HOME/hub, ~/.cache/huggingface/hub), so a model already cached for
    transformers is not downloaded again."""
    return cache_dir or os.environ.get("MINIMOE_WEIGHTS") or None


def resolve_checkpoint(name_or_path, cache_dir=None, revision=None) -> Path:
    """A local folder as it is, or a hub repo id downloaded (config, safetensors, tokenizer only) into
    hub_cache_dir(cache_dir); the folder returned is then the snapshot, named by its commit sha."""
    path = Path(name_or_path)
    if path.is_dir():
        if revision is not None:
            raise ValueError(f"{name_or_path}: a revision ({revision}) applies to hub ids only, not to a local folder")
        return path
    name = str(name_or_path)
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise FileNotFoundError(f"{name}: no such checkpoint folder, and not a hub repo id like 'allenai/OLMoE-1B-7B-0924'")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    try:
        return Path(snapshot_download(name, revision=revision, cache_dir=hub_cache_dir(cache_dir),
                                      allow_patterns=HUB_FILES))
    except LocalEntryNotFoundError as e:
        raise FileNotFoundError(f"{name}@{revision or 'main'}: not in the local cache "
                                f"({hub_cache_dir(cache_dir) or 'the Hugging Face default'}) and the hub cannot be "
                                f"reached (HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '0')}): {e}") from e


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


def from_pretrained(name_or_path, *, dtype=None, device=None, cache_dir=None, revision=None) -> MoEForCausalLM:
    """Load an official Granite-MoE or OLMoE checkpoint from a folder or a hub repo id."""
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
    quantized = mxfp4_stored(layout, where)

    # Allocate every parameter at its final dtype and device, and note where each disk key lands:
    # a whole parameter, or (OLMoE) one expert's gate, up or down rows inside a stacked bank.
    destination = {}  # disk key -> tensor (a parameter or a contiguous slice of one, or a converted key's buffer)
    converted = []  # (parameter, conversion, its buffers), converted once every file is read
    for name, disk in layout.items():
        meta = model.get_parameter(name)
        value = torch.empty(meta.shape, dtype=dtype, device=device)
        advise_huge_pages(value)  # 512x fewer first-touch page faults while the file is copied in
        if isinstance(disk, Converted):  # read as stored (its shape: ours taken to the disk layout), then converted
            from_disk, to_disk, from_mxfp4 = CONVERSIONS[disk.layout]
            if disk.key in quantized:
                if from_mxfp4 is None:
                    raise KeyError(f"{folder}: {disk.key!r} is stored as MXFP4 blocks and scales; it must be dense")
                E, out, inner = meta.shape  # MXFP4 stores [E, out, in] as 32-value blocks along in
                buffers = [torch.empty(E, out, inner // 32, 16, dtype=torch.uint8), torch.empty(E, out, inner // 32, dtype=torch.uint8)]
                destination.update(zip(mxfp4_keys(disk.key), buffers))
                converted.append((value, lambda b, s, f=from_mxfp4, k=disk.key: f(b, s, dtype, k), buffers))
            else:
                buffer = torch.empty(to_disk(torch.empty(meta.shape, device="meta")).shape, dtype=dtype)
                destination[disk.key] = buffer
                converted.append((value, from_disk, [buffer]))
        elif isinstance(disk, str):
            destination[disk] = value
        else:  # per-expert keys in (expert, part) order; part p fills rows [p*rows, (p+1)*rows)
            parts = len(disk) // config.num_experts
            rows = meta.shape[1] // parts
            for i, key in enumerate(disk):
                j, p = divmod(i, parts)
                destination[key] = value[j, p * rows:(p + 1) * rows]
        module_name, _, leaf = name.rpartition(".")
        model.get_submodule(module_name)._parameters[leaf] = nn.Parameter(value, requires_grad=meta.requires_grad)
    for file, weights in files.items():  # one file at a time, front to back
        with open(weights.path, "rb", buffering=0) as f:
            for key in weights.keys():
                if key in destination and where.get(key) == file:
                    weights.read_into(key, destination[key], f)
    for value, convert, buffers in converted:
        value.copy_(convert(*buffers))
    model.tie_weights()
    still_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if still_meta:
        raise KeyError(f"{folder}: no checkpoint key fills parameter {still_meta[0]!r}")
    return model.eval()


def weight_index(folder: Path, config: MoEConfig) -> tuple[dict[str, WeightFile], dict[str, str]]:
    """(safetensors file -> WeightFile, its header read; disk key -> its file), checked strictly
    against `checkpoint_layout(config)`: a missing or unexpected key raises, naming it."""
    layout = checkpoint_layout(config)
    files, where = {}, {}  # file -> WeightFile (header only), disk key -> file
    for file, keys in _weight_files(folder).items():
        files[file] = WeightFile(folder / file)
        for key in files[file].entries if keys is None else keys:
            if key not in files[file].entries:
                raise KeyError(f"{folder}: the shard index puts {key!r} in {file}, which does not hold it")
            where[key] = file
    quantized = mxfp4_stored(layout, where)
    expected = set()
    for disk in layout.values():
        if isinstance(disk, Converted):
            expected.update(mxfp4_keys(disk.key) if disk.key in quantized else (disk.key,))
        else:
            expected.update((disk,) if isinstance(disk, str) else disk)
    ignored = {"lm_head.weight"} if config.tie_word_embeddings else set()  # tied: the embedding serves
    prefixes = family_of(config.model_type).ignored_prefixes
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
            out[disk.key] = CONVERSIONS[disk.layout][1](value)
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
    return to_disk_layout(model.config, {n: model.get_parameter(n).detach().cpu() for n in names})


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


# ----------------------------------------------------------------------------- tokenizer

class Tokenizer:
    """The checkpoint's tokenizer.json (via `tokenizers`) with the special ids from its config."""

    def __init__(self, tokenizer, config: MoEConfig):
        self.tokenizer = tokenizer
        self.eos_token_id, self.pad_token_id, self.bos_token_id = config.eos_token_id, config.pad_token_id, config.bos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __len__(self):
        return self.tokenizer.get_vocab_size()


def load_tokenizer(name_or_path, *, cache_dir=None, revision=None) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer
    folder = resolve_checkpoint(name_or_path, cache_dir, revision)
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no tokenizer.json")
    try:
        tokenizer = HFTokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for unreadable JSON
        raise ValueError(f"{path}: not a readable tokenizer ({e}); the file is truncated or corrupt") from None
    return Tokenizer(tokenizer, read_config(folder))
