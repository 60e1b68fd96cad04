"""The Mamba-2 token mixer (Granite 4.0-H's mamba layers), in pure PyTorch: the reference and the CPU path.

    in_proj(x) -> z (gate), xBC, dt;  xBC -> causal depthwise conv1d + SiLU -> x, B, C
    per head h:  state_t = exp(dt_t A_h) state_{t-1} + dt_t x_t B_t^T,   y_t = state_t C_t + D_h x_t
    out_proj(RMSNorm(y * silu(z)))

Letters: H heads, P head dim (H*P = the inner width), G groups (heads share B and C within a group:
head h reads group h // (H/G)), N state size, L chunk length, c chunks.

The scan is SSD's chunked form (Mamba-2 paper, "state space duality"): within a chunk the output is a
masked, decayed attention of C over B (quadratic in L); between chunks the state is carried by a short
loop over c. It equals transformers 4.57's `torch_forward` (GraniteMoeHybridMambaLayer without the
mamba-ssm kernels), whose dtype flow it keeps: dt's softplus in the model dtype, the scan in fp32, the
gated norm's product in fp32 (gate before the norm), cast back before out_proj.
Parameter names are the checkpoint's (`mamba.in_proj`, `mamba.conv1d`, `mamba.dt_bias`, `mamba.A_log`,
`mamba.D`, `mamba.norm`, `mamba.out_proj`). Padding and packed rows: core/token_mixers/ssm_common.py.
Its options are `Mamba2Config` (MoEConfig.mixers["mamba2"]), named as Granite 4.0-H's config.json names them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from minimoe.core.layers.masks import FULL
from minimoe.core.token_mixers.ssm_common import GatedRMSNorm, RecurrentState, StateSlot, causal_conv1d, masked, pad_to_chunks, read_layout, run_sequence, wide


@dataclass
class Mamba2Config:
    """A Mamba-2 layer's widths (H heads of P, G groups of B and C, state N) and its conv and scan."""
    mamba_n_heads: int = 128  # H
    mamba_d_head: int | str = "auto"  # P; "auto": mamba_expand * hidden_size / mamba_n_heads (`resolve`)
    mamba_n_groups: int = 1  # G: heads share B and C within a group
    mamba_d_state: int = 256  # N
    mamba_d_conv: int = 4  # the causal conv's kernel length
    mamba_expand: int = 2  # the inner width H*P, as a multiple of hidden_size, where mamba_d_head is "auto"
    mamba_chunk_size: int = 256  # L, the SSD scan's chunk (any length gives the same values to rounding)
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False  # biases on in_proj and out_proj
    mamba_dt_min: float = 0.0  # the time step, after its softplus, clamped from below (Nemotron-H: time_step_min)
    # the gated norm per group of H*P/G channels (Nemotron-H, transformers 5's Mamba-2s) or over all of them (4.57's)
    mamba_norm_per_group: bool = False

    def __post_init__(self):
        for name in ("mamba_n_heads", "mamba_n_groups", "mamba_d_state", "mamba_d_conv", "mamba_expand",
                     "mamba_chunk_size"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"config: {name} {getattr(self, name)!r}; expected an int >= 1")
        if self.mamba_d_head not in ("auto", None) and not (isinstance(self.mamba_d_head, int) and self.mamba_d_head >= 1):
            raise ValueError(f"config: mamba_d_head {self.mamba_d_head!r}; expected an int >= 1 or 'auto'")
        if self.mamba_n_heads % self.mamba_n_groups:
            raise ValueError(f"config: mamba_n_heads {self.mamba_n_heads} is not a multiple of mamba_n_groups "
                             f"{self.mamba_n_groups}")

    def resolve(self, config):
        """The head width "auto" from the model's hidden_size (config: the MoEConfig that holds this one)."""
        if self.mamba_d_head not in ("auto", None):
            return
        inner = self.mamba_expand * config.hidden_size
        if inner % self.mamba_n_heads == 0:
            self.mamba_d_head = inner // self.mamba_n_heads
        elif "mamba2" in config.mixer_kinds:  # held but run by no layer (a hybrid's attention-only model): left "auto"
            raise ValueError(f"config: mamba_n_heads {self.mamba_n_heads} does not divide mamba_expand * "
                             f"hidden_size = {inner}")


def ssd_scan(x, dt, A, B, C, chunk: int, state=None):
    """x [b, T, H, P], dt [b, T, H] (after softplus), A [H] (< 0), B and C [b, T, H, N], state [b, H, P, N]
    or None (zeros), all fp32 -> (y [b, T, H, P] without the D term, the final state [b, H, P, N])."""
    b, T, H, P = x.shape
    a = A * dt  # [b, T, H] log decay of each step
    xdt = x * dt[..., None]
    # chunks: [b, c, L, ...]; zero padding at the end is no input and no decay
    x_, a_, B_, C_ = (pad_to_chunks(t, chunk).unflatten(1, (-1, chunk)) for t in (xdt, a, B, C))
    acum = a_.cumsum(2)  # [b, c, L, H] log decay from the chunk start to each position
    # within each chunk: y_t += sum_{s<=t} exp(acum_t - acum_s) (C_t . B_s) x_s dt_s
    diff = acum[:, :, :, None, :] - acum[:, :, None, :, :]  # [b, c, L(t), L(s), H]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()[None, None, :, :, None]
    decay = diff.masked_fill(~causal, float("-inf")).exp()
    scores = torch.einsum("bclhn,bcshn->bclsh", C_, B_) * decay
    y = torch.einsum("bclsh,bcshp->bclhp", scores, x_)
    # each chunk's own contribution to the state at its end, then the carry across chunks
    to_end = (acum[:, :, -1:, :] - acum).exp()  # [b, c, L, H]
    chunk_states = torch.einsum("bclhn,bclh,bclhp->bchpn", B_, to_end, x_)
    h = x.new_zeros(b, H, P, B.shape[-1]) if state is None else state
    entering = []
    for i in range(x_.shape[1]):
        entering.append(h)
        h = h * acum[:, i, -1, :, None, None].exp() + chunk_states[:, i]
    entering = torch.stack(entering, 1)  # [b, c, H, P, N] the state before each chunk
    y = y + torch.einsum("bclhn,bchpn,bclh->bclhp", C_, entering, acum.exp())
    return y.flatten(1, 2)[:, :T], h


class Mamba2Mixer(nn.Module):
    """x [B, T, D] -> [B, T, D]; see the module docstring. A mixer of core/token_mixers/mixers.py ("mamba2")."""
    attribute = "mamba"  # the layer's attribute, hence the checkpoint's names (model.layers.i.mamba.*)
    mask_kind, takes_block_mask = FULL, True  # it reads padding and segments itself, never an attention mask
    read_layout = staticmethod(read_layout)  # packed rows' layout, once per forward (mixers.py)

    config_class = Mamba2Config  # its options: MoEConfig.mixers["mamba2"]

    def __init__(self, config, layer_idx: int):
        super().__init__()
        c = config.mixers["mamba2"]
        H, G = c.mamba_n_heads, c.mamba_n_groups
        self.H, self.P, self.G, self.N, self.chunk = H, c.mamba_d_head, G, c.mamba_d_state, c.mamba_chunk_size
        self.inner = H * c.mamba_d_head
        self.conv_dim = self.inner + 2 * G * self.N  # x, B, C go through the conv
        self.in_proj = nn.Linear(config.hidden_size, self.inner + self.conv_dim + H, bias=c.mamba_proj_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, c.mamba_d_conv, groups=self.conv_dim,
                                bias=c.mamba_conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(H))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, H + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(H))
        self.norm = GatedRMSNorm(self.inner, config.rms_norm_eps, gate_first=True,
                                 groups=G if c.mamba_norm_per_group else 1)
        self.dt_min = c.mamba_dt_min
        self.out_proj = nn.Linear(self.inner, config.hidden_size, bias=c.mamba_proj_bias)

    @staticmethod
    def cache_slot(config, layer_idx: int, batch_size: int, max_len: int, dtype, device) -> StateSlot:
        return StateSlot()

    def forward(self, x, inputs, cache: StateSlot | None = None):  # inputs: mixers.MixerInputs
        z, u = self.in_proj(x).split([self.inner, self.conv_dim + self.H], dim=-1)
        y = run_sequence(self.sequence, u, inputs, cache)
        return self.out_proj(self.norm(y, z).to(x.dtype))

    def sequence(self, u, mask, state: RecurrentState | None):
        """u [B, T, conv_dim + H] (xBC, dt) -> (y [B, T, H*P] fp32, RecurrentState)."""
        Bt, T, _ = u.shape
        xBC, dt = u.split([self.conv_dim, self.H], dim=-1)
        xBC, window = causal_conv1d(masked(xBC, mask), self.conv1d.weight, self.conv1d.bias,
                                    None if state is None else state.conv)
        xs, B, C = masked(xBC, mask).split([self.inner, self.G * self.N, self.G * self.N], dim=-1)
        dt = F.softplus(dt + self.dt_bias)  # [B, T, H] in the model dtype, as the reference
        if self.dt_min:  # Nemotron-H's reference clamps it (its time_step_limit is never read)
            dt = dt.clamp(min=self.dt_min)
        A = -torch.exp(wide(self.A_log))
        per_group = self.H // self.G
        B, C = (wide(t).unflatten(-1, (self.G, self.N)).repeat_interleave(per_group, dim=2) for t in (B, C))
        xs = wide(xs).unflatten(-1, (self.H, self.P))
        y, h = ssd_scan(xs, wide(dt), A, B, C, self.chunk, None if state is None else state.scan)
        y = y + self.D[:, None] * xs
        return y.flatten(2), RecurrentState(window, h)
