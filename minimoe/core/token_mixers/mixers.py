"""The token mixer: what a decoder layer runs before its MLP, swappable as the router is.

A layer's mixer is chosen by the config (`mixer_type`): `config.mixer_types[i]` where a family sets it
(the hybrids: state-space or linear-attention layers among attention layers), else MLA where the config
holds MLA's options, else GQA attention. `MIXERS` maps each name to its class, one room each:

    "attention"  core/token_mixers/attention.py  GQA: q/k norms, sinks, sliding windows (its options: AttentionConfig)
    "mla"        core/token_mixers/mla.py        DeepSeek's Multi-head Latent Attention (MLAConfig), with DSA's
                 core/token_mixers/dsa_indexer.py where index_topk is set (DeepSeek-V3.2, GLM-5)
    "mamba2"     core/token_mixers/mamba2.py     Mamba-2 (Granite 4.0-H's mamba layers): conv1d + chunked SSD scan (Mamba2Config)
    "gated_deltanet"  core/token_mixers/deltanet.py  Gated DeltaNet (Qwen3-Next's linear_attention layers) (DeltaNetConfig)
    "kda"        core/token_mixers/kda.py        Kimi Delta Attention (Kimi Linear's linear_attention layers) (KDAConfig)
    "short_conv" core/token_mixers/short_conv.py LFM2's gated short convolution: C * conv(B * x) (ShortConvConfig)
    "compressed" core/token_mixers/compressed_attention.py  DeepSeek-V4: a sliding window plus compressed entries
                 (CSA with its indexer, HCA), shared-KV heads with sinks, a grouped output (CompressedAttentionConfig)

The interface every mixer keeps (a new one is a file with its class and its config, added to `MIXERS`):
- `config_class`: a dataclass of the mixer's own options, defined and value-checked (in `__post_init__`,
  errors naming the field) in the mixer's file; its field names are the flat names config.json gives them
  (a family's `renames` map other names onto them) and no other mixer's or MoEConfig's. The model's config
  holds one per kind its layers run, `config.mixers[name]` (model.MoEConfig); an optional
  `resolve(config)` derives what needs the model's shared fields (Mamba-2's head width from hidden_size);
- `Mixer(config, layer_idx)`, an nn.Module reading `config.mixers[name]` and the shared fields; its class
  attribute `attribute` names the layer's attribute that holds it, hence its checkpoint keys
  (`model.layers.i.self_attn.*`);
- `forward(x [B, T, D], inputs: MixerInputs, cache: its slot or None) -> [B, T, D]`;
- `cache_slot(config, layer_idx, batch_size, max_len, dtype, device)` (static): the layer's entry in
  `KVCache`, which the mixer alone reads and writes (attention: keys and values; a state-space
  layer: its conv and recurrent state);
- `mask_kind` (masks.mask_kind(...): the attention pattern it reads from `inputs.masks`; one shared
  object per pattern, so that compiled layers do not recompile on the dict key) and
  `takes_block_mask` (False: it needs a bool mask, never a FlexAttention BlockMask);
- optional `read_layout(inputs)` (static): what the mixer reads on the host of packed rows (`segment_ids`), put
  on `inputs`; the model calls it once per forward before its layers run, so that a compiled layer (model.
  compile_layers) traces no host read (a graph break per read).

Decisions:
- The model builds the rope tables and the masks once per forward, for every layer (`MixerInputs`);
  a mixer that needs neither ignores them. Padding (`attention_mask`), packed rows (`segment_ids`)
  and positions are passed too, for the mixers that mask or reset a state themselves.
- This file imports the mixers, never the reverse, and model.py imports this file: no circle in core
  (tests/test_layout.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from minimoe.core.token_mixers.attention import Attention
from minimoe.core.token_mixers.compressed_attention import CompressedSparseAttention
from minimoe.core.token_mixers.deltanet import GatedDeltaNet
from minimoe.core.token_mixers.kda import KimiDeltaAttention
from minimoe.core.token_mixers.mamba2 import Mamba2Mixer
from minimoe.core.token_mixers.mla import MLAttention
from minimoe.core.token_mixers.short_conv import ShortConv

MIXERS: dict[str, type] = {"attention": Attention, "mla": MLAttention, "mamba2": Mamba2Mixer,
                           "gated_deltanet": GatedDeltaNet, "kda": KimiDeltaAttention, "short_conv": ShortConv,
                           "compressed": CompressedSparseAttention}
# A model of one block per layer (Nemotron-H, MoEConfig.single_block_layers) names its feed-forward layers by
# these in mixer_types: such a layer has no mixer, only its MoE block ("moe") or dense MLP ("mlp").
FEED_FORWARD = ("moe", "mlp")


def register_mixer(name: str, cls: type) -> type:
    """Add a mixer to `MIXERS` (a file of your own may declare one the same way)."""
    MIXERS[name] = cls
    return cls


def mixer_type(config, layer_idx: int) -> str:
    """The name of layer `layer_idx`'s mixer in `MIXERS`."""
    if config.mixer_types:
        return config.mixer_types[layer_idx]
    return "mla" if "mla" in config.mixers else "attention"


def flat_mixer_types(fields: dict) -> set[str]:
    """The mixers the layers of a flat config (config.json's names) run: `mixer_types`, else MLA where
    kv_lora_rank is set (DeepSeek's config.json), else attention."""
    if fields.get("mixer_types"):
        return set(fields["mixer_types"]) - set(FEED_FORWARD)
    return {"mla" if fields.get("kv_lora_rank") is not None else "attention"}


def mixer_field_names() -> dict[str, str]:
    """Each mixer option's flat name -> the MIXERS name whose config holds it."""
    return {f.name: name for name, mixer in MIXERS.items() for f in fields(mixer.config_class)}


def mixer_for(config, layer_idx: int):
    """Layer `layer_idx`'s mixer; None for a feed-forward layer of a one-block-per-layer model."""
    kind = mixer_type(config, layer_idx)
    return None if kind in FEED_FORWARD else MIXERS[kind](config, layer_idx)


@dataclass
class MixerInputs:
    """What every layer's mixer receives beside its hidden states (built once per forward)."""
    cos: torch.Tensor | None  # [B, T, rope dims] of the rope, None where no layer rotates
    sin: torch.Tensor | None
    masks: dict  # masks.MaskKind -> bool [B, 1, T, S] mask, a FlexAttention BlockMask, or None (plain causal)
    attention_mask: torch.Tensor | None  # [B, S] padding, 1 = real token (cached positions included), or None
    segment_ids: torch.Tensor | None  # [B, T] packed rows (core/task/choices.py), or None
    position_ids: torch.Tensor  # [B, T]
    cache_start: int = 0  # positions already in the cache (S = cache_start + T)
    segment_plan: object = None  # packed rows' layout for the recurrent mixers, read once (ssm_common.segment_plan)
    shared: dict = field(default_factory=dict)  # what a layer's mixer leaves for later layers: DSA's top-k by its index, V4's "pieces"
    ropes: dict | None = None  # layer type -> its (cos, sin) where each type has its own rope (Gemma 4), else None
    token_ids: torch.Tensor | None = None  # [B, T] the input ids, which hash-routed MoE layers read (DeepSeek-V4)


class KVCache:
    """Each layer's cache slot (its mixer's `cache_slot`), preallocated for `max_len` positions."""

    def __init__(self, config, batch_size: int, max_len: int, dtype, device):
        kinds = [mixer_type(config, i) for i in range(config.num_hidden_layers)]
        self.layers = [None if kind in FEED_FORWARD else MIXERS[kind].cache_slot(config, i, batch_size, max_len,
                                                                                  dtype, device)
                       for i, kind in enumerate(kinds)]
        self.length = 0  # positions filled so far; advanced once per forward by the model
