"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): N residual streams in place of one.

Letters: B batch, T positions, N streams (config.json's hc_mult), D hidden.

The residual is h [B, T, N, D]. Around each block (attention, then the MoE block) a `HyperConnection` reads all N
streams and makes three mixes from them, by one learned projection of the flattened, RMS-normalised streams:

    a = rms(flatten(h)) fn^T                       [B, T, (2 + N) N], split as pre [N], post [N], comb [N, N]
    pre  = sigmoid(a_pre  * scale[0] + base_pre) + eps       how the N streams collapse into the block's input
    post = 2 sigmoid(a_post * scale[1] + base_post)          how the block's output spreads back over the N
    comb = Sinkhorn(softmax(a_comb * scale[2] + base_comb) + eps)    how the streams mix among themselves
    x = sum_n pre_n h_n                            [B, T, D], the block's input (then its own RMSNorm)
    h' = post_n * block(x) + sum_m comb[m, n] h_m  [B, T, N, D]

Sinkhorn-Knopp makes comb doubly stochastic (rows and columns sum to 1), so mixing the streams neither grows nor
shrinks them: first the columns are normalised, then rows and columns alternately, hc_sinkhorn_iters passes in
all, each sum with eps added. At the top of the model a `HyperHead` collapses the streams once more, with its own
pre mix only, before the final norm; the embedding enters as N copies.

Decisions, for parity with transformers 5.23 (modeling_deepseek_v4.py, DeepseekV4HyperConnection, HyperHead):
- The mixes are computed in fp32 from the fp32 streams and fp32 parameters (transformers keeps these modules in
  fp32 in every model dtype); the collapse sums in fp32 and rounds once; the mixing in the decoder layer
  (`expand`) runs in the model dtype, post and comb rounded to it first, as the reference does.
- comb is read transposed (stream m's share in output stream n is comb[m, n]): the matrix is doubly stochastic
  but not symmetric, so the direction matters.
- The parameters keep the checkpoint's names as transformers 5.23 stores them (attn_hc.fn, .base, .scale;
  hc_head.hc_fn, .hc_base, .hc_scale); the hub's hc_attn_fn ... are mapped by the family's record.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from minimoe.core.layers.norms import rms_normalized


def stream_mixes(h, fn, eps: float):
    """h [B, T, N, D] -> rms(flatten(h)) fn^T [B, T, rows of fn] in fp32 (the projection every mix starts from)."""
    return F.linear(rms_normalized(h.flatten(2).float(), eps), fn.float())


def collapse(h, pre):
    """h [B, T, N, D], pre [B, T, N] fp32 -> sum_n pre_n h_n [B, T, D], summed in fp32, in h's dtype."""
    return (pre.unsqueeze(-1) * h).sum(dim=2).to(h.dtype)


def sinkhorn(comb, iters: int, eps: float):
    """comb [..., N, N] of positive entries -> near doubly stochastic: columns, then rows and columns, `iters`
    normalisations of the columns in all (transformers' order, each sum plus eps)."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class HyperConnection(nn.Module):
    """One block's mixes (the module docstring); parameters fn [(2 + N) N, N D], base [(2 + N) N], scale [3]."""

    def __init__(self, hidden_size: int, streams: int, sinkhorn_iters: int, eps: float, norm_eps: float):
        super().__init__()
        N = self.streams = streams
        self.sinkhorn_iters, self.eps, self.norm_eps = sinkhorn_iters, eps, norm_eps
        self.fn = nn.Parameter(torch.empty((2 + N) * N, N * hidden_size))
        self.base = nn.Parameter(torch.zeros((2 + N) * N))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, h):
        """h [B, T, N, D] -> the block's input x [B, T, D] (h's dtype), post [B, T, N] and comb [B, T, N, N] (fp32)."""
        N = self.streams
        pre, post, comb = stream_mixes(h, self.fn, self.norm_eps).split([N, N, N * N], dim=-1)
        base_pre, base_post, base_comb = self.base.float().split([N, N, N * N])
        scale_pre, scale_post, scale_comb = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre * scale_pre + base_pre) + self.eps
        post = 2 * torch.sigmoid(post * scale_post + base_post)
        comb = comb.unflatten(-1, (N, N)) * scale_comb + base_comb.view(N, N)
        comb = sinkhorn(torch.softmax(comb, dim=-1) + self.eps, self.sinkhorn_iters, self.eps)
        return collapse(h, pre), post, comb

    @staticmethod
    def expand(h, out, post, comb):
        """h [B, T, N, D] the streams the block read, out [B, T, D] its output -> the new streams [B, T, N, D]:
        post_n out + sum_m comb[m, n] h_m, in h's dtype."""
        return post.to(h.dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(h.dtype).transpose(-1, -2), h)


class HyperHead(nn.Module):
    """The final collapse of the N streams: a pre mix only. Parameters hc_fn [N, N D], hc_base [N], hc_scale [1]."""

    def __init__(self, hidden_size: int, streams: int, eps: float, norm_eps: float):
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(streams, streams * hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(streams))
        self.hc_scale = nn.Parameter(torch.ones(1))

    def forward(self, h):  # h [B, T, N, D] -> [B, T, D]
        mixes = stream_mixes(h, self.hc_fn, self.norm_eps)
        return collapse(h, torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps)
