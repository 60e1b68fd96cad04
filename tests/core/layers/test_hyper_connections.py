"""Hyper-connections (core/layers/hyper_connections.py) against transformers 5.23's DeepseekV4HyperConnection and
DeepseekV4HyperHead on random weights and streams: the block input, post and comb, the head's collapse, and the
gradients of all of them; the layer's mixing (`expand`) against its definition written out per stream."""
import pytest
import torch

from minimoe.core.layers.hyper_connections import HyperConnection, HyperHead

pytestmark = pytest.mark.tf5
N, D, ITERS = 4, 16, 3  # few Sinkhorn passes: one pass more or less shows (20 converge)


def reference_config():
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
    return DeepseekV4Config(hidden_size=D, hc_mult=N, hc_sinkhorn_iters=ITERS, num_hidden_layers=1,
                            num_attention_heads=2, head_dim=8, q_lora_rank=8, vocab_size=32)


def randomized(module, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.5)
    return module


def test_hyper_connection_equals_transformers():
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as ref
    cfg = reference_config()
    theirs = randomized(ref.DeepseekV4HyperConnection(cfg), 0)
    ours = HyperConnection(D, N, ITERS, cfg.hc_eps, cfg.rms_norm_eps)
    ours.load_state_dict(theirs.state_dict())
    h = torch.randn(2, 5, N, D, requires_grad=True)
    want_post, want_comb, want_x = theirs(h)
    x, post, comb = ours(h)
    for got, want in ((x, want_x), (post, want_post), (comb, want_comb)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.allclose(comb.sum(-2), torch.ones(()), atol=1e-4)  # the last pass normalises the columns
    probe = torch.randn_like(x), torch.randn_like(post), torch.randn_like(comb)
    loss = lambda outs: sum((o * p).sum() for o, p in zip(outs, probe))  # noqa: E731
    want_grads = torch.autograd.grad(loss((want_x, want_post, want_comb)), (h, *theirs.parameters()))
    got_grads = torch.autograd.grad(loss((x, post, comb)), (h, ours.fn, ours.base, ours.scale))
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_hyper_head_equals_transformers():
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as ref
    cfg = reference_config()
    theirs = randomized(ref.DeepseekV4HyperHead(cfg), 1)
    ours = HyperHead(D, N, cfg.hc_eps, cfg.rms_norm_eps)
    ours.load_state_dict(theirs.state_dict())
    h = torch.randn(2, 5, N, D, requires_grad=True)
    want, got = theirs(h), ours(h)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    g = torch.randn_like(got)
    torch.testing.assert_close(torch.autograd.grad((got * g).sum(), h)[0], torch.autograd.grad((want * g).sum(), h)[0])


def test_expand_reads_comb_by_columns():
    """h'_n = post_n out + sum_m comb[m, n] h_m, stream by stream (comb is not symmetric: its transpose differs)."""
    torch.manual_seed(2)
    h, out = torch.randn(2, 3, N, D), torch.randn(2, 3, D)
    post, comb = torch.rand(2, 3, N), torch.rand(2, 3, N, N)
    want = torch.stack([post[..., n, None] * out + sum(comb[..., m, n, None] * h[..., m, :] for m in range(N))
                        for n in range(N)], dim=2)
    torch.testing.assert_close(HyperConnection.expand(h, out, post, comb), want)
    assert not torch.allclose(HyperConnection.expand(h, out, post, comb.transpose(-1, -2)), want)
