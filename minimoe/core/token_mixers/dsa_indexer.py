"""DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2, GLM-5): which keys each query's MLA attends to.

Letters: B batch, T query positions, S key positions, D hidden, Q q_lora_rank, h index_n_heads,
d index_head_dim, r qk_rope_head_dim (the indexer rotates its first r dims with MLA's rope), k index_topk.

    q = wq_b(q_latent)                 [B, T, h, d]   from MLA's normed query latent (q_a_layernorm(q_a_proj(x)))
    key = LayerNorm(wk(x))             [B, S, d]      one key per position, shared by the h heads (cached)
    w = weights_proj(x) / sqrt(h)      [B, T, h]      per-query head weights, in fp32
    score[t, s] = sum_h w[t, h] relu(q[t, h] . key[s] / sqrt(d))      in fp32
    keep the top k keys of each query among those its mask allows (causal, padding, packed segments)

MLA (core/token_mixers/mla.py) then attends only to the kept keys: its mask and the selection, ANDed. Its options
are `IndexerConfig`, MLA's too (MLAConfig extends it): config.json's flat names.

Decisions, for parity with transformers 5.23 (modeling_deepseek_v32.py, modeling_glm_moe_dsa.py), whose torch path
runs on the CPU and is the one we follow (DeepSeek's FP8 kernel and Hadamard rotation are left out there too: the
rotation keeps every dot product, and FP8 is a speed measure):
- No gradient: transformers runs the indexer under no_grad, so its weights never train and nothing flows through
  the selection (a top-k has no gradient anyway). We do the same and freeze its parameters; it is not a router, no
  routing method supervises it, and LoRA does not adapt it (docs/methods.md).
- dtypes: q, the key and its LayerNorm in the model dtype; the scores, the head weights and the sum in fp32.
  transformers keeps weights_proj's weight in fp32 (`_keep_in_fp32_modules`); ours is in the model dtype, its
  output upcast. Running the whole indexer in fp32 changed no bf16 choice of the tests': the choices that bf16
  flips are flipped by the rounding of the hidden states that reach it (0.1-0.3% margins), not by its own.
- Ties and k beyond the keys: torch.topk of the masked scores (-inf outside the mask) with k = min(index_topk, S),
  as transformers: where fewer than k keys are allowed, the masked ones it picks stay masked by MLA's own mask.
- Rope: halves on the first r dims (DeepSeek-V3.2), or interleaved pairs (GLM-5, `index_rope_interleave`) reordered
  to halves first (rope.deinterleave, as MLA does): transformers' interleaved rotation writes the same layout.
- GLM-5's "shared" layers (`indexer_types`) have no indexer: they reuse the top-k of the nearest "full" layer
  before them (the model's forward hands it over in `MixerInputs.shared`, by layer index, so that a layer
  recomputed under gradient checkpointing reads its own source's, not the last one written).
- The generation cache holds the indexer's keys beside MLA's (`IndexedKVSlot`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from minimoe.core.layers.rope import apply_rope, deinterleave
from minimoe.core.token_mixers.attention import KVSlot

INDEXER_TYPES = ("full", "shared")
KEY_NORM_EPS = 1e-6  # the indexer's k_norm, a LayerNorm built with this eps by both references


@dataclass
class IndexerConfig:
    """The indexer's options, by config.json's names (index_topk None: no indexer, MLA attends to every key)."""
    index_topk: int | None = None  # k, keys kept per query
    index_n_heads: int = 64  # h
    index_head_dim: int = 128  # d (its first qk_rope_head_dim dims rotated)
    index_rope_interleave: bool = False  # rope on interleaved pairs (GLM-5), not halves (DeepSeek-V3.2)
    indexer_types: list | None = None  # per layer "full" (its own indexer) or "shared" (GLM-5); None: every layer full

    def __post_init__(self):
        if self.index_topk is None:
            return
        for name in ("index_topk", "index_n_heads", "index_head_dim"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"config: the DSA indexer's {name} {getattr(self, name)!r}; expected an int >= 1")
        kinds = self.indexer_types
        if kinds is not None and (not isinstance(kinds, list) or not set(kinds) <= set(INDEXER_TYPES)
                                  or (kinds and kinds[0] != "full")):
            raise ValueError(f"config: indexer_types {kinds!r}; expected a list of {INDEXER_TYPES}, the first layer "
                             f"'full' (a 'shared' layer reuses the top-k of a full layer before it)")

    def check_model(self, config, rope_dim: int, q_lora_rank):
        """What the indexer needs of the model around it (config: the MoEConfig)."""
        if self.index_topk is None:
            return
        if q_lora_rank is None:
            raise ValueError("config: the DSA indexer (index_topk) reads MLA's query latent; expected q_lora_rank "
                             "to be set (an int), got null")
        if not rope_dim <= self.index_head_dim:
            raise ValueError(f"config: index_head_dim {self.index_head_dim} is narrower than the rope part it rotates "
                             f"(qk_rope_head_dim {rope_dim})")
        if self.indexer_types is not None and len(self.indexer_types) != config.num_hidden_layers:
            raise ValueError(f"config: indexer_types has {len(self.indexer_types)} entries; expected "
                             f"num_hidden_layers={config.num_hidden_layers}")

    def source(self, layer: int) -> int | None:
        """The layer whose indexer picks layer `layer`'s keys (itself, or the last full one before a shared
        layer); None: no indexer."""
        if self.index_topk is None:
            return None
        kinds = self.indexer_types or ["full"] * (layer + 1)
        return max(i for i in range(layer + 1) if kinds[i] == "full")


class IndexedKVSlot(KVSlot):
    """MLA's cache (KVSlot) plus the indexer's keys [B, S_max, d], filled left to right."""

    def __init__(self, batch_size: int, heads: int, max_len: int, dk: int, dv: int, index_dim: int, dtype, device):
        super().__init__(batch_size, heads, max_len, dk, dv, dtype, device)
        self.index_keys = torch.zeros(batch_size, max_len, index_dim, dtype=dtype, device=device)

    def update_index_keys(self, start: int, keys):  # keys [B, T, d] at positions start.. -> all so far [B, S, d]
        end = start + keys.shape[1]
        self.index_keys[:, start:end] = keys
        return self.index_keys[:, :end]


class LightningIndexer(nn.Module):
    """The module docstring's scores and top-k; parameters by the checkpoint's names (self_attn.indexer.*)."""

    def __init__(self, config, q_lora_rank: int):
        super().__init__()
        options = config.mixers["mla"]
        D, self.h, self.d = config.hidden_size, options.index_n_heads, options.index_head_dim
        self.r, self.topk, self.interleaved = config.rope_dim, options.index_topk, options.index_rope_interleave
        self.wq_b = nn.Linear(q_lora_rank, self.h * self.d, bias=False)
        self.wk = nn.Linear(D, self.d, bias=False)
        self.k_norm = nn.LayerNorm(self.d, eps=KEY_NORM_EPS)
        self.weights_proj = nn.Linear(D, self.h, bias=False)
        self.requires_grad_(False)  # no gradient reaches it in transformers (module docstring)

    def rotate(self, x, cos, sin):  # x [B, T, n, d] -> the first r dims turned by rope, the rest as they are
        rot, rest = x.split([self.r, self.d - self.r], dim=-1)
        if self.interleaved:
            rot = deinterleave(rot)
        rot = apply_rope(rot.transpose(1, 2), cos, sin).transpose(1, 2)
        return torch.cat((rot, rest), dim=-1)

    @torch.no_grad()
    def forward(self, x, q_latent, cos, sin, allowed, cache: IndexedKVSlot | None = None, start: int = 0):
        """x [B, T, D], q_latent [B, T, Q], cos/sin [B, T, r], allowed bool [B or 1, 1, T, S] -> top-k [B, T, k]."""
        scores = self.scores(x, q_latent, cos, sin, cache, start).masked_fill(~allowed[:, 0], float("-inf"))
        return scores.topk(min(self.topk, scores.shape[-1]), dim=-1).indices

    def scores(self, x, q_latent, cos, sin, cache, start):  # -> [B, T, S], every key's (the docstring's score)
        B, T, _ = x.shape
        q = self.rotate(self.wq_b(q_latent).view(B, T, self.h, self.d), cos, sin)  # [B, T, h, d]
        keys = self.rotate(self.k_norm(self.wk(x))[:, :, None], cos, sin)[:, :, 0]  # [B, T, d]
        if cache is not None:
            keys = cache.update_index_keys(start, keys)  # [B, S, d]
        return head_weighted_scores(q, keys, self.weights_proj, x)


def head_weighted_scores(q, keys, weights_proj: nn.Linear, x):
    """The lightning indexer's score (module docstring; DeepSeek-V4's compressed indexer scores its compressed keys
    alike): q [B, T, h, d], keys [B, S, d], x [B, T, D] the hidden states weights_proj reads -> [B, T, S] fp32."""
    h, d = q.shape[-2:]
    scores = F.relu(torch.matmul(q.float(), keys.float().transpose(-1, -2)[:, None]) * d ** -0.5)  # [B, T, h, S]
    w = weights_proj(x.to(weights_proj.weight.dtype)).float() * h ** -0.5  # [B, T, h]
    return torch.matmul(w[:, :, None], scores)[:, :, 0]


def causal(T: int, start: int, device):
    """bool [1, 1, T, S]: query start + t sees keys 0 .. start + t (the mask the model leaves None)."""
    S = start + T
    return (torch.arange(S, device=device)[None, :] <= torch.arange(start, S, device=device)[:, None])[None, None]


def keep_selected(allowed, topk):
    """allowed bool [B or 1, 1, T, S] AND each query's selected keys (topk [B, T, k]) -> [B, 1, T, S]."""
    B, T, _ = topk.shape
    chosen = torch.zeros(B, T, allowed.shape[-1], dtype=torch.bool, device=topk.device).scatter_(-1, topk, True)
    return allowed & chosen[:, None]
