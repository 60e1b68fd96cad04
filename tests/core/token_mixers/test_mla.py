"""Multi-head Latent Attention (core/token_mixers/mla.py) against transformers 4.57's DeepseekV2Attention and
DeepseekV3Attention on random weights: outputs and input gradients in fp32, with YaRN, with and
without a padding mask, low-rank q or a plain q_proj, interleaved rope pairs or not."""
import pytest
import torch
pytest.importorskip("transformers")  # the oracle: a plain install skips these tests
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

from minimoe.core.token_mixers.mla import MLAttention
from minimoe.core.layers.masks import FULL, bool_mask
from minimoe.core.token_mixers.mixers import MixerInputs
from minimoe.core.layers.rope import rope_cos_sin, rope_frequencies
from tests.conftest import as_our_mixer_config

FP32_TOL = 2e-5  # max |ours - ref| / max |ref|
YARN_V2 = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 32, "beta_slow": 1,
           "mscale": 0.707, "mscale_all_dim": 0.707}  # DeepSeek-V2-Lite's kind of entry, at a tiny context
YARN_V3 = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 32.0,
           "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}


def config(version, q_lora_rank=16, rope_scaling=None, **extra):
    cls = v2.DeepseekV2Config if version == 2 else v3.DeepseekV3Config
    c = cls(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank,
            kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, max_position_embeddings=32,
            rope_scaling=rope_scaling, attention_bias=False, rms_norm_eps=1e-5, **extra)
    c._attn_implementation = "eager"
    return c


def pair(cfg, version, seed=0):
    """The reference attention with random weights (norms near 1) and ours with the same state dict."""
    torch.manual_seed(seed)
    ref = (v2.DeepseekV2Attention if version == 2 else v3.DeepseekV3Attention)(cfg, layer_idx=0)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    ours = MLAttention(as_our_mixer_config(cfg, "mla"), layer_idx=0)
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


def run_both(cfg, version, ref, ours, padded: bool, B=2, T=20):
    x = torch.randn(B, T, cfg.hidden_size, requires_grad=True)
    pos = torch.arange(T).expand(B, T)
    attention_mask = None
    if padded:
        attention_mask = torch.ones(B, T, dtype=torch.long)
        attention_mask[1, :5] = 0  # left padding in row 1
    mask = bool_mask(attention_mask, B, T, 0, x.device)  # bool [B, 1, T, S] or None
    additive = None
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None].expand(B, 1, T, T)
    allowed = causal if mask is None else mask
    additive = torch.zeros(B, 1, T, T).masked_fill(~allowed, torch.finfo(torch.float32).min)
    rotary = (v2.DeepseekV2RotaryEmbedding if version == 2 else v3.DeepseekV3RotaryEmbedding)(cfg)
    emb = rotary(x, pos)
    y_ref, _ = ref(x, attention_mask=additive, position_embeddings=emb, position_ids=pos)
    inv_freq, factor = rope_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling,
                                        cfg.max_position_embeddings)
    cos, sin = rope_cos_sin(pos, inv_freq, factor, x.dtype)
    x2 = x.detach().clone().requires_grad_(True)
    y = ours(x2, MixerInputs(cos, sin, {FULL: mask}, attention_mask, None, pos))
    real = allowed[:, 0].diagonal(dim1=-2, dim2=-1) if attention_mask is None else attention_mask.bool()
    g = torch.randn_like(y_ref)
    (y_ref * g)[real].sum().backward()
    (y * g)[real].sum().backward()
    return y[real], y_ref[real], x2.grad, x.grad


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("q_lora_rank", [16, None])
@pytest.mark.parametrize("padded", [False, True])
def test_mla_matches_deepseek_v2_without_rope_scaling(q_lora_rank, padded):
    cfg = config(2, q_lora_rank)
    ref, ours = pair(cfg, 2)
    y, y_ref, gx, gx_ref = run_both(cfg, 2, ref, ours, padded)
    assert rel(y, y_ref) < FP32_TOL
    assert rel(gx, gx_ref) < 1e-4


@pytest.mark.parametrize("padded", [False, True])
def test_mla_matches_deepseek_v2_with_yarn_and_the_softmax_mscale(padded):
    """V2-Lite's YaRN entry. transformers 4.57's V2 leaves out the softmax mscale that DeepSeek's code
    and transformers' own V3 apply (fixed upstream, transformers PR 47435): the reference gets it
    here from V3's `yarn_get_mscale`, an independent copy of the rule."""
    cfg = config(2, 16, dict(YARN_V2))
    ref, ours = pair(cfg, 2)
    ref.scaling = ref.scaling * v3.yarn_get_mscale(4.0, 0.707) ** 2
    y, y_ref, gx, gx_ref = run_both(cfg, 2, ref, ours, padded)
    assert rel(y, y_ref) < FP32_TOL
    assert rel(gx, gx_ref) < 1e-4


@pytest.mark.parametrize("rope_interleave", [True, False])
@pytest.mark.parametrize("rope_scaling", [None, YARN_V3])
@pytest.mark.parametrize("padded", [False, True])
def test_mla_matches_deepseek_v3(rope_interleave, rope_scaling, padded):
    cfg = config(3, 16, dict(rope_scaling) if rope_scaling else None, rope_interleave=rope_interleave)
    ref, ours = pair(cfg, 3)
    y, y_ref, gx, gx_ref = run_both(cfg, 3, ref, ours, padded)
    assert rel(y, y_ref) < FP32_TOL
    assert rel(gx, gx_ref) < 1e-4


def test_mla_parameter_gradients_match_deepseek_v3():
    cfg = config(3, 16, dict(YARN_V3))
    ref, ours = pair(cfg, 3)
    run_both(cfg, 3, ref, ours, padded=True)
    grads = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert rel(p.grad, grads[name].grad) < 1e-4, name


def test_dsa_shared_layers_under_gradient_checkpointing_get_the_same_gradients():
    """GLM-5's shared layer reuses the top-k of the full layer before it (MixerInputs.shared, by layer index): the
    backward's recompute of each layer reads its own source's choice, not the last one written, so that LoRA's
    gradients with gradient checkpointing equal those without (tiny:glm_moe_dsa: full, shared, full layers)."""
    import torch.nn.functional as F
    from minimoe.core.adaptation.lora import add_lora
    from tests.conftest import tiny_model
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)  # LoRA's A drawn alike
        model = add_lora(tiny_model("glm_moe_dsa"), rank=4, dropout=0.0).train()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("lora_B"):
                    p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
        model.gradient_checkpointing_enable(checkpointing)
        ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(0))
        logits = model(ids).logits
        F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], rtol=1e-5, atol=1e-7), n


@pytest.mark.parametrize("family,overrides,message", [
    ("deepseek_v32", dict(q_lora_rank=None), "the DSA indexer .* reads MLA's query latent"),
    ("deepseek_v32", dict(index_topk=0), "index_topk 0; expected an int >= 1"),
    ("deepseek_v32", dict(index_head_dim=4), "index_head_dim 4 is narrower than the rope part"),
    ("glm_moe_dsa", dict(indexer_types=["shared", "full", "full"]), "the first layer 'full'"),
    ("glm_moe_dsa", dict(indexer_types=["full", "shared"]), "indexer_types has 2 entries; expected num_hidden_layers=3"),
])
def test_a_dsa_config_the_indexer_cannot_run_is_refused_by_name(family, overrides, message):
    from tests.conftest import tiny_config
    with pytest.raises(ValueError, match=message):
        tiny_config(family, **overrides)
