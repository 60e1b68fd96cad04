"""DeepSeek-V4's routers against transformers 5.23's DeepseekV4TopKRouter and DeepseekV4HashRouter on random gates
and tokens: the sqrt-softplus scoring with its selection-only correction bias, the K renormalised and scaled
(`Scoring`, core/routing_methods/routing.py), and hash routing, the experts a frozen table's rows for each token id
(`hash_experts`), weighed by the same scores."""
import pytest
import torch

from minimoe.core.routing_methods.routing import NativeRouter, Scoring, hash_experts

pytestmark = pytest.mark.tf5
E, K, D, V, T = 8, 3, 16, 50, 12


def reference(kind, seed):
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as ref
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
    cfg = DeepseekV4Config(hidden_size=D, n_routed_experts=E, num_experts_per_tok=K, vocab_size=V,
                           num_hidden_layers=1, num_attention_heads=2, head_dim=8, q_lora_rank=8)
    router = getattr(ref, kind)(cfg)
    torch.manual_seed(seed)
    with torch.no_grad():
        router.weight.normal_(0, 1.0)
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.normal_(0, 0.5)  # large enough to change choices
        if hasattr(router, "tid2eid"):
            router.tid2eid.copy_(torch.stack([torch.randperm(E)[:K] for _ in range(V)]))
    return cfg, router


def scoring(cfg) -> Scoring:  # DeepSeek-V4's, as its record fixes it
    return Scoring(K, normalize=True, func="sqrtsoftplus", method="noaux_tc", scaling=cfg.routed_scaling_factor)


def test_sqrt_softplus_router_equals_transformers():
    cfg, theirs = reference("DeepseekV4TopKRouter", 0)
    x = torch.randn(T, D)
    want_logits, want_weights, want_experts = theirs(x)
    logits = torch.nn.functional.linear(x, theirs.weight)
    routing = NativeRouter(scoring(cfg))(x, logits, correction=theirs.e_score_correction_bias)
    order, want_order = routing.experts.sort(-1), want_experts.sort(-1)  # transformers' top-K is unsorted
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(routing.weights.gather(-1, order.indices), want_weights.gather(-1, want_order.indices))
    unbiased = NativeRouter(scoring(cfg))(x, logits)  # the bias chooses: without it, other experts
    assert not torch.equal(unbiased.experts.sort(-1).values, want_order.values)
    sigmoid = NativeRouter(Scoring(K, True, "sigmoid", method="noaux_tc", scaling=cfg.routed_scaling_factor))
    assert not torch.allclose(sigmoid(x, logits, experts=routing.experts).weights, routing.weights)


def test_hash_router_equals_transformers():
    cfg, theirs = reference("DeepseekV4HashRouter", 1)
    ids = torch.randint(0, V, (2, T // 2))
    x = torch.randn(2, T // 2, D)
    _, want_weights, want_experts = theirs(x, ids)
    experts = hash_experts(theirs.tid2eid, ids)
    assert torch.equal(experts, want_experts)
    logits = torch.nn.functional.linear(x.reshape(T, D), theirs.weight)
    routing = NativeRouter(scoring(cfg))(x.reshape(T, D), logits, experts=experts)
    assert torch.equal(routing.experts, want_experts)
    torch.testing.assert_close(routing.weights, want_weights)
