"""gpt-oss's experts (core/layers/clamped_experts.py) against transformers 4.57's GptOssExperts on random weights
large enough to hit both clamps, routed by its GptOssTopKRouter: fp32 outputs and gradients, the
grouped_mm path, the per-expert loop and rounded expert blocks (stand-in rows) alike."""
import pytest
import torch
pytest.importorskip("transformers")  # the oracle: a plain install skips these tests
from transformers.models.gpt_oss import modeling_gpt_oss as oss

import minimoe.core.layers.experts as mm
from minimoe.core.layers import cpu_memory
from minimoe.core.layers.clamped_experts import ClampedSwiGLUExperts, clamped_swiglu

FP32_TOL = 2e-5
E, D, I, K = 6, 16, 8, 2


def from_interleaved(gate_up, bias):
    """gpt-oss's gate_up_proj [E, D, 2I] and bias [E, 2I], gate/up interleaved -> [E, 2I, D], [E, 2I], gate first."""
    w = gate_up.transpose(1, 2)
    return torch.cat((w[:, 0::2], w[:, 1::2]), dim=1), torch.cat((bias[:, 0::2], bias[:, 1::2]), dim=-1)


def reference(E, D, I, K, std, seed=0):
    """transformers' gpt-oss router and experts of E experts (D in, I wide, top-K), every weight ~ N(0, std)."""
    cfg = oss.GptOssConfig(num_local_experts=E, num_experts_per_tok=K, hidden_size=D, intermediate_size=I,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    torch.manual_seed(seed)
    router, experts = oss.GptOssTopKRouter(cfg), oss.GptOssExperts(cfg)
    with torch.no_grad():
        for p in (*router.parameters(), *experts.parameters()):
            p.normal_(0, std)
    return router, experts


def pair(seed=0):
    router, ref = reference(E, D, I, K, std=1.0, seed=seed)  # gate/up values of several units: both clamps (7) are hit
    ours = ClampedSwiGLUExperts(E, D, I)
    with torch.no_grad():
        w, b = from_interleaved(ref.gate_up_proj, ref.gate_up_proj_bias)
        ours.gate_up_proj.weight.copy_(w)
        ours.gate_up_proj_bias.copy_(b)
        ours.down_proj.weight.copy_(ref.down_proj.transpose(1, 2))
        ours.down_proj_bias.copy_(ref.down_proj_bias)
    return router, ref, ours


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("grouped_mm, block", [(True, 1), (False, 1), (True, 4), (False, 4)])
def test_clamped_experts_match_gpt_oss(monkeypatch, grouped_mm, block):
    monkeypatch.setattr(mm, "USE_GROUPED_MM", grouped_mm and mm.USE_GROUPED_MM)
    monkeypatch.setattr(cpu_memory, "expert_block", lambda x, rows, n: block)
    router, ref, ours = pair()
    x = torch.randn(2, 9, D)
    with torch.no_grad():
        scores, experts = router(x)  # scores [T, E] (zero off the K), experts [T, K]
        h = x.reshape(-1, D) @ ref.gate_up_proj[0]  # both clamps are really hit
    weights = scores.gather(1, experts)
    assert (h > 7).any() and (h < -7).any()
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref = ref(x_ref, router_indices=experts, routing_weights=scores).reshape(-1, D)
    y = ours(x_ours.reshape(-1, D), experts, weights)
    assert rel(y, y_ref) < FP32_TOL
    g = torch.randn_like(y)
    (y_ref * g).sum().backward()
    (y * g).sum().backward()
    assert rel(x_ours.grad, x_ref.grad) < 1e-4
    gw, gb = from_interleaved(ref.gate_up_proj.grad, ref.gate_up_proj_bias.grad)
    assert rel(ours.gate_up_proj.weight.grad, gw) < 1e-4
    assert rel(ours.gate_up_proj_bias.grad, gb) < 1e-4
    assert rel(ours.down_proj.weight.grad, ref.down_proj.grad.transpose(1, 2)) < 1e-4
    assert rel(ours.down_proj_bias.grad, ref.down_proj_bias.grad) < 1e-4


def test_clamped_swiglu_by_its_formula():
    gate = torch.tensor([-10.0, -1.0, 0.0, 2.0, 9.0])
    up = torch.tensor([-9.0, 0.5, 3.0, -2.0, 8.0])
    want = [(min(u, 7) if u > -7 else -7) + 1 for u in up.tolist()]
    want = [w * min(g, 7) / (1 + torch.exp(torch.tensor(-1.702 * min(g, 7))).item())
            for w, g in zip(want, gate.tolist())]
    torch.testing.assert_close(clamped_swiglu(gate, up, 1.702, 7.0), torch.tensor(want))
