"""The input embedding's table kept packed in NF4 (--quantize-embedding), each forward dequantising the batch's rows.

Under LoRA the table never trains and no gradient reaches it, and a forward reads only the rows of the batch's
tokens: of gpt-oss-20b's 201,088 x 2,880 table (1.08 GiB in bf16), 8 x 512 tokens read 4,096 rows at most. So
the table is stored as one `NF4Weight` [V, D] (torchao's `to_nf4`, QLoRA's format, 0.28 GiB: 0.52 bytes a
value) and a lookup gathers its rows' codes, block scales and second-level factors and decodes them with
`nf4_dequantize`, the banks' own arithmetic: bit for bit torchao's dequantisation of those rows
(tests/core/adaptation/test_packed_embedding.py). A row is D / 64 whole NF4 blocks when D is a multiple of 64,
the only case packed (a block would straddle two rows otherwise). What a lookup holds beside its output: the
rows' int32 codes and their lookup, the size of the output in bf16 and less.

Measured against the other ways off the dense table (docs/quantization.md, "What fits where"): NF4 changes the
embedding's values by NF4's rounding (the base is then NF4's, as QLoRA's packed matrices are), and keeps the
table on the device, read without a host sync and traced by torch.compile; a table left in host memory would keep
the values exact and save 0.28 GiB more, at a host round trip per forward.

The module stays an nn.Embedding with a stride-0 `weight` placeholder (quantize_module's): what reads its shape
or dtype reads what it read before; `dequantize_model` gives the dense table back (export --merged). The LM head
is not packed: it is a matmul over the whole vocabulary at every scored position, whose gradient flows back
through it to the hidden states, so it would dequantise whole per chunk, as a bank does.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from minimoe.core.adaptation.quantized import NF4_BLOCK, Dequantizing, NF4Weight, nf4_dequantize, quantize_module


class PackedRows(Dequantizing):
    """Mixed into an nn.Embedding's class by `pack_embedding`: forward decodes the looked-up rows alone."""

    def forward(self, ids):
        return nf4_rows(self.packed, ids)


_CLASS = type("QuantizedEmbedding", (PackedRows, nn.Embedding), {"__module__": __name__})


def nf4_rows(packed: NF4Weight, ids: torch.Tensor) -> torch.Tensor:
    """ids [...] -> the rows of a packed [V, D] table, [..., D] in its dtype: each row's D / 2 code bytes, D / 64
    int8 block scales, and each block's second-level factor (block b's is factor b // scaler_block), decoded by
    nf4_dequantize as E = rows matrices of one row each, with one factor per block."""
    V, D = packed.shape
    per_row = D // NF4_BLOCK  # blocks a row
    scaler_block = packed.scalers.shape[1] // packed.factors.shape[1]  # blocks per second-level factor
    flat = ids.reshape(-1)  # [N]
    blocks = flat[:, None] * per_row + torch.arange(per_row, device=ids.device)  # [N, D / 64] block indices
    codes = packed.codes.view(V, D // 2)[flat]  # [N, D / 2]
    scalers = packed.scalers.view(V, per_row)[flat]  # [N, D / 64]
    factors = packed.factors[0][blocks // scaler_block]  # [N, D / 64]
    means = packed.means.expand(flat.shape[0])  # [N]: one matrix, one mean
    return nf4_dequantize(codes, scalers, factors, means, packed.pairs).view(*ids.shape, D)


def unpackable(tied: bool, hidden: int) -> str | None:
    """Why a table cannot be packed (None: it can): tied to the LM head, or rows not whole NF4 blocks."""
    if tied:
        return ("--quantize-embedding: this model ties its embedding to its LM head (tie_word_embeddings), which "
                "reads the whole table at every scored position; the table stays dense")
    if hidden % NF4_BLOCK:
        return f"--quantize-embedding: rows of {hidden} values are not whole NF4 blocks of {NF4_BLOCK}"
    return None


def pack_embedding(model: nn.Module) -> nn.Module:
    """Pack `model.model.embed_tokens`' table in NF4 (module docstring); refuses a table tied to the LM head (the
    head would need it dense) or one whose rows are not whole NF4 blocks."""
    embedding = model.model.embed_tokens
    if isinstance(embedding, PackedRows):
        return model
    if refusal := unpackable(model.lm_head.weight is embedding.weight, embedding.weight.shape[1]):
        raise ValueError(refusal)
    table = embedding.weight.data  # packed on the host: torchao's to_nf4 holds a scaled copy of the whole table
    quantize_module(embedding, NF4Weight(table.cpu(), "model.embed_tokens.weight").to(table.device))
    embedding.__class__ = _CLASS
    return model
