"""DeepSeek-V4's attention: a sliding window over one shared key/value head, plus compressed entries of the past.

Letters: B batch, T positions, D hidden, H heads, d head_dim, r rope dims (the last r of each head), Q the query's
low rank, m a compression rate, W = T // m compressed entries, g o_groups, o o_lora_rank, h/c/k the indexer's
heads, head width and top-k.

Every layer (config.json's layer_types, ours `compressed_layer_types`):
    q = rms(q_b_proj(q_a_norm(q_a_proj(x))))       [B, H, T, d]  per head, weightless
    kv = kv_norm(kv_proj(x))                        [B, 1, T, d]  one head, the keys *and* the values
    q, kv turned by rope on their last r dims (interleaved pairs, core/layers/rope.py's rotate_trailing_pairs)
    attention over the last sliding_window positions (and, below, compressed entries), with a learned sink logit
    per head (core/token_mixers/sinks.py); the output's rope dims turned back (-sin), as values carry the turn
    y = o_b_proj(o_a_proj(out))                     out as g groups of H d / g -> g x o (one matrix per group) -> D
"sliding_attention" layers stop there (rope: rope_theta). The others (rope: compress_rope_theta, and its YaRN
`compress_rope_scaling`) append compressed entries to the keys, one per window of m positions (`Compressor`):
    entry_w = kv_norm(sum_j softmax_j(gate_j + position_bias_j) * kv_j)   over window w's positions j, per channel,
    turned by rope at position w m; query at position p sees entry w once its window is whole: w < (p + 1) // m.
- "heavily_compressed_attention" (HCA, m = 128): windows apart, every whole one seen.
- "compressed_sparse_attention" (CSA, m = 4): overlapping windows (kv_proj and gate_proj give two c-wide series a
  and b per position; entry w softmaxes window w-1's a and window w's b together, 2m slots), and a lightning
  indexer (`CompressedIndexer`: its own such compressor at c = index_head_dim, its query from the query latent,
  DeepSeek-V3.2's scores, core/token_mixers/dsa_indexer.py) keeps each query's top-k entries among those it sees.

Decisions, for parity with transformers 5.23 (modeling_deepseek_v4.py, whose torch path runs on the CPU):
- Each row's windows count from its first real token (`shift_left`; its positions then count real tokens, as
  generate() gives them): right padding comes after every real position and no real query sees a window holding it
  (w < (p + 1) // m), as in transformers, whose compressors read every column. Left padding departs from
  transformers there, on purpose: its compressors pool the padding into a row's first windows, so that its output
  depends on the padding's hidden states (ours and its differ, padding queries being masked otherwise) and a padded
  row is not the row alone; ours is (tests/core/decoder/test_deepseek_v4.py).
- The indexer has no gradient (its output is a top-k), so its weights are frozen, as DSA's (docs/methods.md).
- The norms multiply their weight in fp32 (transformers keeps them fp32); q's weightless norm rounds its scale to
  the model dtype first, as the reference does; rope tables are rounded to the model dtype, turned in fp32.
- Packed rows (segment_ids): a candidate's compressed entries are those of its own row, the prompt then itself,
  so each piece runs through this mixer as its own row and its outputs go back in place (`pieces`, read on the
  host once per forward, kept in MixerInputs.shared); the rest of the model runs packed. The prompt runs once per candidate here.
- The generation cache (`CompressedSlot`): the shared key/value head of every position (the mask keeps the window,
  as for the other sliding layers), and per compressor (the layer's, CSA's indexer's; `CompressorState`) the
  projected series at each row's own positions and the entries so far. A step pools again the windows from the first
  that some row has not closed (rows close windows at different steps when their padding differs; CSA's from the
  window before, for its overlap): a few windows per step, through the full forward's code, so its entries are the
  full forward's. transformers' DeepseekV4CSACache keeps the pending positions and the overlap apart instead, with
  one window count for the batch. Every position's series are kept, as its key/value head is (kv and gate: 4 head
  widths and 4 index widths per position in a CSA layer, 2 head widths in an HCA one, beside the head's 1).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from minimoe.core.layers.masks import bool_mask, left_padding, mask_kind
from minimoe.core.layers.norms import RMSNorm
from minimoe.core.layers.rope import rope_cos_sin, rope_frequencies, rotate_trailing_pairs
from minimoe.core.token_mixers.dsa_indexer import head_weighted_scores, keep_selected
from minimoe.core.token_mixers.sinks import sink_attention

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
DEFAULT_RATES = {CSA: 4, HCA: 128}


@dataclass
class CompressedAttentionConfig:
    """Its options by flat names; the family renames config.json's q_lora_rank, layer_types and index_* onto the
    compressed_* ones (MLA and DSA own those names)."""
    compressed_layer_types: list | None = None  # per layer SLIDING, CSA or HCA (config.json's layer_types)
    compress_rates: dict | None = None  # m per compressed kind; None: DEFAULT_RATES
    compress_rope_theta: float = 160000.0  # the compressed layers' rope base
    compress_rope_scaling: dict | None = None  # their YaRN (core/layers/rope.py), None: plain rope
    compressed_q_lora_rank: int = 1024  # Q
    o_groups: int = 8  # g
    o_lora_rank: int = 1024  # o
    compressed_index_n_heads: int = 64  # h
    compressed_index_head_dim: int = 128  # c of the indexer
    compressed_index_topk: int = 512  # k

    def __post_init__(self):
        self.compress_rates = {**DEFAULT_RATES, **(self.compress_rates or {})}
        for name in ("compressed_q_lora_rank", "o_groups", "o_lora_rank", "compressed_index_n_heads",
                     "compressed_index_head_dim", "compressed_index_topk"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"config: {name} {getattr(self, name)!r}; expected an int >= 1")
        if set(self.compress_rates) != {CSA, HCA} or not all(isinstance(m, int) and m >= 1
                                                              for m in self.compress_rates.values()):
            raise ValueError(f"config: compress_rates {self.compress_rates!r}; expected an int >= 1 for each of "
                             f"{CSA!r} and {HCA!r}")
        kinds = self.compressed_layer_types
        if kinds is not None and (not isinstance(kinds, list) or not set(kinds) <= {SLIDING, CSA, HCA}):
            raise ValueError(f"config: layer_types {kinds!r}; expected a list of {(SLIDING, CSA, HCA)}")

    def resolve(self, config):
        """What it needs of the model around it (config: the MoEConfig)."""
        kinds, H, d, r = self.compressed_layer_types, config.num_attention_heads, config.head_dim, config.rope_dim
        if kinds is None or len(kinds) != config.num_hidden_layers:
            raise ValueError(f"config: layer_types {kinds!r}; expected one of {(SLIDING, CSA, HCA)} per layer "
                             f"(num_hidden_layers={config.num_hidden_layers})")
        if not isinstance(config.sliding_window, int) or config.sliding_window < 1:
            raise ValueError(f"config: sliding_window {config.sliding_window!r}; expected an int >= 1 (every "
                             f"DeepSeek-V4 layer attends within it)")
        if (H * d) % self.o_groups:
            raise ValueError(f"config: o_groups {self.o_groups} does not divide the heads' {H} x {d} outputs")
        if not r <= min(d, self.compressed_index_head_dim):
            raise ValueError(f"config: the rope's {r} dims exceed head_dim {d} or index_head_dim "
                             f"{self.compressed_index_head_dim}")


class PairRope:
    """cos, sin [B, T, r/2] of one rope base (and scaling) at given positions, in the model dtype."""

    def __init__(self, r: int, theta: float, scaling: dict | None, max_position_embeddings: int):
        self.args = (r, theta, scaling, max_position_embeddings)  # frequencies at first use: a model built on the
        self.inv_freq = None  # meta device (from_pretrained) has no values to compute them from

    def tables(self, positions, dtype):  # positions [B, T] -> cos, sin [B, T, r/2]
        if torch.compiler.is_compiling():  # traced: in the graph, no write to self (a compiled checkpoint refuses it)
            inv_freq, factor = rope_frequencies(*self.args)
            inv_freq = inv_freq.to(positions.device)
        else:
            if self.inv_freq is None:
                self.inv_freq, self.factor = rope_frequencies(*self.args)
            if self.inv_freq.device != positions.device:  # moved once, not copied to the device at every call
                self.inv_freq = self.inv_freq.to(positions.device)
            inv_freq, factor = self.inv_freq, self.factor
        cos, sin = rope_cos_sin(positions, inv_freq, factor, dtype)
        half = cos.shape[-1] // 2
        return cos[..., :half], sin[..., :half]


class Compressor(nn.Module):
    """One entry per whole window of m positions (the module docstring); `overlap`: CSA's two series."""

    def __init__(self, hidden_size: int, width: int, rate: int, overlap: bool, eps: float):
        super().__init__()
        self.c, self.rate, self.overlap = width, rate, overlap
        series = 2 * width if overlap else width
        self.kv_proj = nn.Linear(hidden_size, series, bias=False)
        self.gate_proj = nn.Linear(hidden_size, series, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, series))
        self.kv_norm = RMSNorm(width, eps, weight_in_fp32=True)

    def entries(self, x, rope: PairRope, pad, state: "CompressorState | None" = None):
        """x [B, T, D], pad [B] each row's left padding -> [B, W, c]: the entries of each row's whole windows so far,
        counted from its first real token (with `state`: the cache's, x's columns after them), each turned at its
        window's first position. Entries past a row's whole windows hold what no query of it sees."""
        m = self.rate
        series = torch.cat((self.kv_proj(x), self.gate_proj(x)), dim=-1)  # [B, T, 2 series]
        if state is None:
            own, lo, hi = shift_left(series, pad), 0, x.shape[1] // m
        else:  # the windows from the first that a row has not closed
            own, lo, hi = state.write(series, pad)
        first = max(lo - 1, 0) if self.overlap else lo  # CSA's window lo reads window lo-1's series a
        new = self.pool(own[:, first * m:hi * m], first, rope)[:, lo - first:]
        return new if state is None else state.store(new, lo)

    def pool(self, series, first: int, rope: PairRope):  # series [B, n m, 2 series] of windows first.. -> [B, n, c]
        B, n, m, c = series.shape[0], series.shape[1] // self.rate, self.rate, self.c
        if n == 0:
            return series.new_zeros(B, 0, c)
        kv, gate = series.view(B, n, m, -1).chunk(2, dim=-1)
        gate = gate + self.position_bias
        if self.overlap:  # entry w: window w-1's series a (none before the first: weight 0) and window w's b
            kv = torch.cat((F.pad(kv[:, :-1, :, :c], (0, 0, 0, 0, 1, 0)), kv[..., c:]), dim=2)  # [B, n, 2m, c]
            gate = torch.cat((F.pad(gate[:, :-1, :, :c], (0, 0, 0, 0, 1, 0), value=float("-inf")), gate[..., c:]), 2)
        pooled = self.kv_norm((kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2))  # [B, n, c]
        cos, sin = rope.tables((first + torch.arange(n, device=series.device))[None] * m, series.dtype)
        return rotate_trailing_pairs(pooled, cos, sin)


def shift_left(x, pad):
    """x [B, T, ...] -> each row b's columns pad_b.. at 0..; its last column repeated after (what no query sees)."""
    T = x.shape[1]
    cols = (torch.arange(T, device=x.device)[None] + pad[:, None]).clamp(max=T - 1)  # [B, T]
    return x[torch.arange(x.shape[0], device=x.device)[:, None], cols]


def own_positions(pad, start: int, T: int):
    """pad [B] -> [B, T]: the positions of columns start.. in each row's own count (its padding's negative)."""
    return torch.arange(start, start + T, device=pad.device)[None] - pad[:, None]


class CompressorState:
    """One compressor's running windows in the generation cache: the projected series (kv and gate, unbiased) at each
    row's own positions [B, S_max + 1, 2 series] (the last slot takes padding's), the entries so far [B, W_max, c],
    and the windows every row has closed (those from it are pooled again at each step, CSA's from the one before)."""

    def __init__(self, batch_size: int, max_len: int, rate: int, width: int, series: int, dtype, device):
        self.series = torch.zeros(batch_size, max_len + 1, 2 * series, dtype=dtype, device=device)
        self.stored = torch.zeros(batch_size, max_len // rate, width, dtype=dtype, device=device)
        self.rate, self.length = rate, 0  # columns written
        self.closed, self.pad_max = 0, 0  # windows every row has closed; the most padding of a row

    def write(self, series, pad):  # series [B, T, 2 series] of the next columns -> (all so far, lo, hi)
        B, T, _ = series.shape
        if self.length + T >= self.series.shape[1]:
            raise ValueError(f"DeepSeek-V4's cache holds {self.series.shape[1] - 1} positions; "
                             f"{self.length + T} were asked for")
        if self.length == 0:
            self.pad_max = int(pad.max())  # read on the host once, at the prefill
        own = own_positions(pad, self.length, T)
        own = own.where(own >= 0, self.series.shape[1] - 1)
        self.series[torch.arange(B, device=series.device)[:, None], own] = series
        self.length += T
        return self.series, self.closed, self.length // self.rate

    def store(self, entries, lo: int):  # entries [B, n, c] of windows lo.. -> all so far [B, lo + n, c]
        end = lo + entries.shape[1]
        self.stored[:, lo:end] = entries
        self.closed = max(0, self.length - self.pad_max) // self.rate
        return self.stored[:, :end]


class CompressedSlot:
    """A DeepSeek-V4 layer's generation cache: the shared key/value head [B, 1, S_max, d] (the keys are the values),
    and each compressor's running windows by name ("compressor", CSA's "indexer")."""

    def __init__(self, batch_size: int, max_len: int, d: int, compressors: dict, dtype, device):
        self.kv = torch.zeros(batch_size, 1, max_len, d, dtype=dtype, device=device)
        self.states = {name: CompressorState(batch_size, max_len, m, c, series, dtype, device)
                       for name, (m, c, series) in compressors.items()}

    def update(self, start: int, kv):  # kv [B, 1, T, d] at positions start.. -> all so far [B, 1, S, d]
        end = start + kv.shape[2]
        if end > self.kv.shape[2]:
            raise ValueError(f"KV cache holds {self.kv.shape[2]} positions; {end} were asked for")
        self.kv[:, :, start:end] = kv
        return self.kv[:, :, :end]


class CompressedIndexer(Compressor):
    """CSA's lightning indexer: its compressor, its query heads, DeepSeek-V3.2's scores; frozen (module docstring)."""

    def __init__(self, config, options: CompressedAttentionConfig):
        super().__init__(config.hidden_size, options.compressed_index_head_dim, options.compress_rates[CSA], True,
                         config.rms_norm_eps)
        self.h, self.topk = options.compressed_index_n_heads, options.compressed_index_topk
        self.q_b_proj = nn.Linear(options.compressed_q_lora_rank, self.h * self.c, bias=False)
        self.scorer = nn.Module()  # the checkpoint's name for the head weights: indexer.scorer.weights_proj
        self.scorer.weights_proj = nn.Linear(config.hidden_size, self.h, bias=False)
        self.requires_grad_(False)

    @torch.no_grad()
    def forward(self, x, q_latent, rope: PairRope, cos, sin, visible, pad, state: CompressorState | None = None):
        """x [B, T, D], q_latent [B, T, Q], cos/sin [B, T, r/2], visible bool [B, T, W], pad [B] -> the kept entries
        [B, T, W]."""
        B, T, _ = x.shape
        keys = self.entries(x, rope, pad, state)  # [B, W, c]
        q = rotate_trailing_pairs(self.q_b_proj(q_latent).view(B, T, self.h, self.c), cos[:, :, None], sin[:, :, None])
        scores = head_weighted_scores(q, keys, self.scorer.weights_proj, x).masked_fill(~visible, float("-inf"))
        top = scores.topk(min(self.topk, scores.shape[-1]), dim=-1).indices  # [B, T, k]
        return keep_selected(visible[:, None], top)[:, 0]


class GroupedProjection(nn.Module):
    """o_a_proj: each of g groups of the heads' outputs by its own matrix; weight [g o, H d / g] as on disk."""

    def __init__(self, in_per_group: int, out_per_group: int, groups: int):
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(groups * out_per_group, in_per_group))

    def forward(self, x):  # [B, T, g, H d / g] -> [B, T, g, o]
        return torch.einsum("btgi,goi->btgo", x, self.weight.view(self.groups, -1, x.shape[-1]))


class CompressedSparseAttention(nn.Module):
    """A DeepSeek-V4 layer's attention (the module docstring); parameters by transformers 5.23's names."""
    attribute = "self_attn"
    takes_block_mask = False  # SDPA with a bool mask: the compressed entries' visibility is per query
    config_class = CompressedAttentionConfig  # its options: MoEConfig.mixers["compressed"]

    def __init__(self, config, layer_idx: int):
        super().__init__()
        opts = config.mixers["compressed"]
        D, H, d, Q = config.hidden_size, config.num_attention_heads, config.head_dim, opts.compressed_q_lora_rank
        self.H, self.d, self.groups, self.eps = H, d, opts.o_groups, config.rms_norm_eps
        self.kind = opts.compressed_layer_types[layer_idx]
        self.q_a_proj = nn.Linear(D, Q, bias=False)
        self.q_a_norm = RMSNorm(Q, config.rms_norm_eps, weight_in_fp32=True)
        self.q_b_proj = nn.Linear(Q, H * d, bias=False)
        self.kv_proj = nn.Linear(D, d, bias=False)
        self.kv_norm = RMSNorm(d, config.rms_norm_eps, weight_in_fp32=True)
        self.o_a_proj = GroupedProjection(H * d // self.groups, opts.o_lora_rank, self.groups)
        self.o_b_proj = nn.Linear(self.groups * opts.o_lora_rank, D, bias=False)
        self.sinks = nn.Parameter(torch.zeros(H))
        self.mask_kind = mask_kind(window=config.sliding_window)
        if self.kind == SLIDING:
            self.rope = PairRope(config.rope_dim, config.rope_theta, None, config.max_position_embeddings)
        else:
            self.rope = PairRope(config.rope_dim, opts.compress_rope_theta, opts.compress_rope_scaling,
                                 config.max_position_embeddings)
            self.compressor = Compressor(D, d, opts.compress_rates[self.kind], self.kind == CSA, config.rms_norm_eps)
            if self.kind == CSA:
                self.compressor.indexer = CompressedIndexer(config, opts)

    @staticmethod
    def cache_slot(config, layer_idx: int, batch_size: int, max_len: int, dtype, device) -> CompressedSlot:
        opts = config.mixers["compressed"]
        kind = opts.compressed_layer_types[layer_idx]
        series = 2 if kind == CSA else 1  # CSA's two series a and b per position
        compressors = {} if kind == SLIDING else {"compressor": (opts.compress_rates[kind], config.head_dim,
                                                                 series * config.head_dim)}
        if kind == CSA:
            c = opts.compressed_index_head_dim
            compressors["indexer"] = (opts.compress_rates[CSA], c, 2 * c)
        return CompressedSlot(batch_size, max_len, config.head_dim, compressors, dtype, device)

    @staticmethod
    def read_layout(inputs):
        """Packed rows' pieces onto inputs.shared["pieces"], read on the host once per forward (mixers.py)."""
        if inputs.segment_ids is not None and "pieces" not in inputs.shared:
            inputs.shared["pieces"] = pieces(inputs.segment_ids, inputs.attention_mask)

    def forward(self, x, inputs, cache: CompressedSlot | None = None):  # x [B, T, D]
        if inputs.segment_ids is not None:  # packed rows: each piece (prompt + one candidate) as its own row
            if cache is not None:
                raise ValueError("DeepSeek-V4's attention: packed rows (segment_ids) with a generation cache; "
                                 "expected one or the other")
            return self.packed(x, inputs)
        B, T, _ = x.shape
        if "left_padding" not in inputs.shared:  # [B], by the first such layer of this forward
            inputs.shared["left_padding"] = left_padding(inputs.attention_mask, B, x.device)
        mask = inputs.masks[self.mask_kind]  # [B, 1, T, S]: the window and padding over the cached positions too
        return self.attend(x, inputs.position_ids, mask.expand(B, 1, T, mask.shape[-1]), inputs.shared["left_padding"],
                           cache, inputs.cache_start)

    def attend(self, x, pos, mask, pad, cache: CompressedSlot | None = None, start: int = 0):
        """x [B, T, D], pos [B, T], mask bool [B, 1, T, S] (window, padding; S = start + T), pad [B] each row's left
        padding (its compressed windows count from its first real token) -> [B, T, D]."""
        B, T, _ = x.shape
        H, d = self.H, self.d
        cos, sin = self.rope.tables(pos, x.dtype)  # [B, T, r/2]
        q_latent = self.q_a_norm(self.q_a_proj(x))  # [B, T, Q]
        q = self.q_b_proj(q_latent).view(B, T, H, d).transpose(1, 2)  # [B, H, T, d]
        q = q * torch.rsqrt(q.float().pow(2).mean(-1, keepdim=True) + self.eps).to(q.dtype)
        q = rotate_trailing_pairs(q, cos[:, None], sin[:, None])
        kv = rotate_trailing_pairs(self.kv_norm(self.kv_proj(x))[:, None], cos[:, None], sin[:, None])  # [B, 1, T, d]
        if cache is not None:
            kv = cache.update(start, kv)  # [B, 1, S, d]
        if self.kind != SLIDING:
            state = cache.states if cache is not None else {}
            entries = self.compressor.entries(x, self.rope, pad, state.get("compressor"))  # [B, W, d]
            own = own_positions(pad, start, T)  # [B, T]: a query at own position p sees window w < (p + 1) // m
            whole = torch.arange(entries.shape[1], device=x.device) < ((own + 1) // self.compressor.rate)[..., None]
            if self.kind == CSA:  # [B, T, W]: of those, the indexer's top-k
                whole = self.compressor.indexer(x, q_latent, self.rope, cos, sin, whole, pad, state.get("indexer"))
            kv = torch.cat((kv, entries[:, None]), dim=2)  # [B, 1, S + W, d]
            mask = torch.cat((mask, whole[:, None]), dim=-1)
        y = sink_attention(q, kv, kv, self.sinks, mask, d ** -0.5)  # [B, H, T, d]
        y = rotate_trailing_pairs(y, cos[:, None], -sin[:, None]).transpose(1, 2)  # [B, T, H, d]
        return self.o_b_proj(self.o_a_proj(y.reshape(B, T, self.groups, -1)).flatten(2))

    def packed(self, x, inputs):
        """Packed rows (core/task/choices.py, core/task/tokens.py): every candidate's compressed entries are its own
        row's, prompt and itself, so each piece runs as that row would, its outputs put back (the prompt's, the same
        in every piece, once per piece); exactly what per-candidate rows compute."""
        B, T, D = x.shape
        self.read_layout(inputs)  # done already where the model built `inputs`; a mixer called alone reads it here
        rows, cols, valid, (at_piece, at_col) = inputs.shared["pieces"]  # [N], [N, L] x 2, [m] x 2
        N, L = cols.shape
        pos = torch.arange(L, device=x.device).expand(N, L)
        mask = bool_mask(valid.long(), N, L, 0, x.device, kind=self.mask_kind)
        no_padding = torch.zeros(N, dtype=torch.long, device=x.device)
        y = self.attend(x[rows[:, None], cols], pos, mask, no_padding)  # [N, L, D]
        out = x.new_zeros(B, T, y.shape[-1])
        out[rows[at_piece], cols[at_piece, at_col]] = y[at_piece, at_col]  # each position once (backward: its gradient once)
        return out


def pieces(segment_ids, attention_mask=None):
    """Packed rows' pieces, read on the host once: each candidate (segment s > 0) with its row's prompt (segment 0)
    before it, left-aligned -> rows [N], cols [N, L] (0 where not valid), valid [N, L], and the outputs put back,
    (piece [m], column [m]) of each: the valid positions, the prompt's in its row's first piece only (found here on
    the host: a mask index on the device is a nonzero, a sync and a compiled layer's graph break)."""
    seg = segment_ids.cpu()
    ok = torch.ones_like(seg, dtype=torch.bool) if attention_mask is None else attention_mask[:, -seg.shape[1]:].bool().cpu()
    found = []
    for r in range(seg.shape[0]):
        prompt = ((seg[r] == 0) & ok[r]).nonzero()[:, 0]
        kinds = [int(s) for s in torch.unique(seg[r][ok[r]]) if s > 0]
        found += [(r, torch.cat((prompt, ((seg[r] == s) & ok[r]).nonzero()[:, 0]))) for s in kinds] or [(r, prompt)]
    L = max(1, max(len(c) for _, c in found))
    cols = torch.zeros(len(found), L, dtype=torch.long)
    valid = torch.zeros(len(found), L, dtype=torch.bool)
    keep = torch.zeros(len(found), L, dtype=torch.bool)
    for i, (r, c) in enumerate(found):
        cols[i, :len(c)], valid[i, :len(c)] = c, True
        first = i == 0 or found[i - 1][0] != r
        keep[i, :len(c)] = True if first else seg[r][c] > 0
    dev = segment_ids.device
    return (torch.tensor([r for r, _ in found], device=dev), cols.to(dev), valid.to(dev),
            tuple(i.to(dev) for i in keep.nonzero().unbind(1)))
