"""The Mamba-2 and Gated DeltaNet mixers (core/token_mixers/mamba2.py, core/token_mixers/deltanet.py) against transformers 4.57's own
layers on their pure-PyTorch paths (GraniteMoeHybridMambaLayer.torch_forward, Qwen3NextGatedDeltaNet with
torch_chunk_gated_delta_rule) on the same random weights: outputs in fp32 (unpadded, left and right
padded), gradients, bf16 error; and against themselves: a padded row equals the row alone, a packed row
(prompt + candidates, core/task/choices.py's layout) equals each candidate's own row, and a forward in
pieces through the state cache equals one forward over the whole row. LFM2's gated short conv
(core/token_mixers/short_conv.py) likewise, against transformers 5.23's Lfm2MoeShortConv (tf5)."""
from types import SimpleNamespace

import pytest
import torch

from minimoe.core.token_mixers.deltanet import GatedDeltaNet
from minimoe.core.token_mixers.mamba2 import Mamba2Mixer
from minimoe.core.token_mixers.mixers import MixerInputs
from minimoe.core.token_mixers.short_conv import ShortConv, ShortConvConfig
from minimoe.core.token_mixers.ssm_common import StateSlot
from tests.conftest import as_our_mixer_config, oracle

D = 32


def pair(kind: str, seed: int = 0, conv_bias: bool = True):
    """(transformers' layer, ours) with the same random weights. Chunks of 8 over rows of 21: several
    chunks and a partial last one; ours chunks the delta rule by 8 where transformers chunks by 64. The short
    conv's oracle is transformers 5.23 (its cases marked tf5), kernel 4, biases on unless `conv_bias` is False."""
    transformers = oracle("transformers")
    torch.manual_seed(seed)
    if kind == "short_conv":
        from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeShortConv
        cfg = transformers.Lfm2MoeConfig(hidden_size=D, conv_L_cache=4, conv_bias=conv_bias, num_hidden_layers=1,
                                         layer_types=["conv"])
        ref, ours = Lfm2MoeShortConv(cfg, 0), ShortConv(as_our_mixer_config(cfg, "short_conv"), 0)
    elif kind == "mamba2":
        from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMambaLayer
        cfg = transformers.GraniteMoeHybridConfig(hidden_size=D, mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16,
                                                  mamba_d_head=8, mamba_chunk_size=8, mamba_d_conv=4)
        ref, ours = GraniteMoeHybridMambaLayer(cfg, 0), Mamba2Mixer(as_our_mixer_config(cfg, "mamba2"), 0)
    else:
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet
        cfg = transformers.Qwen3NextConfig(hidden_size=D, linear_num_key_heads=2, linear_num_value_heads=4,
                                           linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4)
        ref, ours = Qwen3NextGatedDeltaNet(cfg, 0), GatedDeltaNet(as_our_mixer_config(cfg, "gated_deltanet"), 0)
        ours.chunk = 8
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(torch.rand_like(p).log() if name == "A_log" else 0.3 * torch.randn_like(p))
    ours.load_state_dict(ref.state_dict())  # the checkpoint's names, strictly
    return ref.float(), Run(ours.float())


def ours_alone(kind: str):
    """Our mixer with random weights, for the tests that hold it to itself: pair's, or LFM2's short conv (its oracle
    is transformers 5) with biases on, which padding must keep out, built without transformers."""
    if kind != "short_conv":
        return pair(kind)[1]
    torch.manual_seed(0)
    ours = ShortConv(SimpleNamespace(hidden_size=D, mixers={"short_conv": ShortConvConfig(4, conv_bias=True)}), 0)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    return Run(ours)


class Run:
    """ours(x, attention_mask=..., segment_ids=..., cache=...) as the model calls a mixer (mixers.MixerInputs)."""

    def __init__(self, mixer):
        self.mixer = mixer

    def __call__(self, x, attention_mask=None, segment_ids=None, cache=None):
        B, T, _ = x.shape
        inputs = MixerInputs(None, None, {}, attention_mask, segment_ids, torch.arange(T).expand(B, T))
        return self.mixer(x, inputs, cache)

    def __getattr__(self, name):
        return getattr(self.mixer, name)


def rel(a, b, where=None):
    d = (a - b).abs() if where is None else (a - b)[where].abs()
    return (d.max() / b.abs().max()).item()


def padded_mask():
    mask = torch.ones(3, 21, dtype=torch.long)
    mask[0, :5] = 0  # left padding
    mask[1, 15:] = 0  # right padding
    return mask


@pytest.mark.parametrize("kind", ["mamba2", "gated_deltanet"])
def test_fp32_matches_transformers(kind):
    ref, ours = pair(kind)
    x = torch.randn(3, 21, D)
    mask = padded_mask()
    with torch.no_grad():
        assert rel(ours(x), ref(x)) <= 2e-5
        real = mask.bool()
        assert rel(ours(x, attention_mask=mask), ref(x, attention_mask=mask), real) <= 2e-5


# the mixers held to transformers: 4.57's, and 5.23's short conv (tf5: .ci/run's third environment)
ORACLE_KINDS = ["mamba2", "gated_deltanet", pytest.param("short_conv", marks=pytest.mark.tf5)]


@pytest.mark.tf5
@pytest.mark.parametrize("conv_bias", [False, True])
def test_short_conv_fp32_matches_transformers(conv_bias):
    """Unpadded and padded. With conv_bias, transformers lets in_proj's bias through left padding into the conv
    (core/token_mixers/short_conv.py's docstring), which ours keeps out: there only the right-padded row is compared."""
    ref, ours = pair("short_conv", conv_bias=conv_bias)
    x = torch.randn(3, 21, D)
    mask = padded_mask()  # row 0 left-padded, row 1 right-padded
    rows = slice(1, None) if conv_bias else slice(None)
    with torch.no_grad():
        assert rel(ours(x), ref(x)) <= 2e-5
        theirs = ref(x, attention_mask=mask)[rows]
        assert rel(ours(x, attention_mask=mask)[rows], theirs, mask[rows].bool()) <= 2e-5


@pytest.mark.parametrize("kind", ORACLE_KINDS)
def test_gradients_match_transformers(kind):
    ref, ours = pair(kind)
    x = torch.randn(3, 21, D)
    w = torch.randn(3, 21, D)  # a loss that weighs every output
    xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    (ref(xr) * w).sum().backward()
    (ours(xo) * w).sum().backward()
    assert rel(xo.grad, xr.grad) <= 1e-4
    theirs = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert rel(p.grad, theirs[name].grad) <= 1e-4, name


@pytest.mark.parametrize("kind", ORACLE_KINDS)
def test_bf16_error_within_3x_transformers(kind):
    ref, ours = pair(kind)
    x = torch.randn(3, 21, D)
    with torch.no_grad():
        exact = ref.double()(x.double()).float()
        ref_err = rel(ref.bfloat16()(x.bfloat16()).float(), exact)
        ours.mixer.bfloat16()
        our_err = rel(ours(x.bfloat16()).float(), exact)
    assert our_err <= 3 * ref_err, (our_err, ref_err)


@pytest.mark.parametrize("kind", ["mamba2", "gated_deltanet", "short_conv"])
def test_padding_does_not_leak(kind):
    """Each row of a padded batch equals that row alone, unpadded: left padding leaves the state zero,
    right padding comes after every real token."""
    ours = ours_alone(kind)
    x = torch.randn(3, 21, D)
    mask = padded_mask()
    with torch.no_grad():
        y = ours(x, attention_mask=mask)
        for r in range(3):
            real = mask[r].bool()
            alone = ours(x[r:r + 1, real])[0]
            assert rel(y[r, real], alone) <= 1e-5, r


@pytest.mark.parametrize("kind", ["mamba2", "gated_deltanet", "short_conv"])
def test_packed_row_equals_each_candidate_alone(kind):
    """A prompt (segment 0) then candidates 1..3, right-padded, as core/task/choices.py packs them: the prompt's
    outputs equal the prompt alone, each candidate's equal its own row (prompt + candidate)."""
    ours = ours_alone(kind)
    lengths = [[9, 4, 11, 2], [3, 6, 1, 5]]  # prompt, then candidates, per row
    T = max(map(sum, lengths)) + 2
    x = torch.randn(2, T, D)
    segments = torch.zeros(2, T, dtype=torch.long)
    mask = torch.zeros(2, T, dtype=torch.long)
    for r, lens in enumerate(lengths):
        segments[r, :sum(lens)] = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        mask[r, :sum(lens)] = 1
    with torch.no_grad():
        y = ours(x, attention_mask=mask, segment_ids=segments)
        for r, lens in enumerate(lengths):
            P, start = lens[0], lens[0]
            prompt = x[r:r + 1, :P]
            assert rel(y[r, :P], ours(prompt)[0]) <= 1e-5
            for n in lens[1:]:
                alone = ours(torch.cat([prompt, x[r:r + 1, start:start + n]], 1))[0, P:]
                assert rel(y[r, start:start + n], alone) <= 1e-5, (r, start)
                start += n
            pad = y[r, start:]  # padding: nothing reaches it but out_proj's bias (the short conv's)
            assert torch.equal(pad, ours.out_proj(pad.new_zeros(len(pad), ours.out_proj.in_features)))


@pytest.mark.parametrize("kind", ["mamba2", "gated_deltanet", "short_conv"])
def test_cache_in_pieces_equals_one_forward(kind):
    """Prefill 2 positions (fewer than the conv window), then 11, then one at a time: the state cache
    carries the conv window and the scan state exactly."""
    ours = ours_alone(kind)
    x = torch.randn(2, 17, D)
    with torch.no_grad():
        full = ours(x)
        cache, pieces, start = StateSlot(), [], 0
        for n in (2, 11, 1, 1, 1, 1):
            pieces.append(ours(x[:, start:start + n], cache=cache))
            start += n
        assert rel(torch.cat(pieces, 1), full) <= 1e-5


def test_mamba_heads_must_divide_the_inner_width_only_where_there_are_mamba_layers():
    """Mamba-2's head width "auto" is mamba_expand * hidden_size / mamba_n_heads: a model with Mamba-2 layers
    whose heads do not divide it is refused by name; a model without any keeps whatever hidden size it has
    (the default 128 heads do not divide 2 x 32)."""
    from minimoe.core.decoder.model import MoEConfig
    kw = dict(model_type="granitemoehybrid", vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2)
    assert MoEConfig(**kw).mixers["mamba2"].mamba_d_head == "auto"  # unused
    assert MoEConfig.from_flat({**kw, "mamba_n_heads": 8}).mixers["mamba2"].mamba_d_head == 8
    with pytest.raises(ValueError, match="mamba_n_heads 128 does not divide mamba_expand \\* hidden_size = 64"):
        MoEConfig(**kw, mixer_types=["mamba2", "attention"])


def test_packed_rows_read_their_layout_once_per_forward(monkeypatch):
    """The packed rows' layout is read on the host (a device sync on a GPU) once per forward, however many
    recurrent layers the model has: the first reads it, the others reuse it (ssm_common.segment_plan)."""
    from minimoe.core.token_mixers import ssm_common
    from tests.conftest import tiny_model
    model = tiny_model("granitemoehybrid", num_hidden_layers=4, mixer_types=["mamba2", "mamba2", "attention", "mamba2"])
    reads = []
    plan = ssm_common.segment_plan
    monkeypatch.setattr(ssm_common, "segment_plan", lambda *a: reads.append(1) or plan(*a))
    segments = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 0], [0, 0, 1, 2, 2, 2, 0, 0]])
    mask = torch.tensor([[1] * 7 + [0], [1] * 6 + [0] * 2])
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for _ in range(2):
            model(ids, attention_mask=mask, segment_ids=segments)
    assert len(reads) == 2


@pytest.mark.tf5
def test_granite_4_h_mamba_norm_per_group_is_transformers_5s():
    """Granite 4.0-H's gated norm: transformers 5.23 normalises each group of d_ssm / n_groups channels apart, as
    mamba_ssm's fused kernel does (the one transformers 4.57's own CUDA training path runs); 4.57's torch path, and
    the granitemoehybrid record after it (exact against 4.57: test_fp32_matches_transformers), over the whole width.
    At 2 groups, padded and not: ours per group (`mamba_norm_per_group`, Nemotron-H's) is 5.23's within 2e-5, and
    the whole-width norm is more than 1% off it, so the two rules are told apart here (docs/families.md)."""
    ref, ours = pair("mamba2")
    x, mask = torch.randn(3, 21, D), padded_mask()
    assert ours.G == 2 and ours.norm.groups == 1  # the granitemoehybrid record's rule: 4.57's
    with torch.no_grad():
        whole = ours(x)
        ours.norm.groups = ours.G  # what mamba_norm_per_group builds (Mamba2Mixer.__init__)
        assert rel(ours(x), ref(x)) <= 2e-5
        assert rel(ours(x, attention_mask=mask), ref(x, attention_mask=mask), mask.bool()) <= 2e-5
        assert rel(whole, ref(x)) > 1e-2
