"""A supervision objective of your own: squared log error, (log e - log L+)^2 with L+ = max(L, eps).

    python train.py --model tiny --method-module examples/my_objective.py --method tes --objective sle
"""
import torch

import minimoe
from minimoe import Objective


def squared_log_error(pred, observed, eps):  # pred, observed [N]: the layer's prediction and the token CE
    return (torch.log(pred.float()) - torch.log(observed.float().clamp_min(eps))) ** 2  # observed stays attached


minimoe.register_objective(Objective("sle", squared_log_error, "squared log error (log e - log L+)^2"))
