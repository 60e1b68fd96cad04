"""RMSNorm, as every family's reference computes it (one module for the block norms, the q/k norms and
MLA's latent norms; kept apart so that the model and every mixer import it without a circle).

Decision, for parity with transformers 4.57: normalise in fp32, cast back to the input dtype, *then*
multiply by the weight; gpt-oss multiplies the fp32 values and casts once (`weight_in_fp32`).
"""
from __future__ import annotations

import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, weight_in_fp32: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.weight_in_fp32 = eps, weight_in_fp32

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_in_fp32:  # gpt-oss: the weight multiplies the fp32 values, one rounding at the end
            return (self.weight * x32).to(x.dtype)
        return self.weight * x32.to(x.dtype)  # cast before the weight, as the reference does
