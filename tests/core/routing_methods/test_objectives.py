"""Tests for minimoe.core.routing_methods.objectives: each test names the paper equation or bad input it checks."""

import pytest
import torch
import torch.nn.functional as F

from minimoe.core.routing_methods.methods import set_router
from minimoe.core.decoder.model import MoEConfig, MoEForCausalLM, init_weights
from minimoe.core.routing_methods.objectives import exponential_nll, itakura_saito, supervision_loss
from minimoe.core.routing_methods.routing import Routing


def tiny_model(seed=0):
    torch.manual_seed(seed)
    config = MoEConfig(model_type="olmoe", vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2)
    return init_weights(MoEForCausalLM(config), std=0.2)


def token_ce(logits, ids):
    """ce[b, t] = CE(logits[b, t], ids[b, t + 1]) for t < T - 1, attached; the last column is 0."""
    B, T, V = logits.shape
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1), reduction="none")
    return torch.cat([ce.view(B, T - 1), ce.new_zeros(B, 1)], dim=1)


# ---- per-token losses ----------------------------------------------------------------------------

def test_losses_match_their_equations():
    # Eq. token_is_loss and token_enll_loss written out.
    pred, obs = torch.tensor([0.5, 1.0, 3.0]), torch.tensor([2.0, 1.0, 0.1])
    torch.testing.assert_close(itakura_saito(pred, obs), obs / pred - torch.log(obs / pred) - 1)
    torch.testing.assert_close(exponential_nll(pred, obs), obs / pred + torch.log(pred))
    assert itakura_saito(pred, obs)[1] == 0  # zero at the match


@pytest.mark.parametrize("loss", [itakura_saito, exponential_nll])
def test_direct_gradient_wrt_prediction(loss):
    # Eq. appendix_is_direct_gradient / appendix_enll_direct_gradient: dL/de = (e - L)/e^2.
    pred = torch.tensor([0.2, 0.9, 1.0, 4.0, 7.5], dtype=torch.float64, requires_grad=True)
    obs = torch.tensor([1.0, 0.9, 2.5, 0.3, 7.0], dtype=torch.float64)
    loss(pred, obs).sum().backward()
    torch.testing.assert_close(pred.grad, ((pred - obs) / pred**2).detach())


@pytest.mark.parametrize("loss", [itakura_saito, exponential_nll])
def test_observed_loss_gradient(loss):
    # Eq. appendix_is_token_loss_gradient (1/e - 1/L) and appendix_enll_token_loss_gradient (1/e).
    pred, obs = torch.tensor([0.5, 2.0, 3.0]), torch.tensor([1.0, 0.7, 3.0], requires_grad=True)
    loss(pred, obs).sum().backward()
    expected = 1 / pred - (1 / obs.detach() if loss is itakura_saito else 0)
    torch.testing.assert_close(obs.grad, expected)


def test_is_floor():
    # Eq. token_is_loss: L+ = max(L, eps); below the floor no gradient goes through the observed CE,
    # and the value and prediction gradient use eps (app. attached_token_loss_gradients).
    eps = 1e-3
    obs = torch.tensor([0.0, 1e-5, 0.5], requires_grad=True)
    pred = torch.tensor([0.1, 0.1, 0.1], requires_grad=True)
    value = itakura_saito(pred, obs, eps)
    floored = torch.tensor([eps, eps, 0.5])
    torch.testing.assert_close(value.detach(), floored / 0.1 - torch.log(floored / 0.1) - 1)
    value.sum().backward()
    assert obs.grad[0] == 0 and obs.grad[1] == 0 and obs.grad[2] != 0
    torch.testing.assert_close(pred.grad, (0.1 - floored) / 0.1**2)


@pytest.mark.parametrize("loss", ["is", "enll"])
def test_scalar_optimum_is_the_mean_observation(loss):
    # Eq. appendix_token_family_optima: argmin_e mean_c L(e, L_c) = mean L_c (IS: the floored mean).
    eps = 0.05
    obs = torch.tensor([0.0, 0.01, 0.4, 1.3, 2.0, 5.5], dtype=torch.float64)
    grid = torch.linspace(0.01, 6.0, 600_001, dtype=torch.float64)  # step 1e-5
    if loss == "is":
        values, target = itakura_saito(grid[:, None], obs, eps).mean(1), obs.clamp_min(eps).mean()
    else:
        values, target = exponential_nll(grid[:, None], obs).mean(1), obs.mean()
    assert abs(grid[values.argmin()] - target) <= 1e-5
    # and the derivative vanishes there (Eq. appendix_token_family_is_gradient / enll_gradient)
    e = target.clone().requires_grad_()
    (itakura_saito(e, obs, eps) if loss == "is" else exponential_nll(e, obs)).mean().backward()
    assert abs(e.grad) < 1e-12


# ---- attached token loss through a real model (Eq. appendix_matched_token_loss_gradients) -------

def test_matched_prediction_gradients_through_the_attached_ce():
    # At e_hat = L (equal values, e_hat held fixed): grad of lambda*IS through the CE path is 0,
    # grad of ENLL is (1/L) grad L, for every model parameter.
    model = tiny_model()
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    ce = token_ce(model(ids).logits, ids)[:, :-1]  # [B, T-1], attached
    params = [p for p in model.parameters() if p.requires_grad]
    pred = ce.detach().clone()  # matched prediction, no parameters behind it
    lam = 1e-3
    is_grads = torch.autograd.grad(lam * itakura_saito(pred, ce).sum(), params, retain_graph=True, allow_unused=True)
    assert all(g is None or not g.any() for g in is_grads)
    t = (1, 3)  # one supervised token, so that the identity is per token
    enll = torch.autograd.grad(exponential_nll(pred[t], ce[t]), params, retain_graph=True, allow_unused=True)
    ce_grad = torch.autograd.grad(ce[t], params, allow_unused=True)
    for g, gc in zip(enll, ce_grad):
        if gc is None:
            assert g is None
        else:  # the two chain-rule orders round differently in fp32: compare to the tensor's scale
            expected = gc / ce[t].detach()
            assert (g - expected).abs().max() <= 1e-5 * expected.abs().max()


# ---- supervision_loss (Eq. averaged_training_losses) --------------------------------------------

def fake_routings(B, T, supervised, seed=0):
    g = torch.Generator().manual_seed(seed)
    routings = []
    for s in supervised:
        prediction = torch.rand(B * T, generator=g) * 3 + 0.1 if s else None
        routings.append(Routing(logits=torch.zeros(B * T, 4), experts=torch.zeros(B * T, 2, dtype=torch.long),
                                weights=torch.zeros(B * T, 2), prediction=prediction))
    return routings


@pytest.mark.parametrize("objective", ["is", "enll"])
@pytest.mark.parametrize("depth_scaled", [False, True])
def test_supervision_loss_averages_supervised_layers_and_tokens(objective, depth_scaled):
    B, T = 3, 5
    routings = fake_routings(B, T, [True, False, True, True])
    g = torch.Generator().manual_seed(1)
    ce = torch.rand(B, T, generator=g) * 4
    mask = torch.rand(B, T, generator=g) > 0.4
    per_token = itakura_saito if objective == "is" else exponential_nll
    total, n_layers = 0.0, 0
    for r in routings:  # the hand loop: sum over l in M and t in B_tok, divided by |M| |B_tok|
        if r.prediction is None:
            continue
        n_layers += 1
        for b in range(B):
            for t in range(T):
                if mask[b, t]:
                    total += per_token(r.prediction[b * T + t], ce[b, t]).item()
    expected = total / (n_layers * mask.sum().item()) * (n_layers if depth_scaled else 1)
    got = supervision_loss(routings, ce, mask, objective, depth_scaled=depth_scaled)
    assert got.dim() == 0 and abs(got.item() - expected) < 1e-5


@pytest.mark.parametrize("objective", ["is", "enll"])
def test_supervision_loss_keeps_the_observed_ce_attached(objective):
    # The gradient that training sends through the observed CE, via supervision_loss itself: per supervised
    # token and layer, d/dL of IS = 1/e - 1/L (L above the floor; Eq. appendix_is_token_loss_gradient) and
    # of ENLL = 1/e (Eq. appendix_enll_token_loss_gradient), over |M| |B_tok|; zero off the mask.
    B, T = 3, 5
    routings = fake_routings(B, T, [True, False, True])
    g = torch.Generator().manual_seed(3)
    ce = (torch.rand(B, T, generator=g) * 4 + 0.05).requires_grad_()
    mask = torch.rand(B, T, generator=g) > 0.3
    supervision_loss(routings, ce, mask, objective).backward()
    preds = [r.prediction.view(B, T) for r in routings if r.prediction is not None]
    L = ce.detach()
    per_layer = [1 / e - 1 / L if objective == "is" else 1 / e for e in preds]
    expected = torch.where(mask, sum(per_layer) / (len(preds) * mask.sum()), torch.zeros(()))
    torch.testing.assert_close(ce.grad, expected)


def test_supervision_loss_trains_the_error_head_end_to_end():
    model = set_router(tiny_model(), "tes", "last:2")
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    out = model(ids)
    ce = token_ce(out.logits, ids)
    mask = torch.ones_like(ce, dtype=torch.bool)
    mask[:, -1] = False
    supervision_loss(out.routings, ce, mask, "enll").backward()
    heads = {n: p.grad for n, p in model.named_parameters() if ".router.error_head." in n}
    assert len(heads) == 4 and all(g is not None and g.any() for g in heads.values())
    assert model.model.layers[0].mlp.gate.weight.grad is None  # frozen


@pytest.mark.parametrize("routings,mask,objective,match", [
    (fake_routings(2, 3, [False, False]), torch.ones(2, 3, dtype=torch.bool), "is", "no layer is supervised"),
    (fake_routings(2, 3, [True]), torch.zeros(2, 3, dtype=torch.bool), "is", "no token"),
    (fake_routings(2, 3, [True]), torch.ones(2, 3, dtype=torch.bool), "mse", "unknown objective"),
    (fake_routings(2, 3, [True]), torch.ones(3, 2, dtype=torch.bool), "is", "differ"),
    (fake_routings(3, 3, [True]), torch.ones(2, 3, dtype=torch.bool), "is", "B\\*T"),
])
def test_supervision_loss_bad_inputs(routings, mask, objective, match):
    with pytest.raises(ValueError, match=match):
        supervision_loss(routings, torch.ones(2, 3), mask, objective)
