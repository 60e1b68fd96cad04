"""RMSNorm, as every family's reference computes it (one module for the block norms, the q/k norms and
MLA's latent norms; kept apart so that the model and every mixer import it without a circle), and the
normalising step that the recurrent mixers' gated norms share with it (`rms_normalized`).

Decision, for parity with transformers 4.57: normalise in fp32, cast back to the input dtype, *then*
multiply by the weight; gpt-oss multiplies the fp32 values and casts once (`weight_in_fp32`);
Qwen3-Next's weight is zero-centred (`zero_centred`: the scale is 1 + weight, stored 0 at init) and
multiplies in fp32 too.
"""
from __future__ import annotations

import torch
import torch.nn as nn


def rms_normalized(x, eps: float):
    """x [..., dim] (already in the precision to normalise in) over its root mean square."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, weight_in_fp32: bool = False, zero_centred: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centred else torch.ones(dim))
        self.eps, self.weight_in_fp32, self.zero_centred = eps, weight_in_fp32, zero_centred

    @classmethod
    def of(cls, config, dim: int) -> "RMSNorm":
        """The config's kind of norm (its eps, weight_in_fp32, zero-centred weight) over `dim`."""
        return cls(dim, config.rms_norm_eps, config.norm_weight_in_fp32, config.norm_zero_centred)

    def forward(self, x):
        x32 = rms_normalized(x.float(), self.eps)
        if self.zero_centred:  # Qwen3-Next: (1 + w) in fp32, one rounding at the end
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        if self.weight_in_fp32:  # gpt-oss: the weight multiplies the fp32 values, one rounding at the end
            return (self.weight * x32).to(x.dtype)
        return self.weight * x32.to(x.dtype)  # cast before the weight, as the reference does
