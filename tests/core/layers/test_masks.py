"""Attention masks (core/layers/masks.py): FlexAttention's block mask, CUDA's path for padded and packed rows,
against the bool mask that SDPA takes everywhere else, and the cases that keep the bool mask.

The CPU runs flex forward only (torch 2.13 has no flex backward there); tests/test_cuda.py holds the
backward on a GPU."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import minimoe.core.decoder.model as model_module
from minimoe.core.layers.masks import FULL, block_mask, bool_mask, mask_kind
from tests.conftest import tiny_model

KINDS = [FULL, mask_kind(window=3), mask_kind(chunk=4)]


def packed_rows():
    """Two rows of packed answer choices (segment 0 the prompt, 1-3 the choices), padded at the end, with
    each candidate's own positions (its choice continues its prompt), as make_choice_batch writes them."""
    seg = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 3, 3, 0, 0, 0, 0],
                        [0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 0, 0, 0]])
    pad = torch.tensor([[1] * 12 + [0] * 4, [1] * 13 + [0] * 3])
    positions = torch.tensor([[0, 1, 2, 3, 4, 3, 4, 5, 3, 4, 5, 6, 0, 0, 0, 0],
                              [0, 1, 2, 3, 4, 5, 6, 7, 5, 6, 5, 6, 7, 0, 0, 0]])
    return seg, pad, positions


@pytest.mark.parametrize("kind", KINDS, ids=["causal", "window", "chunk"])
def test_block_mask_allows_what_the_bool_mask_does(kind):
    """With segments, with padding (left and right), and with both: every (query, key) the block mask
    allows, the bool mask allows, and no other."""
    from torch.nn.attention.flex_attention import create_mask
    seg, pad, positions = packed_rows()
    left = torch.ones(2, 16, dtype=torch.long)
    left[0, :5] = 0
    for s, m in ((seg, None), (None, pad), (seg, pad), (None, left)):
        dense = bool_mask(m, 2, 16, 0, "cpu", s, kind, positions)
        flex = block_mask(m, s, 2, 16, kind, positions)
        assert torch.equal(create_mask(flex.mask_mod, 2, 1, 16, 16, device="cpu"), dense)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # the CPU's reference path
def test_flex_forward_equals_sdpa(family, monkeypatch):
    """A family's logits with FlexAttention on packed, padded rows (its mixers taking a block mask) equal
    the SDPA path's, forward only."""
    model = tiny_model(family)
    seg, pad, positions = packed_rows()
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids, attention_mask=pad, segment_ids=seg, position_ids=positions).logits
        monkeypatch.setattr(model_module, "FLEX_DEVICES", {"cpu"})
        got = model(ids, attention_mask=pad, segment_ids=seg, position_ids=positions).logits
    torch.testing.assert_close(got[pad.bool()], want[pad.bool()], rtol=1e-5, atol=1e-5)


class Passthrough(TorchDispatchMode):  # a user's mode, as a FLOP counter or bench/common.py's HostSyncs
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def mask_types(model, seg, pad):
    h = torch.zeros(2, 16, model.config.hidden_size)
    return {type(m).__name__ for m in model.mixer_inputs(2, 16, h, pad, segment_ids=seg).masks.values()}


def test_flex_runs_where_inductor_and_dynamo_take_it(monkeypatch):
    """On a flex device, padded rows get a BlockMask for 16-wide heads, and a bool mask instead for heads
    under 16 (inductor's flex kernel refuses them: a tiny Mixtral's 12 failed on an H200), for sinks,
    and under a user's TorchDispatchMode (dynamo will not compile flex there)."""
    monkeypatch.setattr(model_module, "FLEX_DEVICES", {"cpu"})
    seg, pad, _ = packed_rows()
    assert mask_types(tiny_model("olmoe"), seg, pad) == {"BlockMask"}
    assert mask_types(tiny_model("olmoe", head_dim=12), seg, pad) == {"Tensor"}
    assert mask_types(tiny_model("gpt_oss"), seg, pad) == {"Tensor"}
    with Passthrough():
        assert mask_types(tiny_model("olmoe"), seg, pad) == {"Tensor"}
