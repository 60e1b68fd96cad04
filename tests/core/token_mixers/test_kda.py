"""Kimi Delta Attention's chunked rule (core/token_mixers/kda.py) against its definition, one position at a time:
S_t = diag(exp(g_t)) S_{t-1}, then the delta rule's write with beta_t, o_t = S_t^T q_t. The family's parity suite
(tests/core/decoder/test_families_parity.py, `tf5`) holds the whole layer to transformers 5.23 on rows shorter than
one chunk; here several chunks, a chunk that ends mid-row and a carried state are checked in fp64."""
import pytest
import torch

from minimoe.core.token_mixers.kda import chunk_kda


def recurrence(q, k, v, g, beta, state):
    """The rule as written, position by position: q, k, v, g [b, T, H, d], beta [b, T, H], state [b, H, d, d]."""
    out = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None]  # each key channel's forget gate
        remembered = (state * k[:, t, ..., None]).sum(-2)  # S^T k [b, H, d]
        state = state + k[:, t, ..., None] * ((v[:, t] - remembered) * beta[:, t, ..., None])[..., None, :]
        out.append((state * q[:, t, ..., None]).sum(-2))
    return torch.stack(out, 1), state


@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_the_chunked_rule_equals_the_recurrence(chunk):
    torch.manual_seed(0)
    b, T, H, d = 2, 11, 3, 4
    q, k = (torch.nn.functional.normalize(torch.randn(b, T, H, d, dtype=torch.float64), dim=-1) for _ in range(2))
    v = torch.randn(b, T, H, d, dtype=torch.float64)
    g = -torch.rand(b, T, H, d, dtype=torch.float64)  # decays in (e^-1, 1], a different one per channel
    beta = torch.rand(b, T, H, dtype=torch.float64)
    start = torch.randn(b, H, d, d, dtype=torch.float64)
    want, want_state = recurrence(q, k, v, g, beta, start)
    got, got_state = chunk_kda(q, k, v, g, beta, chunk, start)
    assert torch.allclose(got, want, atol=1e-12) and torch.allclose(got_state, want_state, atol=1e-12)
    # a decay per head, not per channel, gives another output: the test tells them apart
    scalar, _ = chunk_kda(q, k, v, g.mean(-1, keepdim=True).expand_as(g), beta, chunk, start)
    assert (scalar - want).abs().max() > 1e-3
