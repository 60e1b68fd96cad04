"""gpt-oss's expert tensors on disk <-> our banks (the `Converted` entries of its record, core/decoder/families.py):
transformers 4.57's GptOssExperts, loaded through their layouts (dense, or MXFP4 quantised here by the
format's definition), gives the same outputs from our ClampedSwiGLUExperts; and the disk layout
round-trips exactly."""
import pytest
import torch
pytest.importorskip("transformers")  # the oracle: a plain install skips these tests

from minimoe.core.layers.clamped_experts import ClampedSwiGLUExperts
from minimoe.core.decoder.family_record import FAMILIES
from minimoe.loading.checkpoint import from_mxfp4
from minimoe.loading.layouts import layout_of
from tests.core.layers.test_clamped_experts import from_interleaved, reference as clamped_reference
from tests.loading.test_mxfp4 import quantise_by_spec

E, D, I, K = 4, 64, 32, 2  # multiples of 32: MXFP4 blocks run along D (gate_up) and I (down)
KEYS = FAMILIES["gpt_oss"].layer_keys
GATE_UP, GATE_UP_BIAS, DOWN = (KEYS[f"mlp.experts.{name}"] for name in
                               ("gate_up_proj.weight", "gate_up_proj_bias", "down_proj.weight"))


def reference(seed=0):
    """transformers' router and experts at this file's sizes (tests/core/layers/test_clamped_experts.py builds them)."""
    return clamped_reference(E, D, I, K, std=0.5, seed=seed)


def ours_from(gate_up, gate_up_bias, down, down_bias):
    mine = ClampedSwiGLUExperts(E, D, I)
    with torch.no_grad():
        mine.gate_up_proj.weight.copy_(gate_up)
        mine.gate_up_proj_bias.copy_(gate_up_bias)
        mine.down_proj.weight.copy_(down)
        mine.down_proj_bias.copy_(down_bias)
    return mine


def outputs(router, ref, mine):
    x = torch.randn(10, D)
    with torch.no_grad():
        scores, experts = router(x)
        return mine(x, experts, scores.gather(1, experts)), ref(x, router_indices=experts, routing_weights=scores).reshape(-1, D)


def test_dense_tensors_load_into_our_layout_and_give_transformers_outputs():
    router, ref = reference()
    w, b = from_interleaved(ref.gate_up_proj, ref.gate_up_proj_bias)  # the test's own reading of the layout
    assert torch.equal(layout_of(GATE_UP).from_disk(ref.gate_up_proj), w)
    assert torch.equal(layout_of(GATE_UP_BIAS).from_disk(ref.gate_up_proj_bias), b)
    mine = ours_from(layout_of(GATE_UP).from_disk(ref.gate_up_proj),
                     layout_of(GATE_UP_BIAS).from_disk(ref.gate_up_proj_bias),
                     layout_of(DOWN).from_disk(ref.down_proj), ref.down_proj_bias)
    got, want = outputs(router, ref, mine)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * want.abs().max().item())


def test_the_disk_layout_round_trips_exactly():
    _, ref = reference()
    for entry, t in [(GATE_UP, ref.gate_up_proj), (GATE_UP_BIAS, ref.gate_up_proj_bias), (DOWN, ref.down_proj)]:
        assert torch.equal(layout_of(entry).to_disk(layout_of(entry).from_disk(t.detach())), t.detach())


def test_mxfp4_experts_load_to_the_values_their_bits_stand_for():
    """Quantised by OCP MX's definition (tests/loading/test_mxfp4.py) in the disk layout [E, out, in]; the
    reference then holds the decoded values, and our experts loaded from the bytes give its outputs."""
    router, ref = reference(1)
    with torch.no_grad():
        gu_blocks, gu_scales, gu_values = quantise_by_spec(ref.gate_up_proj.transpose(1, 2))
        d_blocks, d_scales, d_values = quantise_by_spec(ref.down_proj.transpose(1, 2))
        ref.gate_up_proj.copy_(gu_values.transpose(1, 2))
        ref.down_proj.copy_(d_values.transpose(1, 2))
    gate_up = from_mxfp4(GATE_UP, gu_blocks, gu_scales, torch.float32)
    down = from_mxfp4(DOWN, d_blocks, d_scales, torch.float32)
    assert torch.equal(gate_up, from_interleaved(ref.gate_up_proj, ref.gate_up_proj_bias)[0])
    assert torch.equal(down, ref.down_proj.detach().transpose(1, 2))
    mine = ours_from(gate_up, layout_of(GATE_UP_BIAS).from_disk(ref.gate_up_proj_bias), down, ref.down_proj_bias)
    got, want = outputs(router, ref, mine)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * want.abs().max().item())
