"""Kimi Delta Attention (Kimi Linear's linear_attention layers), in pure PyTorch: the reference and the CPU path.

    q, k, v = q_proj, k_proj, v_proj (x), each through its own causal depthwise conv1d + SiLU (H heads of d)
    q, k L2-normalised, q scaled by 1/sqrt(d);  beta = sigmoid(b_proj x)  [H]
    g = -exp(A_log) softplus(f_b_proj(f_a_proj x) + dt_bias)  [H, d]: a forget gate per key channel
    per head:  S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q_t
    o_proj(RMSNorm(o) * o_norm.weight * sigmoid(g_b_proj(g_a_proj x)))  (norm over each head's d, in fp32)

It is Gated DeltaNet (core/token_mixers/deltanet.py) with the scalar decay per head made a decay per key channel,
so within a chunk the decay between positions t and s is a vector exp(G_t - G_s) [d] (G the cumulative g) and the
chunk's products carry it channel by channel: [L, L, d] per chunk and head, built one chunk at a time so that the
memory is one chunk's. As there, the chunk's updates are one unit lower-triangular solve (the WY form) and the
state [d, d] is carried between chunks by a loop; the rule runs in fp32, its output cast to the model dtype. It
equals transformers 5.23's `chunk_kimi_delta_attention` (a row-by-row substitution for the same solve).

The three convs are depthwise (each channel its own kernel), so they run as one conv over q, k, v side by side,
the generation cache keeping one window; the parameters keep the checkpoint's names and shapes (`self_attn.*`:
q_conv1d, f_a_proj, A_log [1, 1, H, 1], ...). Padding and packed rows: core/token_mixers/ssm_common.py (a padded
position writes nothing: its k and v are zeroed, whatever its gates). Its options are `KDAConfig`
(MoEConfig.mixers["kda"]), by Kimi Linear's config.json names.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from minimoe.core.layers.masks import FULL
from minimoe.core.layers.norms import rms_normalized
from minimoe.core.token_mixers.deltanet import l2norm
from minimoe.core.token_mixers.ssm_common import (RecurrentState, StateSlot, causal_conv1d, masked, pad_to_chunks,
                                                  read_layout, run_sequence, wide)


@dataclass
class KDAConfig:
    """A Kimi Delta Attention layer's heads (H of d, keys and values alike) and its conv."""
    linear_head_dim: int = 128  # d
    linear_num_heads: int = 32  # H
    kda_conv_kernel_dim: int = 4  # the causal convs' kernel length (config.json: linear_conv_kernel_dim, as Qwen3-Next's)

    def __post_init__(self):
        for name, value in vars(self).items():
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"config: {name} {value!r}; expected an int >= 1")


def chunk_kda(q, k, v, g, beta, chunk: int, state=None):
    """q, k, v [b, T, H, d] (q, k normalised, q scaled), g [b, T, H, d] log decays, beta [b, T, H], state
    [b, H, d, d] or None (zeros), all fp32 -> (o [b, T, H, d], the final state)."""
    b, T, H, d = k.shape
    # [b, H, c, L, ...]; zero padding at the end: beta 0 and g 0 leave the state as it is
    q, k, v, g = (pad_to_chunks(t, chunk).transpose(1, 2).unflatten(2, (-1, chunk)) for t in (q, k, v, g))
    beta = pad_to_chunks(beta, chunk).transpose(1, 2).unflatten(2, (-1, chunk))
    G = g.cumsum(-2)  # [b, H, c, L, d] log decay from the chunk start, per channel
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    S = q.new_zeros(b, H, d, v.shape[-1]) if state is None else state
    out = []
    for i in range(q.shape[2]):
        qi, ki, vi, Gi, bi = q[:, :, i], k[:, :, i], v[:, :, i], G[:, :, i], beta[:, :, i]
        # [b, H, L(t), L(s), d]: exp(G_t - G_s) for s <= t, else 0
        decay = (Gi[:, :, :, None] - Gi[:, :, None]).masked_fill(~lower[..., None], float("-inf")).exp()
        kb = ki * bi[..., None]
        system = (kb[:, :, :, None] * ki[:, :, None] * decay).sum(-1).tril(-1) + eye
        u = torch.linalg.solve_triangular(system, vi * bi[..., None], upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(system, kb * Gi.exp(), upper=False, unitriangular=True)
        qk = (qi[:, :, :, None] * ki[:, :, None] * decay).sum(-1)  # [b, H, L, L] causal, decayed per channel
        v_new = u - w @ S  # [b, H, L, d] what each position writes, given the state before the chunk
        out.append((qi * Gi.exp()) @ S + qk @ v_new)
        last = Gi[:, :, -1]  # [b, H, d]
        S = S * last.exp()[..., None] + (ki * (last[:, :, None] - Gi).exp()).transpose(-1, -2) @ v_new
    o = torch.stack(out, 2).flatten(2, 3)[:, :, :T]  # [b, H, T, d]
    return o.transpose(1, 2), S


class KDAOutputNorm(nn.Module):
    """Kimi's output norm: RMSNorm of each head's output times the weight, gated by sigmoid(gate), all in fp32,
    rounded once (transformers' KimiLinearRMSNormGated)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, y, gate):  # y, gate [B, T, H, d]
        h = wide(self.weight) * rms_normalized(wide(y), self.eps)
        return (h * torch.sigmoid(wide(gate))).to(y.dtype)


class KimiDeltaAttention(nn.Module):
    """x [B, T, D] -> [B, T, D]; see the module docstring. A mixer of core/token_mixers/mixers.py ("kda")."""
    attribute = "self_attn"  # Kimi Linear keeps its linear layers' weights under self_attn, as its attention's
    mask_kind, takes_block_mask = FULL, True  # it reads padding and segments itself, never an attention mask
    read_layout = staticmethod(read_layout)  # packed rows' layout, once per forward (mixers.py)
    chunk = 64  # the rule's chunk length, transformers' (any length gives the same values to rounding)
    config_class = KDAConfig  # its options: MoEConfig.mixers["kda"]

    def __init__(self, config, layer_idx: int):
        super().__init__()
        c, D = config.mixers["kda"], config.hidden_size
        H, d, K = c.linear_num_heads, c.linear_head_dim, c.kda_conv_kernel_dim
        self.H, self.d, self.width = H, d, H * d
        for name in ("q", "k", "v"):
            setattr(self, f"{name}_proj", nn.Linear(D, H * d, bias=False))
            setattr(self, f"{name}_conv1d", nn.Conv1d(H * d, H * d, K, groups=H * d, bias=False))
        self.f_a_proj = nn.Linear(D, d, bias=False)  # the forget gate's low rank
        self.f_b_proj = nn.Linear(d, H * d, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(H * d))
        self.A_log = nn.Parameter(torch.log(torch.linspace(1, 16, H)).view(1, 1, H, 1))
        self.b_proj = nn.Linear(D, H, bias=False)
        self.g_a_proj = nn.Linear(D, d, bias=False)  # the output gate's low rank
        self.g_b_proj = nn.Linear(d, H * d, bias=False)
        self.o_norm = KDAOutputNorm(d, config.rms_norm_eps)
        self.o_proj = nn.Linear(H * d, D, bias=False)

    @staticmethod
    def cache_slot(config, layer_idx: int, batch_size: int, max_len: int, dtype, device) -> StateSlot:
        return StateSlot()

    def forward(self, x, inputs, cache: StateSlot | None = None):  # inputs: mixers.MixerInputs
        u = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x), self.b_proj(x),
                       self.f_b_proj(self.f_a_proj(x))], dim=-1)
        o = run_sequence(self.sequence, u, inputs, cache)
        gate = self.g_b_proj(self.g_a_proj(x))
        o = self.o_norm(o.unflatten(-1, (self.H, self.d)), gate.unflatten(-1, (self.H, self.d)))
        return self.o_proj(o.flatten(-2))

    def sequence(self, u, mask, state: RecurrentState | None):
        """u [B, T, 3 H d + H + H d] (q, k, v, b, the forget gate's projection) -> (o [B, T, H d], RecurrentState)."""
        W = self.width
        qkv, b, f = u.split([3 * W, self.H, W], dim=-1)
        weight = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])  # depthwise: one conv
        qkv, window = causal_conv1d(masked(qkv, mask), weight, None, None if state is None else state.conv)
        q, k, v = (wide(t).unflatten(-1, (self.H, self.d)) for t in masked(qkv, mask).split(W, dim=-1))
        beta = wide(b.sigmoid())  # the sigmoid in the model dtype, as the reference
        # softplus before the head split: compiled, the split's view in backward met softplus's gradient in the
        # layout eager gives a gathered piece's channels, not the traced one ("view size is not compatible")
        g = -wide(self.A_log).exp() * F.softplus(wide(f) + wide(self.dt_bias)).unflatten(-1, (self.H, self.d))
        o, S = chunk_kda(l2norm(q) * self.d ** -0.5, l2norm(k), v, g, beta, self.chunk,
                         None if state is None else state.scan)
        return o.flatten(2).to(u.dtype), RecurrentState(window, S)
