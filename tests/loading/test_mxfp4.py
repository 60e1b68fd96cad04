"""MXFP4 dequantisation (loading/mxfp4.py) against tensors quantised here by the format's definition
(OCP Microscaling v1.0: FP4 E2M1 decoded from its bit fields, E8M0 scales 2^(s-127), 32 values a
block; the nibble order gpt-oss uses), not against the loader's own inverse; and the same bytes
through transformers 4.57's own MXFP4 reader."""
import pytest
import torch
pytest.importorskip("transformers")  # the oracle: a plain install skips these tests
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from minimoe.loading.mxfp4 import MXFP4Error, dequantize_mxfp4, quantize_mxfp4


def e2m1(code: int) -> float:
    """FP4 E2M1 from its bits: sign s (bit 3), exponent e (bits 2-1, bias 1), mantissa m (bit 0)."""
    s, e, m = code >> 3, (code >> 1) & 3, code & 1
    magnitude = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)  # e == 0: subnormal
    return -magnitude if s else magnitude


def quantised(shape_rows, cols, seed=0):
    """Random MXFP4 bytes and, value by value, the real numbers they stand for.
    -> blocks uint8 [*rows, cols/32, 16], scales uint8 [*rows, cols/32], values fp64 [*rows, cols]."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (*shape_rows, cols), generator=g)
    exps = torch.randint(100, 150, (*shape_rows, cols // 32), generator=g)  # s; scale 2^(s-127)
    values = torch.tensor([e2m1(c) for c in codes.flatten().tolist()], dtype=torch.float64).view(codes.shape)
    values = values * torch.pow(2.0, exps.double() - 127).repeat_interleave(32, dim=-1)
    pairs = codes.view(*shape_rows, cols // 32, 16, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)  # value 2j in the low nibble
    return blocks, exps.to(torch.uint8), values


def test_e2m1_from_bits_is_the_spec_table():
    assert [e2m1(c) for c in range(8)] == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert [e2m1(c) for c in range(8, 16)] == [-0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantised_values_are_the_ones_quantised_by_definition(dtype):
    blocks, scales, values = quantised((3, 10), 64)  # [E, R, C/32, 16]
    out = dequantize_mxfp4(blocks, scales, dtype=dtype)
    assert out.shape == (3, 10, 64) and out.dtype == dtype
    assert torch.equal(out.double(), values)  # exact: each value is a short mantissa times a power of two


def quantise_by_spec(w):
    """w [..., R, C] (C a multiple of 32) -> blocks uint8 [..., R, C/32, 16], scales uint8 [..., R, C/32]
    (loading/mxfp4.quantize_mxfp4: OCP MX's conversion) and the values they stand for [..., R, C] (fp64,
    decoded here from the bits, apart from the library's decoder)."""
    blocks, scales = quantize_mxfp4(w)
    grid = torch.tensor([e2m1(c) for c in range(16)], dtype=torch.float64)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()  # value 2j in the low nibble
    values = grid[codes] * torch.pow(2.0, scales.double() - 127)[..., None]
    return blocks, scales, values.reshape(w.shape)


def test_a_tensor_quantised_by_the_spec_rule_comes_back_within_half_a_step_or_clamped():
    """Dequantised, each value lands within half an E2M1 step of its original or, beyond 6 times its
    block's scale, at +-6 times it; and exactly on the value the bits stand for."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(2, 4, 64, generator=g, dtype=torch.float64) * 0.05
    blocks, scales, values = quantise_by_spec(w)
    out = dequantize_mxfp4(blocks, scales, dtype=torch.float32).double()
    assert torch.equal(out, values)
    scale = 2.0 ** (scales.double() - 127).repeat_interleave(32, dim=-1)
    inside = w.abs() <= 6 * scale  # E2M1's widest gap is 2 (4 to 6): half of it is one scale
    assert ((out - w).abs() <= scale + 1e-12)[inside].all()
    assert ((out - w.sign() * 6 * scale).abs() < 1e-12)[~inside].all()
    assert (out - w).abs().max() < 0.25 * w.abs().max()  # a real approximation, not zeros


def test_transformers_reads_the_same_bytes_to_the_same_weights():
    blocks, scales, _ = quantised((2, 12), 96, seed=1)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, C, R]: transformers' layout
    assert torch.equal(dequantize_mxfp4(blocks, scales, dtype=torch.float32), ref.transpose(1, 2))


def test_bad_blocks_and_scales_are_named():
    blocks, scales, _ = quantised((2, 4), 64)
    with pytest.raises(MXFP4Error, match="experts.down_proj: blocks and scales must be uint8"):
        dequantize_mxfp4(blocks.int(), scales, name="experts.down_proj")
    with pytest.raises(MXFP4Error, match=r"do not match; expected blocks \[..., R, C/32, 16\]"):
        dequantize_mxfp4(blocks, scales[:, :3])
    scales[1, 2, 0] = 255
    with pytest.raises(MXFP4Error, match="255, E8M0's NaN"):
        dequantize_mxfp4(blocks, scales)


def gate_up_bank(experts: int, dtype):
    """An MXFP4Weight of random bytes [E, 2I, D] with gate_up's interleaved rows, and the bank as dequantising on load
    gives it, one expert at a time (dequantize_mxfp4, then the layout's from_packed), as MXFP4Weight did before."""
    from minimoe.loading.layouts import LAYOUTS
    from minimoe.loading.mxfp4 import MXFP4Weight
    blocks, scales, _ = quantised((experts, 8), 64, seed=experts)
    layout = LAYOUTS["gate_up_interleaved"].from_packed
    per_expert = torch.cat([layout(dequantize_mxfp4(blocks[e:e + 1], scales[e:e + 1], dtype)) for e in range(experts)])
    return MXFP4Weight(blocks, scales, dtype, layout), per_expert


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_bank_dequantised_whole_is_the_per_expert_one_bit_for_bit(dtype):
    """MXFP4Weight dequantises the whole bank at once, its layout applied to the blocks' and scales' rows at load:
    bit for bit the bank dequantised one expert at a time and laid out after (gate_up's interleaved rows)."""
    packed, per_expert = gate_up_bank(5, dtype)
    out = packed.dequantize_into(torch.empty(packed.shape, dtype=dtype))
    assert out.shape == per_expert.shape and torch.equal(out, per_expert)


def test_a_bank_dequantises_in_the_same_few_ops_per_chunk_whatever_its_experts(monkeypatch):
    """Dequantising an MXFP4 bank dispatches the same ops for 2 experts as for 6 while one chunk holds them, and few of
    them: one lookup over the chunk, not a set of kernels per expert. With chunks of 2 experts (DEQUANTIZE_CHUNK_BYTES,
    nf4's plan), 6 experts are 3 chunks of those same ops, bit for bit the whole bank."""
    from minimoe.core.adaptation import quantized
    from minimoe.loading.mxfp4 import mxfp4_temporary_bytes
    from tests.core.adaptation.test_quantized import Dispatched  # nf4's bank counts its ops the same way

    def dequantize(packed):
        out = torch.empty(packed.shape, dtype=torch.bfloat16)
        with Dispatched() as dispatched:
            packed.dequantize_into(out)
        return out, dispatched.ops
    banks = {experts: gate_up_bank(experts, torch.bfloat16)[0] for experts in (2, 6)}
    whole = {experts: dequantize(packed) for experts, packed in banks.items()}
    assert whole[2][1] == whole[6][1], whole
    assert len(whole[6][1]) <= 16, whole[6][1]
    monkeypatch.setattr(quantized, "DEQUANTIZE_CHUNK_BYTES", 2 * mxfp4_temporary_bytes(8 * 64, torch.bfloat16))
    out, ops = dequantize(banks[6])
    view, *chunk = whole[2][1]  # the bank viewed as matrices, then one chunk's ops
    assert ops == [view] + 3 * chunk, ops
    assert torch.equal(out, whole[6][0])
