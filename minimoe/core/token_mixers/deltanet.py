"""The Gated DeltaNet token mixer (Qwen3-Next's linear_attention layers), in pure PyTorch: the reference
and the CPU path.

    in_proj_qkvz(x) -> q, k, v, z;  in_proj_ba(x) -> b, a;  q, k, v -> causal depthwise conv1d + SiLU
    q, k L2-normalised, q scaled by 1/sqrt(dk);  beta = sigmoid(b),  g = -exp(A_log) softplus(a + dt_bias)
    per value head:  S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q_t
    out_proj(RMSNorm(o) * weight * silu(z))  (norm over each head's dv, then the gate)

Letters: Hk key heads, Hv value heads (each key head serves Hv/Hk value heads), dk and dv their widths,
L chunk length. The delta rule runs in chunks (Gated DeltaNet paper, the WY form): within a chunk the
updates are folded into one unit lower-triangular solve, between chunks the state [dk, dv] is carried by
a loop. It equals transformers 4.57's `torch_chunk_gated_delta_rule` (which runs the same solve as a
row-by-row substitution) and keeps its dtype flow: the rule in fp32, its output cast to the model dtype.
Qwen3-Next's checkpoint interleaves q, k, v, z per key head in in_proj_qkvz (and b, a in in_proj_ba);
`split_projections` undoes that. Qwen3.5 stores them as four matrices instead (`linear_in_proj` "split":
in_proj_qkv [q | k | v], in_proj_z, in_proj_b, in_proj_a, each head's rows contiguous): the same layer, its
projections apart. Parameter names are the checkpoint's (`linear_attn.*`).
Padding and packed rows: core/token_mixers/ssm_common.py. Its options are `DeltaNetConfig` (MoEConfig.mixers["gated_deltanet"]),
named as Qwen3-Next's config.json names them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from minimoe.core.layers.masks import FULL
from minimoe.core.token_mixers.ssm_common import GatedRMSNorm, RecurrentState, StateSlot, causal_conv1d, masked, pad_to_chunks, read_layout, run_sequence, wide


IN_PROJ_LAYOUTS = ("fused", "split")


@dataclass
class DeltaNetConfig:
    """A Gated DeltaNet layer's heads (Hk key heads of dk, Hv value heads of dv) and its conv."""
    linear_conv_kernel_dim: int = 4  # the causal conv's kernel length
    linear_key_head_dim: int = 128  # dk
    linear_value_head_dim: int = 128  # dv
    linear_num_key_heads: int = 16  # Hk
    linear_num_value_heads: int = 32  # Hv: each key head serves Hv / Hk value heads
    # how the input projections are stored: "fused" (Qwen3-Next: in_proj_qkvz, in_proj_ba, interleaved per key
    # head) or "split" (Qwen3.5: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a); no config.json says it, the
    # family's record fixes it
    linear_in_proj: str = "fused"

    def __post_init__(self):
        if self.linear_in_proj not in IN_PROJ_LAYOUTS:
            raise ValueError(f"config: linear_in_proj {self.linear_in_proj!r}; expected one of {IN_PROJ_LAYOUTS}")
        for name, value in vars(self).items():
            if name != "linear_in_proj" and not (isinstance(value, int) and value >= 1):
                raise ValueError(f"config: {name} {value!r}; expected an int >= 1")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"config: linear_num_value_heads {self.linear_num_value_heads} is not a multiple of "
                             f"linear_num_key_heads {self.linear_num_key_heads}")


def l2norm(x, eps: float = 1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q, k, v, g, beta, chunk: int, state=None):
    """q, k [b, T, H, dk] (normalised, q scaled), v [b, T, H, dv], g and beta [b, T, H], state [b, H, dk, dv]
    or None (zeros), all fp32 -> (o [b, T, H, dv], the final state)."""
    b, T, H, dk = k.shape
    # [b, H, c, L, ...]; zero padding at the end: beta 0 and g 0 leave the state as it is
    q, k, v = (pad_to_chunks(t, chunk).transpose(1, 2).unflatten(2, (-1, chunk)) for t in (q, k, v))
    g, beta = (pad_to_chunks(t, chunk).transpose(1, 2).unflatten(2, (-1, chunk)) for t in (g, beta))
    G = g.cumsum(-1)  # [b, H, c, L] log decay from the chunk start
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # [.., L(t), L(s)]
    kb = k * beta[..., None]
    # (I + strictly lower (beta_t k_t . k_s decay_ts)) W = the chunk's inputs: the delta rule's WY form
    system = ((kb @ k.transpose(-1, -2)) * decay).tril(-1) + torch.eye(chunk, dtype=q.dtype, device=q.device)
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * G.exp()[..., None], upper=False, unitriangular=True)
    qk = (q @ k.transpose(-1, -2)) * decay  # [b, H, c, L, L] causal, decayed
    S = q.new_zeros(b, H, dk, v.shape[-1]) if state is None else state
    out = []
    for i in range(q.shape[2]):
        v_new = u[:, :, i] - w[:, :, i] @ S  # [b, H, L, dv] what each position writes, given the state before
        out.append((q[:, :, i] * G[:, :, i, :, None].exp()) @ S + qk[:, :, i] @ v_new)
        last = G[:, :, i, -1, None, None]
        S = S * last.exp() + (k[:, :, i] * (last - G[:, :, i, :, None]).exp()).transpose(-1, -2) @ v_new
    o = torch.stack(out, 2).flatten(2, 3)[:, :, :T]  # [b, H, T, dv]
    return o.transpose(1, 2), S


class GatedDeltaNet(nn.Module):
    """x [B, T, D] -> [B, T, D]; see the module docstring. A mixer of core/token_mixers/mixers.py ("gated_deltanet")."""
    attribute = "linear_attn"  # the layer's attribute, hence the checkpoint's names (model.layers.i.linear_attn.*)
    mask_kind, takes_block_mask = FULL, True  # it reads padding and segments itself, never an attention mask
    read_layout = staticmethod(read_layout)  # packed rows' layout, once per forward (mixers.py)
    chunk = 64  # the delta rule's chunk length, transformers' (any length gives the same values to rounding)
    config_class = DeltaNetConfig  # its options: MoEConfig.mixers["gated_deltanet"]

    def __init__(self, config, layer_idx: int):
        super().__init__()
        c, D = config.mixers["gated_deltanet"], config.hidden_size
        Hk, Hv = c.linear_num_key_heads, c.linear_num_value_heads
        self.Hk, self.Hv, self.dk, self.dv = Hk, Hv, c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim, self.value_dim = Hk * self.dk, Hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim  # q, k, v go through the conv
        self.split = c.linear_in_proj == "split"
        if self.split:
            self.in_proj_qkv = nn.Linear(D, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(D, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(D, Hv, bias=False)
            self.in_proj_a = nn.Linear(D, Hv, bias=False)
        else:
            self.in_proj_qkvz = nn.Linear(D, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(D, 2 * Hv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, c.linear_conv_kernel_dim, groups=self.conv_dim,
                                bias=False)
        self.dt_bias = nn.Parameter(torch.ones(Hv))
        self.A_log = nn.Parameter(torch.log(torch.linspace(1, 16, Hv)))
        self.norm = GatedRMSNorm(self.dv, config.rms_norm_eps, gate_first=False)
        self.out_proj = nn.Linear(self.value_dim, D, bias=False)

    @staticmethod
    def cache_slot(config, layer_idx: int, batch_size: int, max_len: int, dtype, device) -> StateSlot:
        return StateSlot()

    def split_projections(self, qkvz, ba):
        """The checkpoint's per-key-head interleaving -> q, k [.., Hk*dk], v, z [.., Hv*dv], b, a [.., Hv]."""
        r = self.Hv // self.Hk
        q, k, v, z = qkvz.unflatten(-1, (self.Hk, -1)).split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = ba.unflatten(-1, (self.Hk, -1)).split([r, r], dim=-1)
        return [t.flatten(-2) for t in (q, k, v, z, b, a)]

    def projections(self, x):
        """x [B, T, D] -> u [B, T, conv_dim + 2*Hv] (q, k, v, b, a: what `sequence` reads), z [B, T, Hv*dv]."""
        if self.split:
            return torch.cat([self.in_proj_qkv(x), self.in_proj_b(x), self.in_proj_a(x)], dim=-1), self.in_proj_z(x)
        q, k, v, z, b, a = self.split_projections(self.in_proj_qkvz(x), self.in_proj_ba(x))
        return torch.cat([q, k, v, b, a], dim=-1), z

    def forward(self, x, inputs, cache: StateSlot | None = None):  # inputs: mixers.MixerInputs
        u, z = self.projections(x)
        o = run_sequence(self.sequence, u, inputs, cache)
        o = self.norm(o.unflatten(-1, (self.Hv, self.dv)), z.unflatten(-1, (self.Hv, self.dv)))
        return self.out_proj(o.flatten(-2))

    def sequence(self, u, mask, state: RecurrentState | None):
        """u [B, T, conv_dim + 2*Hv] (q, k, v, b, a) -> (o [B, T, Hv*dv] in u's dtype, RecurrentState)."""
        qkv, b, a = u.split([self.conv_dim, self.Hv, self.Hv], dim=-1)
        qkv, window = causal_conv1d(masked(qkv, mask), self.conv1d.weight, self.conv1d.bias,
                                    None if state is None else state.conv)
        q, k, v = masked(qkv, mask).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        r = self.Hv // self.Hk
        q, k = (l2norm(wide(t).unflatten(-1, (self.Hk, self.dk))).repeat_interleave(r, dim=2) for t in (q, k))
        beta = wide(b.sigmoid())  # the sigmoid in the model dtype, as the reference
        g = -wide(self.A_log).exp() * F.softplus(wide(a) + self.dt_bias)
        o, S = chunk_gated_delta_rule(q * self.dk ** -0.5, k, wide(v).unflatten(-1, (self.Hv, self.dv)), g, beta,
                                      self.chunk, None if state is None else state.scan)
        return o.flatten(2).to(u.dtype), RecurrentState(window, S)
