"""Rope frequencies (core/layers/rope.py) against transformers 4.57's ROPE_INIT_FUNCTIONS and rotary modules,
for every rope_scaling type we accept; the unknown ones are refused by name."""
import pytest
import torch
pytest.importorskip("transformers")  # the oracle: a plain install skips these tests
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gpt_oss import modeling_gpt_oss as oss

from minimoe.core.layers.rope import deinterleave, rope_cos_sin, rope_frequencies, yarn_softmax_mscale

SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 2.0},
    # DeepSeek-V2-Lite's entry (its config.json: factor 40, original 4096, mscale = mscale_all_dim = 0.707)
    {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
     "mscale": 0.707, "mscale_all_dim": 0.707},
    # gpt-oss-20b's entry (its config.json: factor 32, original 4096, beta 32/1, truncate false)
    {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
     "original_max_position_embeddings": 4096},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.5},
    {"rope_type": "yarn", "factor": 8.0, "attention_factor": 1.3},
    # Llama-4-Scout's entry (factor 16, low = high freq factor 1: no band between), and Llama 3.1's (8, 1, 4)
    {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
]


def hf_config(head_dim, theta, scaling, max_pos):
    c = PretrainedConfig()
    c.rope_theta, c.head_dim, c.hidden_size, c.num_attention_heads = theta, head_dim, head_dim * 4, 4
    c.max_position_embeddings, c.rope_scaling = max_pos, scaling
    return c


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("head_dim, theta", [(64, 150000.0), (16, 10000.0)])
def test_frequencies_and_attention_factor_match_transformers(scaling, head_dim, theta):
    kind = "default" if scaling is None else scaling.get("rope_type", scaling.get("type"))
    ref_freq, ref_factor = ROPE_INIT_FUNCTIONS[kind](hf_config(head_dim, theta, scaling, 131072), "cpu")
    freq, factor = rope_frequencies(head_dim, theta, scaling, 131072)
    torch.testing.assert_close(freq, ref_freq, rtol=1e-6, atol=0)
    assert factor == pytest.approx(ref_factor, rel=1e-12)


def test_cos_sin_match_gpt_oss_rotary_embedding_with_yarn():
    cfg = oss.GptOssConfig(head_dim=16, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                           max_position_embeddings=4096, rope_scaling=dict(SCALINGS[3]))
    pos = torch.arange(0, 3000, 7)[None]
    x = torch.zeros(1, dtype=torch.float32)
    cos_ref, sin_ref = oss.GptOssRotaryEmbedding(cfg)(x, pos)  # [1, T, d/2]: gpt-oss keeps one half
    cos, sin = rope_cos_sin(pos, *rope_frequencies(16, cfg.rope_theta, cfg.rope_scaling, 4096), torch.float32)
    torch.testing.assert_close(cos[..., :8], cos_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[..., 8:], sin_ref, rtol=0, atol=1e-6)


def test_softmax_mscale_is_deepseeks_rule():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_get_mscale
    s = {"rope_type": "yarn", "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 0.707}
    assert yarn_softmax_mscale(s) == pytest.approx(yarn_get_mscale(40.0, 0.707) ** 2, rel=1e-12)
    assert yarn_softmax_mscale(None) == 1.0
    assert yarn_softmax_mscale({"rope_type": "yarn", "factor": 40.0}) == 1.0  # no mscale_all_dim: none


def test_deinterleave_puts_the_even_dims_first():
    x = torch.arange(8.0)
    assert deinterleave(x).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]


@pytest.mark.parametrize("kind", ["dynamic", "longrope", "su"])
def test_other_rope_types_are_refused_by_name(kind):
    with pytest.raises(ValueError, match=f"rope_scaling type '{kind}' is not supported"):
        rope_frequencies(16, 1e4, {"rope_type": kind, "factor": 2.0}, 128)


@pytest.mark.tf5
@pytest.mark.parametrize("factor", [None, 0.5, 0.3])
def test_a_default_layer_rope_turns_what_gemma4_and_mimo_turn(factor):
    """A "default" rope_parameters entry: Gemma 4's rotary embedding turns the whole head whatever partial_rotary_factor
    it holds (layer_rope_partial None); MiMo-V2-Flash's turns int(d * factor) dims, 0.334 of the head where the entry
    gives none (layer_rope_partial 0.334). The inverse frequencies as each one's transformers 5.23 module computes them."""
    from transformers import Gemma4TextConfig, MiMoV2FlashConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding
    from transformers.models.mimo_v2_flash.modeling_mimo_v2_flash import MiMoV2FlashRotaryEmbedding
    from minimoe.core.layers.rope import layer_rope_dim, layer_type_frequencies
    entry = {"rope_type": "default", "rope_theta": 100.0, **({} if factor is None else {"partial_rotary_factor": factor})}
    ropes = {"sliding_attention": entry, "full_attention": {"rope_type": "default", "rope_theta": 1000.0}}
    kinds = ["sliding_attention", "full_attention"]
    mimo = MiMoV2FlashConfig(head_dim=24, num_hidden_layers=2, layer_types=kinds, rope_parameters=ropes)
    want = MiMoV2FlashRotaryEmbedding.compute_default_rope_parameters(mimo, layer_type="sliding_attention")[0]
    assert torch.equal(layer_type_frequencies(entry, 24, 0.334), want)
    assert layer_rope_dim(entry, 24, 0.334) == 2 * want.numel() == {None: 8, 0.5: 12, 0.3: 8}[factor]
    gemma = Gemma4TextConfig(head_dim=24, num_hidden_layers=2, layer_types=kinds, rope_parameters=ropes)
    gemma.allow_global_per_layer_attribute_access = True  # head_dim: the sliding layers' (the global ones have theirs)
    want = Gemma4TextRotaryEmbedding.compute_default_rope_parameters(gemma, layer_type="sliding_attention")[0]
    assert torch.equal(layer_type_frequencies(entry, 24), want) and layer_rope_dim(entry, 24) == 24
