"""DenseMixer (minimoe/core/routing_methods/densemixer.py) on every family's router: the forward is the native top-K's bit
for bit, the experts keep their sparse gradient, and the gate's gradient is the dense mixture's over all
E experts, computed here by autograd from its definition."""
import pytest
import torch
import torch.nn.functional as F

from minimoe.core.routing_methods.densemixer import dense_weights
from minimoe.core.routing_methods.methods import set_router
from minimoe.core.routing_methods.routing import Scoring, moe_blocks
from minimoe.making.tiny import FAMILY_SWITCHES
from tests.conftest import tiny_model

CASES = {**{f: (f, {}) for f in FAMILY_SWITCHES},
         # top-1 renormalised: the native weight is the constant 1, so the native gate gets no gradient
         "olmoe-top1": ("olmoe", dict(num_experts_per_tok=1, norm_topk_prob=True)),
         "olmoe-norm": ("olmoe", dict(norm_topk_prob=True)),
         # the sigmoid of each of the K scales the expert's input; the releases' top-1 is the tiny one's
         "llama4_text-top2": ("llama4_text", dict(num_experts_per_tok=2))}


def block_and_input(case):
    family, overrides = CASES[case]
    model = tiny_model(family, **overrides).train()
    block = list(moe_blocks(model).values())[-1]
    x = torch.randn(1, 12, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    r = torch.randn(1, 12, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    return model, block, x, r


def run(block, x, r):
    """Output and the gradients of <r, y> w.r.t. the gate and the expert banks."""
    y, routing = block(x)
    params = [block.gate.weight, *block.experts.parameters()]
    return y, routing, torch.autograd.grad((y * r).sum(), params)


def dense_reference_gate_grad(block, x, r, scoring: Scoring):
    """d/dW_gate of <r, y_dense>, the dense mixture over all E experts: y_dense = sum_e w_e(a) E_e(x), the
    experts' outputs held fixed, or, where the experts scale their input (Llama 4), sum_e E_e(w_e(a) x), the
    gradient reaching w_e through the expert. w from the family's weights written out: softmax p (or sigmoid
    s, or DeepSeek-V4's sqrt(softplus(a))), divided by their sum over the native K where the family renormalises (norm_topk_prob, or a softmax
    over the K logits), times the scaling factor."""
    flat = x.reshape(-1, x.shape[-1])
    T, E = flat.shape[0], block.gate.weight.shape[0]
    W = block.gate.weight.detach().requires_grad_(True)
    a = F.linear(flat.float() if block.router_fp32 else flat, W, block.gate.bias).float()  # [T, E]
    correction = getattr(block.gate, "e_score_correction_bias", None)
    chosen = scoring.select(a.detach(), correction=correction)[0]  # [T, K] the native top-K
    s = {"softmax": a.softmax(-1), "sigmoid": a.sigmoid(), "sqrtsoftplus": F.softplus(a).sqrt()}[scoring.func]
    if scoring.normalize or (scoring.on_logits and scoring.func == "softmax"):
        s = s / s.gather(-1, chosen).sum(-1, keepdim=True)
    w = s * scoring.scaling  # [T, E]
    ones = torch.ones(T, 1)
    latent = hasattr(block, "fc1_latent_proj")  # Nemotron-H's: the experts run between two projections
    flat = block.fc1_latent_proj(flat).detach() if latent else flat
    if getattr(block.experts, "scale_input", False):  # the input scaled by hand, the bank's own scale 1
        dense = sum(block.experts(w[:, e:e + 1] * flat, torch.full((T, 1), e), ones) for e in range(E))  # [T, D]
    else:
        with torch.no_grad():
            outs = torch.stack([block.experts(flat, torch.full((T, 1), e), ones) for e in range(E)], 1)
        dense = (w[..., None] * outs).sum(1)  # [T, D] (latent: [T, moe_latent_size])
    if latent:
        dense = block.fc2_latent_proj(dense)
    (grad,) = torch.autograd.grad((dense * r.reshape(T, -1)).sum(), W)
    return grad, w, chosen


@pytest.mark.parametrize("case", list(CASES))
def test_densemixer_forward_is_native_and_gate_gradient_is_the_dense_mixtures(case):
    model, block, x, r = block_and_input(case)
    model.requires_grad_(True)
    y_native, native, (native_gate, *native_banks) = run(block, x, r)
    set_router(model, "densemixer", layers="all")
    model.requires_grad_(True)
    y, routing, (gate, *banks) = run(block, x, r)
    assert torch.equal(y, y_native) and torch.equal(routing.experts, native.experts)
    for got, want in zip(banks, native_banks):  # the experts' gradient stays the sparse one
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    want, w, chosen = dense_reference_gate_grad(block, x, r, block.router.scoring)
    assert torch.equal(chosen, routing.experts)
    torch.testing.assert_close(w.gather(-1, chosen), native.weights)  # the dense weights extend the native ones
    torch.testing.assert_close(dense_weights(block.router.scoring, routing.logits, routing.experts), w)
    torch.testing.assert_close(gate, want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(gate, native_gate, atol=1e-6)  # the dense gradient is not the sparse one
    if case == "olmoe-top1":
        assert native_gate.abs().max() < 1e-3 * gate.abs().max()  # native: p / p = 1, zero but for rounding


def test_dense_weights_equal_the_native_weights_on_the_selection():
    logits = torch.randn(6, 8)
    for scoring in (Scoring(2), Scoring(2, True), Scoring(3, on_logits=True), Scoring(2, True, "sigmoid", scaling=2.5),
                    Scoring(2, func="sigmoid", on_logits=True)):
        experts, weights = scoring.select(logits)
        torch.testing.assert_close(dense_weights(scoring, logits, experts).gather(-1, experts), weights)


def test_densemixer_costs_nothing_without_gradient():
    """Evaluation: no dense pass (the experts run once per layer, on the K chosen)."""
    model, block, x, _ = block_and_input("olmoe")
    set_router(model, "densemixer", layers="all")
    calls = []
    block.experts.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        block(x)
    assert len(calls) == 1
