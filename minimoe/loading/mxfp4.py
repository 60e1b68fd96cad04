"""MXFP4 dequantisation: gpt-oss's expert weights as the official checkpoint stores them -> dense tensors.

The OCP Microscaling (MX) format, v1.0: blocks of 32 values share one E8M0 scale 2^(s - 127)
(s = 255 is NaN); each value is FP4 E2M1 (sign bit 3, exponent bits 2-1, mantissa bit 0), so
|value| is one of 0, 0.5, 1, 1.5, 2, 3, 4, 6 times the scale.

As openai/gpt-oss-20b stores it (transformers 4.57's integrations/mxfp4.py reads the same):
- `<proj>_blocks` uint8 [E, R, C/32, 16]: row r of expert e, block b, 16 bytes of 32 values; the
  LOW nibble of byte j is value 2j, the HIGH nibble value 2j + 1;
- `<proj>_scales` uint8 [E, R, C/32];
- R x C is the matrix as [out, in]: gate_up_proj [E, 2I, D] (gate and up rows interleaved),
  down_proj [E, D, I]. That is our banks' [E, out, in] layout already; transformers transposes it
  to its own [E, in, out].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from minimoe.core.adaptation.quantized import dequantize_in_chunks, digest_sample

BLOCK = 32  # values per shared scale
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # |value| of codes 0-7; codes 8-15 are their negatives
NAN_SCALE = 255  # E8M0's NaN


class MXFP4Error(ValueError):
    """Blocks and scales that are not MXFP4 as gpt-oss stores it; the message names what is wrong."""


def dequantize_mxfp4(blocks, scales, dtype=torch.bfloat16, name: str = "tensor"):
    """blocks uint8 [..., R, C/32, 16], scales uint8 [..., R, C/32] -> [..., R, C] in `dtype`.

    Exact in bf16 and fp32 (every value is a 2-bit mantissa times a power of two in their range).
    Decoded a few leading slices at a time (`dequantize_in_chunks`), so a layer's bank needs no fp32 copy of itself."""
    check_mxfp4(blocks, scales, name)
    *lead, R, nb, _ = blocks.shape
    out = torch.empty(*lead, R, nb * BLOCK, dtype=dtype, device=blocks.device)
    flat_blocks, flat_scales = blocks.reshape(-1, R, nb, 16), scales.reshape(-1, R, nb)
    return dequantize_in_chunks(out, mxfp4_temporary_bytes(R * nb * BLOCK, dtype),
                                lambda c: decode_mxfp4(flat_blocks[c], flat_scales[c], dtype))


def check_mxfp4(blocks, scales, name: str = "tensor"):
    """Raise MXFP4Error, naming `name`, unless blocks and scales are MXFP4 as gpt-oss stores it (module docstring)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise MXFP4Error(f"{name}: blocks and scales must be uint8; got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 3 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise MXFP4Error(f"{name}: blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match; "
                         f"expected blocks [..., R, C/32, 16] and scales [..., R, C/32]")
    if (scales == NAN_SCALE).any():
        raise MXFP4Error(f"{name}: a scale is 255, E8M0's NaN; expected 0-254")


def decode_mxfp4(blocks, scales, dtype):
    """Checked blocks [..., C/32, 16] and scales [..., C/32] -> [..., C] in `dtype`, whatever the leading
    dimensions, in the same few ops (a whole bank at once: `MXFP4Weight`): one lookup of each byte's two
    values, the scales' powers of two, a cast. No check and no read-back, so that torch.compile traces it."""
    work = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
    values = F.embedding(blocks.int(), e2m1_pairs(work, blocks.device)).flatten(-2)  # [..., C/32, 32], low nibble first
    return values.ldexp_((scales.int() - 127).unsqueeze(-1).to(work)).flatten(-2).to(dtype)


def mxfp4_temporary_bytes(n: int, dtype: torch.dtype) -> int:
    """What `decode_mxfp4` holds at once for n values decoded to `dtype`: the int32 codes (4 bytes a byte of two
    values) and the lookup's result in its working dtype, both alive in the lookup (the codes are freed before the
    scales are computed, n / 32 of them); where `dtype` is neither bf16 nor fp32, the fp32 values and their cast."""
    work = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
    return n // 2 * 4 + n * work.itemsize + (0 if work == dtype else n * dtype.itemsize)


_PAIRS: dict[tuple, torch.Tensor] = {}


def e2m1_pairs(dtype, device) -> torch.Tensor:
    """[256, 2]: the two E2M1 values a byte stands for, its low nibble's first (gpt-oss's order). One per dtype and
    device."""
    key = (dtype, torch.device(device))
    if key not in _PAIRS:
        magnitude = torch.tensor(E2M1, dtype=dtype, device=device)
        table = torch.cat((magnitude, -magnitude))  # [16] value of each 4-bit code
        byte = torch.arange(256, device=device)
        _PAIRS[key] = torch.stack((table[byte & 0x0F], table[byte >> 4]), dim=-1)
    return _PAIRS[key]


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., R, C] (C a multiple of 32) -> (blocks uint8 [..., R, C/32, 16], scales uint8 [..., R, C/32]), by
    OCP MX's conversion: each block's scale is 2^(floor(log2 max|v|) - 2) (E2M1's largest exponent is 2), each
    value the nearest E2M1 value of it over that scale (beyond 6: +-6, the spec's clamp). What the tiny gpt-oss
    stores (making/tiny.py), as the release does; `dequantize_mxfp4` reads it back."""
    if w.shape[-1] % BLOCK:
        raise MXFP4Error(f"a matrix of {w.shape[-1]} columns: MXFP4 needs a multiple of {BLOCK}")
    magnitude = torch.tensor(E2M1, dtype=torch.float64)
    grid = torch.cat((magnitude, -magnitude))  # [16] value of each 4-bit code
    v = w.double().reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)
    e = torch.floor(torch.log2(v.abs().amax(-1).clamp_min(2.0 ** -120))) - 2  # [..., R, C/32]
    codes = (v[..., None] / torch.pow(2.0, e)[..., None, None] - grid).abs().argmin(-1)  # [..., R, C/32, 32]
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)  # value 2j in the low nibble
    return blocks, (e + 127).to(torch.uint8)


class MXFP4Weight:
    """A bank kept as the checkpoint's MXFP4 blocks and scales (`--quantize mxfp4`, core/adaptation/quantized.py),
    dequantised a chunk of experts at a time by `decode_mxfp4`, the same few ops per chunk whatever E: bit for bit
    the bank that dequantising on load gives (`dequantize_mxfp4`, then the record's `Layout.from_packed`, loading/layouts.py).
    That layout permutes rows (gate_up's interleaved rows to gate first), and decoding is row by row, so it is
    applied once here, to the blocks' and scales' rows: no forward pays for it. Transient while dequantising: a
    chunk's int32 codes and decoded values (`mxfp4_temporary_bytes`), at most DEQUANTIZE_CHUNK_BYTES, as nf4's.
    shape: [E, out, in] as ours; dtype: what it dequantises to."""

    def __init__(self, blocks, scales, dtype, layout=None, name: str = "tensor"):
        check_mxfp4(blocks, scales, name)  # once: dequantize_into reads nothing back (torch.compile traces it)
        if layout is not None:
            blocks, scales = layout(blocks).contiguous(), layout(scales).contiguous()
        self.blocks, self.scales, self.name = blocks, scales, name
        E, out, nb, _ = blocks.shape
        self.shape, self.dtype, self.device = torch.Size((E, out, nb * BLOCK)), dtype, blocks.device
        self.sample = None
        dense = self.dequantize_into(torch.empty(self.shape, dtype=dtype, device=self.device))  # one bank, transient
        self.sample = digest_sample(dense)  # an adapter's base digest, as of the dequantised-on-load bank

    def dequantize_into(self, out):
        """Write the bank into `out` (its shape; any float dtype and strides) a chunk of experts at a time, as
        nf4's (`dequantize_in_chunks`); returns out."""
        return dequantize_in_chunks(out, mxfp4_temporary_bytes(self.shape[-2] * self.shape[-1], self.dtype),
                                    lambda c: decode_mxfp4(self.blocks[c], self.scales[c], self.dtype))

    def to(self, device):
        self.blocks, self.scales, self.device = self.blocks.to(device), self.scales.to(device), torch.device(device)
        return self

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() + self.scales.numel()
