"""Tests for minimoe.core.routing_methods.routing: each test names the paper equation, contract or bad input it checks."""

import copy
import json
import math
from dataclasses import fields

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from minimoe.core.routing_methods.methods import METHODS, Method, set_router
from minimoe.core.decoder.model import MoEConfig, MoEForCausalLM, init_weights
from tests.conftest import tiny_model as family_model
from minimoe.core.routing_methods.objectives import itakura_saito, supervision_loss
from minimoe.core.routing_methods.routing import (ConcentrationRouter, DualAffinityRouter, NativeRouter, Routing, Scoring, TokenErrorRouter,
                                  attenuate, concentration, native_concentration, resolve_layers, select_topk)

# The routings the tests run under (not core's family_record.FAMILIES): Granite's softmax over the K, OLMoE's
# softmax then top-K without and with norm_topk_prob.
CONFIGS = {
    "granite": dict(model_type="granitemoe", tie_word_embeddings=True, embedding_multiplier=12.0,
                    residual_multiplier=0.22, logits_scaling=6.0, attention_multiplier=0.1),
    "olmoe": dict(model_type="olmoe"),
    "olmoe-norm": dict(model_type="olmoe", norm_topk_prob=True),
}
POLICY_TYPES = {"native": NativeRouter, "dual": DualAffinityRouter, "tes": TokenErrorRouter, "acs": ConcentrationRouter}


def tiny_model(family="olmoe", seed=0, top_k=2):
    torch.manual_seed(seed)
    config = MoEConfig(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=top_k,
                       **CONFIGS[family])
    return init_weights(MoEForCausalLM(config), std=0.2)


def token_ce(logits, ids):
    """ce[b, t] = CE(logits[b, t], ids[b, t + 1]); the last position has no target (mask False)."""
    B, T, V = logits.shape
    ce = F.cross_entropy(logits[:, :-1].float().reshape(-1, V), ids[:, 1:].reshape(-1), reduction="none")
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, -1] = False
    return torch.cat([ce.view(B, T - 1), ce.new_zeros(B, 1)], dim=1), mask


def tes_router(renormalize, gamma=1.0, tau=1.0, transform="started-log", D=16, E=8, K=3, seed=0):
    """A TES policy with a random (non-neutral) error head, and random inputs for it."""
    g = torch.Generator().manual_seed(seed)
    router = TokenErrorRouter(D, E, Scoring(K, renormalize), gamma, tau, transform)
    with torch.no_grad():
        router.error_head.weight.copy_(torch.randn(E, D, generator=g))
        router.error_head.bias.copy_(torch.randn(E, generator=g))
    return router, torch.randn(32, D, generator=g), 2 * torch.randn(32, E, generator=g)


# ---- attenuation geometry (Eq. attenuated_probability, app. shifted_log_geometry) -----------------

@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("gamma,tau", [(1.0, 1.0), (2.5, 0.3)])
def test_attenuated_probability_is_native_times_inverse_error_factor(renormalize, gamma, tau):
    # Eq. attenuated_probability: p~_i = p_i (1 + e_i/tau)^-gamma / sum_j p_j (1 + e_j/tau)^-gamma,
    # and the FFN weights are p~ on the executed set under the family's normalisation.
    router, x, logits = tes_router(renormalize, gamma, tau)
    r = router(x, logits)
    e = r.expert_scores.detach().double()
    unnorm = logits.double().softmax(-1) * (1 + e / tau) ** -gamma
    p_att = unnorm / unnorm.sum(-1, keepdim=True)
    torch.testing.assert_close(r.routing_logits.double().softmax(-1), p_att, rtol=1e-5, atol=1e-7)
    assert torch.equal(r.experts.sort(-1).values, p_att.topk(3, -1).indices.sort(-1).values)
    expected = p_att.gather(-1, r.experts)
    if renormalize:
        expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(r.weights.double(), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("renormalize", [True, False])
def test_gamma_zero_recovers_native_routing(renormalize):
    # Eq. attenuated_routing_score at gamma = 0: a~ = a exactly, whatever the error head says.
    router, x, logits = tes_router(renormalize, gamma=0.0)
    r = router(x, logits)
    experts, weights = select_topk(logits, 3, renormalize)
    assert torch.equal(r.experts, experts) and torch.equal(r.weights, weights)


def test_pairwise_routing_odds():
    # Eq. appendix_shifted_log_pairwise: p~_i / p~_j = (p_i / p_j) ((tau + e_i) / (tau + e_j))^-gamma.
    gamma, tau = 1.7, 0.6
    router, x, logits = tes_router(True, gamma, tau)
    r = router(x, logits)
    p, e = logits.double().softmax(-1), r.expert_scores.detach().double()
    p_att = r.routing_logits.double().softmax(-1)
    for i, j in [(0, 1), (2, 7), (5, 3)]:
        expected = p[:, i] / p[:, j] * ((tau + e[:, i]) / (tau + e[:, j])) ** -gamma
        torch.testing.assert_close(p_att[:, i] / p_att[:, j], expected, rtol=1e-5, atol=0)


def test_started_log_rescaling_identity():
    # Eq. appendix_shifted_log_rescaling: phi_tau(xi e) = phi_{tau/xi}(e); read off a~ = a - phi.
    g = torch.Generator().manual_seed(0)
    e, a = torch.rand(100, dtype=torch.float64, generator=g) * 5 + 1e-3, torch.zeros(100, dtype=torch.float64)
    for xi, tau in [(0.5, 1.0), (3.0, 0.2), (10.0, 7.0)]:
        torch.testing.assert_close(attenuate(a, xi * e, 1.0, tau), attenuate(a, e, 1.0, tau / xi))


@pytest.mark.parametrize("gamma,tau", [(1.0, 1.0), (0.4, 2.0)])
def test_started_log_derivatives(gamma, tau):
    # Eq. appendix_shifted_log_derivatives: da~/de = -gamma/(tau + e), da~/dlog e = -gamma e/(tau + e).
    log_e = torch.linspace(-4, 4, 17, dtype=torch.float64, requires_grad=True)
    e = log_e.exp()
    e.retain_grad()
    attenuate(torch.zeros_like(e), e, gamma, tau).sum().backward()
    ed = e.detach()
    torch.testing.assert_close(e.grad, -gamma / (tau + ed))
    torch.testing.assert_close(log_e.grad, -gamma * ed / (tau + ed))


def test_pure_log_transform():
    # Eq. shifted_log_ablation_score: a~ = a - gamma log e; a common rescaling of e is a shared shift.
    g = torch.Generator().manual_seed(0)
    a, e = torch.randn(4, 8, generator=g), torch.rand(4, 8, generator=g) + 0.1
    torch.testing.assert_close(attenuate(a, e, 2.0, 1.0, transform="log"), a - 2.0 * e.log())  # tau: unused by log
    shifted = attenuate(a, 5.0 * e, 2.0, 1.0, transform="log")
    torch.testing.assert_close(shifted.softmax(-1), attenuate(a, e, 2.0, 1.0, transform="log").softmax(-1))


# ---- initialisation: routing exactly native ---------------------------------------------------------

@pytest.mark.parametrize("family", [*CONFIGS, "gemma4_text"])  # Gemma 4: the heads read the gate's own input
@pytest.mark.parametrize("method,options", [("dual", {}), ("dual", {"mix": 0.3}), ("tes", {}),
                                            ("tes", {"transform": "log"})])
def test_new_heads_start_native(family, method, options):
    # Dual: a + w (a_copy - a) with a_copy == a bit for bit, so the logits are torch.equal.
    # TES: every expert gets the same phi (softplus(0) = log 2, or e_hat = 1 for pure log), a per-token
    # constant that softmax ignores (Eq. attenuated_probability's factor cancels). In floats a_i - c
    # rounds per element, so the LM logits agree to ~1e-7 of their scale, not bit for bit; the
    # executed experts are identical.
    model = tiny_model(family) if family in CONFIGS else family_model(family)  # the latter: making/tiny.py's
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    ref = model(ids)
    out = set_router(model, method, "all", **options)(ids)
    for r, n in zip(out.routings, ref.routings):
        assert torch.equal(r.experts, n.experts)
        # TES subtracts one constant from every logit: equal up to fp32 rounding of a - c (few ulp).
        torch.testing.assert_close(r.weights, n.weights, rtol=1e-5, atol=1e-6)
    if method == "dual":
        assert torch.equal(out.logits, ref.logits)
    else:
        assert (out.logits - ref.logits).abs().max() <= 1e-6 * ref.logits.abs().max()
        scores = out.routings[0].expert_scores
        expected = math.log(2.0) if options.get("transform", "started-log") == "started-log" else 1.0
        torch.testing.assert_close(scores, torch.full_like(scores, expected), rtol=1e-6, atol=0)


def test_dual_affinitys_mixing_weight_is_the_copied_heads():
    """Dual Affinity's logits (1 - w) a + w a_copy: w (the paper's "mixing weight", 0.5 in its hyperparameter table) is the
    copied head's share. The paper's 0.5 averages the two and hides a weight on the wrong side, and at init
    a_copy = a hides it too: here the copy is moved away from the gate and w = 0.3. Selection and weights
    are the native rule's (softmax, top-K, renormalised) on the mixed logits."""
    g = torch.Generator().manual_seed(0)
    gate = torch.nn.Linear(16, 8, bias=False)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(8, 16, generator=g))
    router = DualAffinityRouter(gate, Scoring(3, True), mix=0.3)
    with torch.no_grad():
        router.affinity.weight.copy_(torch.randn(8, 16, generator=g))
        router.affinity.bias.copy_(torch.randn(8, generator=g))
    x = torch.randn(32, 16, generator=g)
    a = gate(x)  # [T, E] the native affinity
    a_copy = x @ router.affinity.weight.T + router.affinity.bias
    expected = 0.7 * a + 0.3 * a_copy
    r = router(x, a)
    torch.testing.assert_close(r.routing_logits, expected, rtol=1e-5, atol=1e-6)
    assert (0.3 * a + 0.7 * a_copy - expected).abs().max() > 0.1  # the weight on the other side differs
    torch.testing.assert_close(r.logits, a, rtol=0, atol=0)  # the native a is what the diagnostics read
    top = expected.softmax(-1).topk(3, dim=-1)
    assert torch.equal(r.experts, top.indices)
    torch.testing.assert_close(r.weights, top.values / top.values.sum(-1, keepdim=True), rtol=1e-5, atol=1e-6)


# ---- affinity concentration (Eq. affinity_concentration) --------------------------------------------

def reference_concentration(selected_probs):
    """Eq. diagnostic_token_concentration in numpy, the oracle: (T, K) selected probabilities -> (T,) C_t."""
    p = np.asarray(selected_probs, dtype=np.float64)
    pbar = p / p.sum(axis=1, keepdims=True)  # renormalise over the selected set
    return (pbar**2).sum(axis=1)


def test_concentration_renormalises_over_the_selected_set():
    # Eq. diagnostic_token_concentration: (0.3, 0.1) renormalises to (0.75, 0.25).
    np.testing.assert_allclose(reference_concentration([[0.3, 0.1], [0.2, 0.2]]), [0.75**2 + 0.25**2, 0.5])
    probs = torch.tensor([[0.3, 0.1, 0.6], [0.2, 0.2, 0.6]])  # two selected experts of three
    c = concentration(probs.log(), torch.tensor([[0, 1], [0, 1]]))
    np.testing.assert_allclose(c.numpy(), [0.75**2 + 0.25**2, 0.5], rtol=1e-6)
    logits = 3 * torch.randn(200, 8, generator=torch.Generator().manual_seed(0))
    experts, _ = select_topk(logits, 3, False)
    selected = logits.double().softmax(-1).gather(-1, experts).numpy()
    np.testing.assert_allclose(concentration(logits, experts).numpy(), reference_concentration(selected), rtol=1e-6)


def test_concentration_bounds_and_uniform_value():
    # Eq. affinity_concentration: 1/K <= C_t <= 1, and C_t = 1/K at uniform selected affinity.
    K = 3
    logits = 3 * torch.randn(500, 8, generator=torch.Generator().manual_seed(0))
    experts, _ = select_topk(logits, K, False)
    c = concentration(logits, experts)
    assert (c >= 1 / K - 1e-6).all() and (c <= 1 + 1e-6).all()
    uniform = torch.tensor([[1.0, 1.0, 1.0, -2.0, 0.5, -1.0, 0.0, 0.3]])
    torch.testing.assert_close(concentration(uniform, select_topk(uniform, K, False)[0]), torch.tensor([1 / K]))


@pytest.mark.parametrize("renormalize", [True, False])
def test_concentration_logit_gradient(renormalize):
    # Eq. appendix_affinity_concentration_logit_gradient: dC/da_i = 2 pbar_i (pbar_i - C) on the
    # selected set, 0 elsewhere; through the acs policy's "prediction" readout.
    g = torch.Generator().manual_seed(0)
    logits = (2 * torch.randn(64, 8, generator=g)).requires_grad_()  # routing math is fp32
    r = ConcentrationRouter(Scoring(3, renormalize))(None, logits)
    c = r.prediction
    torch.testing.assert_close(c, native_concentration(logits, 3))  # acs supervises the native C_t
    c.sum().backward()
    p = logits.detach().softmax(-1).gather(-1, r.experts)
    pbar = p / p.sum(-1, keepdim=True)
    expected = torch.zeros_like(logits).scatter(-1, r.experts, 2 * pbar * (pbar - c.detach()[:, None]))
    torch.testing.assert_close(logits.grad, expected, rtol=1e-5, atol=1e-6)


def test_concentration_readout_is_native_and_diagnostic_for_every_policy():
    # The diagnostic C_t is over the native top-K with native p, detached, for every policy.
    model = set_router(tiny_model(), "tes", "all", gamma=3.0)
    g = torch.Generator().manual_seed(0)
    for mlp in (layer.mlp for layer in model.model.layers):
        with torch.no_grad():
            mlp.router.error_head.weight.normal_(0, 1.0, generator=g)
    out = model(torch.randint(0, 128, (2, 12), generator=g))
    r = out.routings[-1]
    native = select_topk(r.logits, 2, False)[0]
    assert not torch.equal(native, r.experts)  # attenuation moved the route, so the sets differ
    c = native_concentration(r.logits, 2)
    torch.testing.assert_close(c, concentration(r.logits, native))
    assert not c.requires_grad


# ---- the tes readout (Eq. aggregate_predicted_error) ------------------------------------------------

@pytest.mark.parametrize("renormalize", [True, False])
def test_tes_readout_weights_executed_scores_by_native_affinity(renormalize):
    # Eq. aggregate_predicted_error: e_hat_t = sum_{i in S_act} pbar_i e_i with native p renormalised
    # over the executed (attenuated) set.
    router, x, logits = tes_router(renormalize, gamma=2.0)
    r = router(x, logits)
    p = logits.softmax(-1).gather(-1, r.experts)
    expected = (p / p.sum(-1, keepdim=True) * r.expert_scores.gather(-1, r.experts)).sum(-1)
    torch.testing.assert_close(r.prediction, expected)  # what the method supervises is e_hat
    assert METHODS["tes"].predicts_error


def test_expert_score_gradient_is_pbar_times_aggregate_gradient():
    # Eq. appendix_aggregate_component_derivative (de_hat/de_i = pbar_i on S_act, 0 elsewhere) and
    # Eq. appendix_is_component_gradient (dL_IS/de_i = pbar_i (e_hat - L+)/e_hat^2).
    router, x, logits = tes_router(True, gamma=1.0)
    r = router(x, logits)
    scores, e_hat = r.expert_scores, r.prediction
    scores.retain_grad()
    observed = torch.rand(32, generator=torch.Generator().manual_seed(1)) * 4
    itakura_saito(e_hat, observed).sum().backward()
    p = logits.softmax(-1).gather(-1, r.experts)
    pbar = p / p.sum(-1, keepdim=True)
    e = e_hat.detach()[:, None]
    expected = torch.zeros_like(scores).scatter(-1, r.experts, pbar * (e - observed[:, None]) / e**2)
    torch.testing.assert_close(scores.grad, expected)


def test_error_head_is_softplus_of_an_affine_map_with_trained_weights():
    # Eq. positive_error_head, e_t = softplus(W_e h_t + b_e), with non-zero W_e, b_e, computed here by hand.
    router, x, logits = tes_router(True)
    W, b = router.error_head.weight.detach(), router.error_head.bias.detach()
    z = (x[:, None, :].double() * W[None].double()).sum(-1) + b.double()  # [T, E]
    expected = torch.where(z > 20, z, torch.log1p(torch.exp(z)))
    torch.testing.assert_close(router(x, logits).expert_scores.double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("renormalize", [True, False])
def test_error_head_trains_through_the_attenuated_combine_weights(renormalize):
    # The head gets gradient through the FFN combine weights, not only through the readout: a loss on the
    # weights alone gives the head the gradient of the paper's attenuated policy, written out here with
    # autograd (Eq. positive_error_head, started_log_transform, attenuated_routing_score).
    router, x, logits = tes_router(renormalize, gamma=1.5, tau=0.7)
    r = router(x, logits)
    c = torch.randn(r.weights.shape, generator=torch.Generator().manual_seed(2))
    (r.weights * c).sum().backward()
    W = router.error_head.weight.detach().clone().requires_grad_()
    b = router.error_head.bias.detach().clone().requires_grad_()
    e = torch.log1p(torch.exp(x @ W.T + b))
    p = (logits - 1.5 * torch.log1p(e / 0.7)).softmax(-1).gather(-1, r.experts)
    weights = p / p.sum(-1, keepdim=True) if renormalize else p
    (weights * c).sum().backward()
    assert W.grad.abs().max() > 1e-3
    torch.testing.assert_close(router.error_head.weight.grad, W.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(router.error_head.bias.grad, b.grad, rtol=1e-4, atol=1e-6)


# ---- replay (gradient checkpointing) ------------------------------------------------------------------

@pytest.mark.parametrize("make", [lambda: NativeRouter(Scoring(3, True)), lambda: ConcentrationRouter(Scoring(3, False)),
                                  lambda: tes_router(False, gamma=2.0)[0],
                                  lambda: DualAffinityRouter(torch.nn.Linear(16, 8, bias=False), Scoring(3, True), mix=0.5)])
def test_policies_replay_a_given_selection(make):
    # The protocol: with `experts` given, the policy uses them and computes everything else as usual.
    g = torch.Generator().manual_seed(0)
    router, x, logits = make(), torch.randn(32, 16, generator=g), 2 * torch.randn(32, 8, generator=g)
    first = router(x, logits)
    again = router(x, logits, experts=first.experts)
    assert torch.equal(again.weights, first.weights)
    for f in fields(Routing):
        if getattr(first, f.name) is not None:
            assert torch.equal(getattr(again, f.name), getattr(first, f.name)), f.name
    other = torch.arange(3).expand(32, 3)
    assert torch.equal(router(x, logits, experts=other).experts, other)


@pytest.mark.parametrize("family", ["granite", "olmoe"])
@pytest.mark.parametrize("method", ["tes", "dual"])
def test_gradient_checkpointing_gives_the_same_grads(family, method):
    model = set_router(tiny_model(family), method, "all")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # move every head off its neutral start, so attenuation changes routes
        for name, p in model.named_parameters():
            if ".router." in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    ids = torch.randint(0, 128, (2, 12), generator=g)
    grads = []
    for ckpt in (False, True):
        m = copy.deepcopy(model)
        m.gradient_checkpointing_enable(ckpt)
        out = m(ids)
        ce, mask = token_ce(out.logits, ids)
        loss = ce[mask].mean()
        if method == "tes":
            loss = loss + 1e-1 * supervision_loss(out.routings, ce, mask, "is")
        loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and any(".router." in n for n in grads[0])
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-7, msg=n)


# ---- set_router: scope, spec, parameters -------------------------------------------------------------

@pytest.mark.parametrize("layers,expected", [("final", [2]), ("first:2", [0, 1]), ("last:2", [1, 2]),
                                             ("all", [0, 1, 2]), ([0, 2], [0, 2]), ((2, 0, 2), [0, 2])])
@pytest.mark.parametrize("method", list(POLICY_TYPES))
def test_layer_scope_and_spec_rebuild(layers, expected, method):
    model = set_router(tiny_model(), method, layers)
    spec = model.router_spec
    assert spec["name"] == method and spec["layers"] == expected
    for i, layer in enumerate(model.model.layers):
        assert type(layer.mlp.router) is (POLICY_TYPES[method] if i in expected else NativeRouter)
    # An adapter saver writes the record as JSON; the Method it reads back rebuilds the same structure.
    rebuilt = set_router(tiny_model(seed=1), Method.from_record(json.loads(json.dumps(spec))))
    assert rebuilt.router_spec == spec
    assert {n: p.shape for n, p in rebuilt.named_parameters()} == {n: p.shape for n, p in model.named_parameters()}
    assert ([n for n, p in rebuilt.named_parameters() if p.requires_grad]
            == [n for n, p in model.named_parameters() if p.requires_grad])


def test_supervised_layers_follow_the_scope():
    model = set_router(tiny_model(), "acs", "first:2")
    out = model(torch.randint(0, 128, (1, 8)))
    assert [r.prediction is not None for r in out.routings] == [True, True, False]


def test_parameter_names_and_freezing():
    # The naming contract the trainer's AdamW groups rely on, and who is trainable.
    model = set_router(tiny_model(), "tes", "last:2")
    named = dict(model.named_parameters())
    heads = [n for n in named if ".router." in n]
    assert heads == [f"model.layers.{i}.mlp.router.error_head.{w}" for i in (1, 2) for w in ("weight", "bias")]
    assert all(named[n].requires_grad for n in heads)
    assert not any(named[f"model.layers.{i}.mlp.gate.weight"].requires_grad for i in range(3))

    model = set_router(model, "dual", "final", tune_router=True)
    named = dict(model.named_parameters())
    assert [n for n in named if ".router." in n] == ["model.layers.2.mlp.router.affinity.weight",
                                                     "model.layers.2.mlp.router.affinity.bias"]
    assert torch.equal(named["model.layers.2.mlp.router.affinity.weight"], named["model.layers.2.mlp.gate.weight"])
    assert not named["model.layers.2.mlp.router.affinity.bias"].any()
    assert [named[f"model.layers.{i}.mlp.gate.weight"].requires_grad for i in range(3)] == [False, False, True]

    model = set_router(model, "native", "all", tune_router=True)  # "CE + affinity tuning"
    assert not any(".router." in n for n, _ in model.named_parameters())
    assert all(layer.mlp.gate.weight.requires_grad for layer in model.model.layers)


@pytest.mark.parametrize("kwargs,match", [
    (dict(method="moe"), "unknown method"),
    (dict(method="tes", gamma=-0.1), "gamma"),
    (dict(method="tes", tau=0.0), "tau"),
    (dict(method="tes", tau=-1.0), "tau"),
    (dict(method="tes", transform="log1p"), "transform"),
    (dict(method="dual", mix=1.5), "mix"),
    (dict(method="dual", mix=-0.1), "mix"),
    (dict(method="acs", gamma=1.0), "no such option"),
    (dict(method="tes", layers=[0, 3]), "out of range"),
    (dict(method="tes", layers=[-1]), "out of range"),
    (dict(method="tes", layers="last:4"), "last:4"),
    (dict(method="tes", layers="middle"), "middle"),
    (dict(method="native", tune_router="yes"), "tune_router"),
])
def test_bad_options_raise_clear_errors(kwargs, match):
    model = tiny_model()
    with pytest.raises(ValueError, match=match):
        set_router(model, **kwargs)
    assert type(model.model.layers[2].mlp.router) is NativeRouter  # the model is left as it was


def test_acs_with_one_expert_per_token_supervises_every_experts_concentration():
    """K = 1: C_t over the top-1 alone is 1 with no gradient, so ACS takes every expert as its set: the
    model's C_t is sum_i p_i^2 over all E (softmax here), and its gradient reaches the logits."""
    model = set_router(tiny_model(top_k=1), "acs")
    r = model(torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))).routings[-1]
    p = r.logits.detach().softmax(-1)
    torch.testing.assert_close(r.prediction.detach(), p.pow(2).sum(-1))
    assert r.prediction.requires_grad and (r.prediction < 1 - 1e-3).all()


@pytest.mark.parametrize("name", ["native", "dual", "tes", "acs"])
def test_each_record_says_what_its_policy_does(name):
    """A Method record's claims against its policy on a model: supervised exactly when every layer in scope
    sets Routing.prediction; its heads are exactly the trainable modules under `.mlp.router.`."""
    record = METHODS[name]
    model = set_router(tiny_model(), name, "all")
    out = model(torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0)))
    assert [r.prediction is not None for r in out.routings] == [record.prediction is not None] * len(out.routings)
    trained = {n.split(".mlp.router.")[1].split(".")[0] for n, p in model.named_parameters()
               if ".mlp.router." in n and p.requires_grad}
    assert trained == set(record.heads)
    assert (record.not_exportable is None) == (name in ("native", "acs"))  # the two that route natively



# ---- every family's scorer (routing.Scoring): native as transformers routes, and every method on it ---------

SCORERS = {  # name -> (Scoring, whether the layer has a correction bias)
    "softmax": (Scoring(3), False),  # OLMoE, Qwen (norm_topk_prob false)
    "softmax-norm": (Scoring(3, normalize=True), False),  # Mixtral, Qwen3, OLMoE with norm_topk_prob
    "topk-on-logits": (Scoring(3, normalize=True, on_logits=True), False),  # Granite, gpt-oss
    "group-max": (Scoring(3, method="group_limited_greedy", n_group=4, topk_group=2, scaling=2.5), False),  # DeepSeek-V2
    "sigmoid-noaux": (Scoring(3, normalize=True, func="sigmoid", method="noaux_tc", n_group=4, topk_group=2,
                              scaling=2.5), True),  # DeepSeek-V3
    "sigmoid": (Scoring(3, func="sigmoid"), False),
    "sigmoid-noaux-glm": (Scoring(3, normalize=True, func="sigmoid", method="noaux_tc", n_group=4, topk_group=2,
                                  scaling=2.5), True),  # GLM-4.5 (its own module, V3's rule)
    "sigmoid-top1-on-logits": (Scoring(1, func="sigmoid", on_logits=True), False),  # Llama 4 (scales the input)
    # LFM2-MoE: V3's selection-only bias without groups, its own 1e-6 guard, scaled (transformers 5 only: tf5)
    "sigmoid-bias-lfm2": (Scoring(3, normalize=True, func="sigmoid", method="noaux_tc", scaling=1.5, norm_eps=1e-6),
                          True),
    # MiMo-V2-Flash: transformers 5's DeepSeek-V3 router, whose groups not kept score -inf (4.57's: 0), under a bias
    # that puts every kept expert's corrected score below 0, where the two differ (transformers 5 only: tf5)
    "sigmoid-noaux-inf-mimo": (Scoring(3, normalize=True, func="sigmoid", method="noaux_tc", n_group=2, topk_group=1,
                                       scaling=2.5, groups_inf=True), True),
}
TRANSFORMERS_5_SCORERS = {"sigmoid-bias-lfm2", "sigmoid-noaux-inf-mimo"}  # their oracle is transformers 5.23


def scorer_inputs(name, seed=0, D=16, E=8, T=32):
    g = torch.Generator().manual_seed(seed)
    scoring, has_bias = SCORERS[name]
    gate = torch.nn.Linear(D, E, bias=name == "topk-on-logits")  # gpt-oss's router has a bias
    with torch.no_grad():
        gate.weight.copy_(torch.randn(E, D, generator=g) * 0.5)
        if gate.bias is not None:
            gate.bias.copy_(torch.randn(E, generator=g))
    x = torch.randn(T, D, generator=g)
    if name == "sigmoid-bias-lfm2":  # scores far below 1/2 (logits near -8), where LFM2's 1e-6 guard shows
        x[:, 0] = 1.0
        with torch.no_grad():
            gate.weight[:, 0] = -8.0
    correction = torch.randn(E, generator=g) * 0.3 if has_bias else None
    if name == "sigmoid-noaux-inf-mimo":
        correction = correction - 1.0  # every corrected score below 0: a 0 fill would pick the dropped groups' experts
    return scoring, gate, x, gate(x).detach().float(), correction


def sorted_by_expert(experts, weights):
    order = experts.argsort(-1)
    return experts.gather(-1, order), weights.gather(-1, order)


def transformers_routing(name, gate, x, correction):
    """The same router as transformers 4.57 computes it (its own modules where it has one), the oracle."""
    scoring, _ = SCORERS[name]
    E, D = gate.weight.shape
    if name in ("group-max", "sigmoid-noaux", "topk-on-logits", "sigmoid-noaux-glm", "sigmoid-top1-on-logits"):
        # transformers' own modules: skip without the extra
        pytest.importorskip("transformers")
    if name == "group-max":
        from transformers import DeepseekV2Config
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2MoEGate
        ref = DeepseekV2MoEGate(DeepseekV2Config(n_routed_experts=E, hidden_size=D, num_experts_per_tok=3,
                                                 topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                                 routed_scaling_factor=2.5))
        ref.weight.data.copy_(gate.weight)
        return ref(x[None])
    if name == "sigmoid-noaux":
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
        ref = DeepseekV3TopkRouter(DeepseekV3Config(n_routed_experts=E, hidden_size=D, num_experts_per_tok=3,
                                                    n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                                    norm_topk_prob=True))
        ref.weight.data.copy_(gate.weight)
        ref.e_score_correction_bias.copy_(correction)
        return ref(x)
    if name == "sigmoid-noaux-glm":
        from transformers import Glm4MoeConfig
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
        ref = Glm4MoeTopkRouter(Glm4MoeConfig(n_routed_experts=E, hidden_size=D, num_experts_per_tok=3, n_group=4,
                                              topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True))
        ref.weight.data.copy_(gate.weight)
        ref.e_score_correction_bias.copy_(correction)
        return ref(x)
    if name == "sigmoid-bias-lfm2":
        from transformers import Lfm2MoeConfig
        from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeTopKRouter
        ref = Lfm2MoeTopKRouter(Lfm2MoeConfig(num_experts=E, hidden_size=D, num_experts_per_tok=3,
                                              routed_scaling_factor=1.5, norm_topk_prob=True))
        ref.weight.data.copy_(gate.weight)
        _, weights, experts = ref(x, correction)
        return experts, weights
    if name == "sigmoid-noaux-inf-mimo":
        from transformers import MiMoV2FlashConfig
        from transformers.models.mimo_v2_flash.modeling_mimo_v2_flash import MiMoV2FlashTopkRouter
        ref = MiMoV2FlashTopkRouter(MiMoV2FlashConfig(n_routed_experts=E, hidden_size=D, num_experts_per_tok=3,
                                                      n_group=2, topk_group=1, routed_scaling_factor=2.5))
        ref.weight.data.copy_(gate.weight)
        ref.e_score_correction_bias.copy_(correction)
        _, weights, experts = ref(x)
        return experts, weights
    if name == "sigmoid-top1-on-logits":
        from transformers import Llama4TextConfig
        from transformers.models.llama4.modeling_llama4 import Llama4Router
        ref = Llama4Router(Llama4TextConfig(num_local_experts=E, hidden_size=D, num_experts_per_tok=1))
        ref.weight.data.copy_(gate.weight)
        scores, logits = ref(x)  # [T, E]: the sigmoid of the top-1 logit, 0 elsewhere
        experts = logits.topk(1, dim=-1).indices
        return experts, scores.gather(-1, experts)
    if name == "topk-on-logits":
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
        ref = GptOssTopKRouter(GptOssConfig(num_local_experts=E, hidden_size=D, num_experts_per_tok=3))
        ref.weight.data.copy_(gate.weight)
        ref.bias.data.copy_(gate.bias)
        scores, experts = ref(x)
        return experts, scores.gather(-1, experts)
    # Mixtral's and Qwen's blocks inline it: softmax over all, top-K, renormalise when norm_topk_prob.
    logits = gate(x)
    if name == "sigmoid":
        w, e = logits.sigmoid().topk(3, -1)
        return e, w
    w, e = F.softmax(logits, dim=1, dtype=torch.float).topk(3, dim=-1)
    return e, (w / w.sum(-1, keepdim=True) if scoring.normalize else w)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.tf5) if n in TRANSFORMERS_5_SCORERS else n
                                  for n in SCORERS])
def test_each_scorer_routes_as_transformers_does(name):
    scoring, gate, x, logits, correction = scorer_inputs(name)
    r = NativeRouter(scoring)(x, logits, correction=correction)
    experts, weights = r.experts, r.weights
    ref_experts, ref_weights = transformers_routing(name, gate, x, correction)
    ours, theirs = sorted_by_expert(experts, weights), sorted_by_expert(ref_experts, ref_weights.float())
    assert torch.equal(ours[0], theirs[0])
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["group-max", "sigmoid-noaux", "sigmoid-noaux-inf-mimo"])
def test_group_limited_selection_stays_in_the_kept_groups(name):
    # Every executed expert lies in one of topk_group groups, however the scores fall; noaux_tc's
    # correction bias moves the selection and never the weights (sigmoid of the logits, renormalised).
    scoring, _, x, logits, correction = scorer_inputs(name)
    experts, weights = scoring.select(logits, correction=correction)
    groups = experts // (8 // scoring.n_group)
    assert all(len(set(row.tolist())) <= scoring.topk_group for row in groups)
    if correction is not None:
        plain, _ = scoring.select(logits)
        assert not torch.equal(plain.sort(-1).values, experts.sort(-1).values)
        s = logits.sigmoid().gather(-1, experts)
        torch.testing.assert_close(weights, 2.5 * s / s.sum(-1, keepdim=True))


def scorer_policy(method, scoring, gate, **options):
    if method == "native":
        return NativeRouter(scoring)
    if method == "acs":
        return ConcentrationRouter(scoring)
    if method == "dual":
        return DualAffinityRouter(gate, scoring, mix=options.get("mix", 0.5))
    E, D = gate.weight.shape
    return TokenErrorRouter(D, E, scoring, options.get("gamma", 1.0), options.get("tau", 1.0),
                            options.get("transform", "started-log"))


@pytest.mark.parametrize("name", list(SCORERS))
@pytest.mark.parametrize("method,options", [("acs", {}), ("dual", {}), ("dual", {"mix": 1.0}), ("tes", {}),
                                            ("tes", {"transform": "log", "gamma": 3.0})])
def test_every_method_starts_native_on_every_scorer(name, method, options):
    # At initialisation each method executes the family's native experts with its native weights: bit for
    # bit where the scores cannot round (ACS, Dual, and TES on sigmoid scoring, where phi - min phi = 0);
    # TES on softmax subtracts one constant per token, which softmax ignores up to the rounding of a - c.
    scoring, gate, x, logits, correction = scorer_inputs(name)
    native = NativeRouter(scoring)(x, logits, correction=correction)
    r = scorer_policy(method, scoring, gate, **options)(x, logits, correction=correction)
    assert torch.equal(r.experts, native.experts)
    if method == "tes" and scoring.func == "softmax":
        torch.testing.assert_close(r.weights, native.weights, rtol=1e-6, atol=1e-7)
    else:
        assert torch.equal(r.weights, native.weights)


@pytest.mark.parametrize("name", list(SCORERS))
def test_identities_hold_on_every_scorer(name):
    scoring, gate, x, logits, correction = scorer_inputs(name)
    native = NativeRouter(scoring)(x, logits, correction=correction)
    # ACS: C_t = sum of the squared shares of the native K, shares = the family's weights renormalised
    # (softmax p or sigmoid s), so 1/K <= C_t <= 1 (Eq. affinity_concentration). With K = 1 (Llama 4) the
    # set is every expert (docs/methods.md): 1/E <= C_t <= 1.
    a = logits.clone().requires_grad_(True)
    c = ConcentrationRouter(scoring)(x, a, correction=correction).prediction
    S = native.experts if scoring.top_k > 1 else torch.arange(a.shape[-1]).expand(a.shape)
    s = (a.detach().softmax(-1) if scoring.func == "softmax" else a.detach().sigmoid()).gather(-1, S)
    pbar = s / s.sum(-1, keepdim=True)
    torch.testing.assert_close(c.detach(), pbar.pow(2).sum(-1))
    assert (c >= 1 / S.shape[-1] - 1e-6).all() and (c <= 1 + 1e-6).all() and (c < 1 - 1e-3).any()
    c.sum().backward()  # only the set's logits move C_t; for softmax dC/da_i = 2 pbar_i (pbar_i - C_t)
    unselected = torch.ones_like(a, dtype=torch.bool).scatter(-1, S, False)
    if scoring.func == "softmax":
        expected = torch.zeros_like(a).scatter(-1, S, 2 * pbar * (pbar - c.detach()[:, None]))
        torch.testing.assert_close(a.grad, expected, rtol=1e-5, atol=1e-6)
    else:  # sigmoid scores are per expert: an unselected logit does not enter C_t at all
        assert (a.grad[unselected] == 0).all() and (a.grad[~unselected] != 0).any()
    # TES: gamma = 0 is native whatever the head says; e_hat weighs the executed experts' scores by the
    # family's shares of the native logits; scaling every error by one factor under the pure log is a
    # per-token shift that changes no route (softmax ignores it; sigmoid's phi - min phi removes it).
    router, _, _ = tes_router(False, gamma=0.0)
    router.scoring = scoring
    r = router(x, logits, correction=correction)
    assert torch.equal(r.experts, native.experts) and torch.equal(r.weights, native.weights)
    router.gamma, router.transform = 2.0, "log"
    r = router(x, logits, correction=correction)
    shares = scoring.shares(logits, r.experts)
    torch.testing.assert_close(r.prediction, (shares * r.expert_scores.gather(-1, r.experts)).sum(-1))
    shifted = attenuate(logits, 5.0 * r.expert_scores.detach(), 2.0, 1.0, "log", relative=scoring.func == "sigmoid")
    same = scoring.select(shifted, correction=correction)
    assert torch.equal(same[0], scoring.select(r.routing_logits.detach(), correction=correction)[0])
    # Dual: mix 1 routes on the copy's logits alone through the family's scoring.
    dual = DualAffinityRouter(gate, scoring, mix=1.0)
    with torch.no_grad():
        dual.affinity.weight.mul_(-1.0)
    copy = F.linear(x, dual.affinity.weight, dual.affinity.bias if gate.bias is not None else None).float()
    copy = copy if gate.bias is not None else copy + dual.affinity.bias
    assert torch.equal(dual(x, logits, correction=correction).experts, scoring.select(copy, correction=correction)[0])


@pytest.mark.parametrize("name", list(SCORERS))
@pytest.mark.parametrize("method", ["native", "acs", "dual", "tes"])
def test_every_policy_replays_on_every_scorer(name, method):
    scoring, gate, x, logits, correction = scorer_inputs(name)
    router = scorer_policy(method, scoring, gate, gamma=2.0)
    if method == "tes":
        with torch.no_grad():
            router.error_head.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(3))
    first = router(x, logits, correction=correction)
    again = router(x, logits, experts=first.experts, correction=correction)
    for f in fields(Routing):
        if getattr(first, f.name) is not None:
            assert torch.equal(getattr(again, f.name), getattr(first, f.name)), f.name


def test_layer_scope_counts_moe_layers_only():
    # 'final' is the final MoE layer and 'all' every MoE layer; a dense layer is never routed.
    sparse = [1, 3, 4]
    assert resolve_layers("final", sparse) == [4] and resolve_layers("all", sparse) == sparse
    assert resolve_layers("first:2", sparse) == [1, 3] and resolve_layers("last:1", sparse) == [4]
    assert resolve_layers([3], sparse) == [3]
    with pytest.raises(ValueError, match=r"layer index 2 .*MoE layers are \[1, 3, 4\]"):
        resolve_layers([2], sparse)
    assert resolve_layers("all", 3) == [0, 1, 2]
