"""DeepSeek-V4's attention (core/token_mixers/compressed_attention.py) against transformers 5.23's
DeepseekV4Attention on random weights and inputs, one layer of each kind: the sliding window alone, HCA's
compressed entries and CSA's overlapping ones picked by the indexer; fp32 outputs and gradients, and rows long
enough for several windows, the sliding window and the indexer's top-k all to bind."""
from types import SimpleNamespace

import pytest
import torch

from minimoe.core.layers.masks import bool_mask
from minimoe.core.token_mixers.compressed_attention import CSA, HCA, SLIDING, CompressedAttentionConfig, \
    CompressedSparseAttention
from minimoe.core.token_mixers.mixers import MixerInputs

pytestmark = pytest.mark.tf5
B, T, D, H, d, R, WINDOW = 2, 23, 32, 4, 16, 8, 6
RATES = {CSA: 4, HCA: 5}
KINDS = [SLIDING, CSA, HCA]


def reference_config():
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
    cfg = DeepseekV4Config(hidden_size=D, num_attention_heads=H, head_dim=d, q_lora_rank=12, o_groups=2,
                           o_lora_rank=6, index_n_heads=3, index_head_dim=12, index_topk=2, sliding_window=WINDOW,
                           num_hidden_layers=3, layer_types=KINDS, compress_rates=RATES, qk_rope_head_dim=R,
                           rope_theta=10000.0, compress_rope_theta=40000.0, vocab_size=32)
    cfg._attn_implementation = "eager"
    return cfg


def ours_config(cfg):
    options = CompressedAttentionConfig(compressed_layer_types=KINDS, compress_rates=RATES, compress_rope_theta=40000.0,
                                        compressed_q_lora_rank=12, o_groups=2, o_lora_rank=6,
                                        compressed_index_n_heads=3, compressed_index_head_dim=12,
                                        compressed_index_topk=2)
    return SimpleNamespace(hidden_size=D, num_attention_heads=H, head_dim=d, rms_norm_eps=cfg.rms_norm_eps,
                           sliding_window=WINDOW, rope_dim=R, rope_theta=10000.0, max_position_embeddings=4096,
                           num_hidden_layers=3, mixers={"compressed": options})


def pair(layer: int):
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as ref
    cfg = reference_config()
    torch.manual_seed(layer)
    theirs = ref.DeepseekV4Attention(cfg, layer)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.3)
    ours = CompressedSparseAttention(ours_config(cfg), layer)
    ours.load_state_dict(theirs.state_dict())
    return cfg, theirs, ours


def run_both(layer, x, mask=None):
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as ref
    cfg, theirs, ours = pair(layer)
    pos = torch.arange(T).expand(B, T)
    allowed = bool_mask(mask, B, T, 0, x.device, kind=ours.mask_kind)  # [B, 1, T, T]
    rotary = ref.DeepseekV4RotaryEmbedding(cfg)
    ropes = {kind: rotary(x, pos, layer_type=kind) for kind in ("main", "compress")}
    bias = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    want = theirs(x, ropes, pos, bias)[0]
    got = ours(x, MixerInputs(None, None, {ours.mask_kind: allowed}, mask, None, pos))
    return theirs, ours, got, want


@pytest.mark.parametrize("layer", range(3), ids=KINDS)
def test_outputs_and_gradients_equal_transformers(layer):
    x = torch.randn(B, T, D, requires_grad=True)
    theirs, ours, got, want = run_both(layer, x)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    g = torch.randn_like(got)
    trained = [n for n, p in ours.named_parameters() if p.requires_grad]
    assert [n for n, _ in ours.named_parameters() if n not in trained] == [
        n for n, _ in ours.named_parameters() if ".indexer." in n]  # the indexer's only: frozen (no gradient reaches it)
    theirs_params = dict(theirs.named_parameters())
    grads = torch.autograd.grad((got * g).sum(), [x, *(dict(ours.named_parameters())[n] for n in trained)])
    want_grads = torch.autograd.grad((want * g).sum(), [x, *(theirs_params[n] for n in trained)])
    for name, a, b in zip(["x", *trained], grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def test_right_padding_leaves_the_real_positions_as_transformers():
    x = torch.randn(B, T, D)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 15:] = 0
    _, _, got, want = run_both(1, x, mask)
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], rtol=2e-5, atol=2e-5)
