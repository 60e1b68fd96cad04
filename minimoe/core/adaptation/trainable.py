"""What trains, by optimizer group: LoRA, each head of the installed method, and the tuned native gates.

Decision: the groups are LoRA, each head of the model's method (`Method.heads`, one group per
learning-rate option) and the tuned native gates, in that order; a parameter that trains and falls in
no group is an error, so that nothing trains without a learning rate someone chose for it.
"""
from __future__ import annotations

import torch.nn as nn

from minimoe.core.routing_methods.methods import Method


def param_groups(method: Method | None) -> dict[str, tuple[str, ...]]:
    """Optimizer group -> the name patterns of its parameters: LoRA, the installed method's heads (each named
    after its learning-rate option less "_lr": error_head, copied_head), the tuned native gates ("router")."""
    heads = {group: (f".mlp.router.{head}.",)  # the name + "." matches a parameter head too
             for group, (head, _) in (method.head_groups if method else {}).items()}
    return {"lora": (".lora_A", ".lora_B"), **heads, "router": (".mlp.gate.weight",)}


def trainable_parameters(model: nn.Module, method: Method | None = None) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Trainable (name, parameter) pairs by group (`param_groups` of `method`, by default the one installed,
    `model.router_method`), for the optimizer's param groups."""
    patterns = param_groups(method or getattr(model, "router_method", None))
    groups = {g: [] for g in patterns}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        group = next((g for g, pats in patterns.items() if any(s in name + "." for s in pats)), None)
        if group is None:
            raise ValueError(f"parameter {name!r} trains but matches no group of {patterns}; freeze it, or "
                             "list its module in its method's heads (methods.Method)")
        groups[group].append((name, p))
    return groups
