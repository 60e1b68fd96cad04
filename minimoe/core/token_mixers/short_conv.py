"""The gated short convolution (LFM2's conv layers, Liquid AI's LFM2-8B-A1B among them), in pure PyTorch:

    B, C, x = in_proj(x) split in three along the features  (in that order: the checkpoint's rows)
    y = C * conv(B * x)       conv: causal depthwise over time, kernel conv_L_cache, no activation
    out_proj(y)

Letters: B batch, T positions, D hidden (the conv runs on every one of the D channels), K the kernel.
The only state it carries is the conv's window, the last K-1 values of B * x: the generation cache holds it
(ssm_common's `StateSlot`) and a packed candidate starts from its prompt's (ssm_common's `run_segments`).

Decisions (transformers 5.23's Lfm2MoeShortConv, its torch path):
- conv_bias puts a bias on in_proj, the conv and out_proj alike, as transformers does.
- Padding: the layer's input is zeroed at padded positions, as transformers' does. With conv_bias, in_proj's
  bias would still make B * x non-zero there and reach the next K-1 real positions through the conv after a
  left padding (in transformers it does); ours zeroes B * x at padding too, so that a left-padded row equals
  the row alone, the property generation and packed rows rest on. Without conv_bias (every LFM2 release) the
  two are the same computation; with it, right padding and unpadded rows still are.
- The conv's input is cast to its weight's dtype and its output back, as transformers' causal_conv1d_fn.
Parameter names are the checkpoint's (`model.layers.i.conv.{in_proj, conv, out_proj}`). Its options are
`ShortConvConfig` (MoEConfig.mixers["short_conv"]), named as LFM2's config.json names them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from minimoe.core.layers.masks import FULL
from minimoe.core.token_mixers.ssm_common import RecurrentState, StateSlot, causal_conv1d, masked, read_layout, run_sequence


@dataclass
class ShortConvConfig:
    """A gated short convolution layer's kernel and biases."""
    conv_L_cache: int = 3  # K, the conv's kernel length (its window keeps K-1 positions)
    conv_bias: bool = False  # biases on in_proj, the conv and out_proj

    def __post_init__(self):
        if not (isinstance(self.conv_L_cache, int) and self.conv_L_cache >= 1):
            raise ValueError(f"config: conv_L_cache {self.conv_L_cache!r}; expected an int >= 1")
        if not isinstance(self.conv_bias, bool):
            raise ValueError(f"config: conv_bias {self.conv_bias!r}; expected true or false")


class ShortConv(nn.Module):
    """x [B, T, D] -> [B, T, D]; see the module docstring. A mixer of core/token_mixers/mixers.py ("short_conv")."""
    attribute = "conv"  # the layer's attribute, hence the checkpoint's names (model.layers.i.conv.*)
    mask_kind, takes_block_mask = FULL, True  # it reads padding and segments itself, never an attention mask
    read_layout = staticmethod(read_layout)  # packed rows' layout, once per forward (mixers.py)
    config_class = ShortConvConfig  # its options: MoEConfig.mixers["short_conv"]

    def __init__(self, config, layer_idx: int):
        super().__init__()
        c, D = config.mixers["short_conv"], config.hidden_size
        self.in_proj = nn.Linear(D, 3 * D, bias=c.conv_bias)
        self.conv = nn.Conv1d(D, D, c.conv_L_cache, groups=D, bias=c.conv_bias)  # weight [D, 1, K]
        self.out_proj = nn.Linear(D, D, bias=c.conv_bias)

    @staticmethod
    def cache_slot(config, layer_idx: int, batch_size: int, max_len: int, dtype, device) -> StateSlot:
        return StateSlot()

    def forward(self, x, inputs, cache: StateSlot | None = None):  # inputs: mixers.MixerInputs
        T = x.shape[1]
        mask = None if inputs.attention_mask is None else inputs.attention_mask[:, -T:]
        b, c, v = self.in_proj(masked(x, mask)).chunk(3, dim=-1)  # [B, T, D] each
        y = run_sequence(self.sequence, b * v, inputs, cache)
        return self.out_proj(c * y)

    def sequence(self, u, mask, state: RecurrentState | None):
        """u [B, T, D] (B * x) -> (the conv of it [B, T, D] in u's dtype, RecurrentState: its window)."""
        w = self.conv.weight
        y, window = causal_conv1d(masked(u, mask).to(w.dtype), w, self.conv.bias,
                                  None if state is None else state.conv, silu=False)
        return y.to(u.dtype), RecurrentState(window, None)
