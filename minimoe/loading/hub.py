"""Where a model's files come from: a local folder as it is, or a hub repo id from huggingface_hub's cache
(downloaded once: config, safetensors, tokenizer), with one line that says what to do when it is not cached
and cannot be downloaded; and where minimoe writes the checkpoints it builds.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

HUB_FILES = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json",
             "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"]


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
    with not_cached_says_what_to_do(name, revision, cache_dir):
        return Path(snapshot_download(name, revision=revision, cache_dir=hub_cache_dir(cache_dir),
                                      allow_patterns=HUB_FILES))


def hub_file(name: str, filename: str, cache_dir=None, revision=None) -> Path:
    """One file of a hub repo (config.json, the shard index), downloaded alone, with resolve_checkpoint's error."""
    from huggingface_hub import hf_hub_download
    with not_cached_says_what_to_do(name, revision, cache_dir):
        return Path(hf_hub_download(name, filename, revision=revision, cache_dir=hub_cache_dir(cache_dir)))


@contextlib.contextmanager
def not_cached_says_what_to_do(name: str, revision, cache_dir):
    """huggingface_hub's LocalEntryNotFoundError (not cached, and offline or unreachable) as one line that says
    why and what to do instead: a local folder, or the download (HF_HUB_OFFLINE=0, a reachable hub)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError
    try:
        yield
    except LocalEntryNotFoundError as e:
        why, download = (("HF_HUB_OFFLINE=1 forbids downloads", "HF_HUB_OFFLINE=0 to download it") if constants.HF_HUB_OFFLINE else
                         ("the hub cannot be reached", "a machine that reaches huggingface.co to download it"))
        where = hub_cache_dir(cache_dir) or "the Hugging Face default"
        raise FileNotFoundError(f"{name}@{revision or 'main'}: not in the local cache ({where}) and {why}; pass a "
                                f"local checkpoint folder (config.json and *.safetensors) in its place, or use "
                                f"{download}") from e
