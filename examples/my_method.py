"""A routing method of your own: native top-K over a / temperature + b, b a trained bias per expert.

    python train.py --model tiny --method-module examples/my_method.py --method biased
"""
import torch
import torch.nn as nn

import minimoe
from minimoe.core.routing_methods.methods import Method
from minimoe.core.routing_methods.routing import NativeRouter, Routing, Scoring


class BiasedRouter(NativeRouter):
    def __init__(self, scoring, num_experts, temperature, device=None):  # scoring: the family's (routing.Scoring)
        super().__init__(scoring)
        self.temperature = temperature
        self.bias = nn.Parameter(torch.zeros(num_experts, device=device))  # [E], fp32; zero: native at start

    @classmethod
    def from_gate(cls, gate, config, **options):  # one layer's policy; gate.weight [E, D]
        E = gate.weight.shape[0]
        return cls(Scoring.of(config), E, device=gate.weight.device, **options)

    def forward(self, x, logits, experts=None):  # x [T, D]; logits [T, E] fp32, the native a_t
        shifted = logits / self.temperature + self.bias
        experts, weights = self.scoring.select(shifted, experts)  # the family's own softmax/sigmoid and top-K
        return Routing(logits=logits, experts=experts, weights=weights, routing_logits=shifted)


minimoe.register_method(Method(
    "biased", BiasedRouter, label="Biased",
    options={"temperature": 1.0},  # --method-option temperature=2
    heads={"bias": ("bias_lr", 1e-3)},  # trained at --method-option bias_lr=..., in its own optimizer group
))
