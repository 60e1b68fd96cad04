"""ESFT (minimoe/core/routing_methods/esft.py): the expert choice against a direct computation, the usage sums against a
per-token loop on every family's router, and what trains."""
import pytest
import torch

from minimoe.core.routing_methods import esft
from minimoe.core.adaptation.lora import add_lora
from minimoe.core.routing_methods.methods import set_router
from minimoe.making.tiny import FAMILY_SWITCHES
from tests.conftest import tiny_model


def direct_choice(score: list[float], p: float) -> set[int]:
    """The fewest experts, most used first, whose shares sum to at least p (ties: lower index first)."""
    share = [s / sum(score) for s in score]
    order = sorted(range(len(share)), key=lambda e: (-share[e], e))
    for k in range(1, len(order) + 1):
        if sum(share[e] for e in order[:k]) >= p:
            return set(order[:k])


@pytest.mark.parametrize("p", [0.1, 0.25, 0.5, 0.75, 0.8, 1.0])
def test_the_choice_is_the_fewest_experts_reaching_p_by_the_criterion(p):
    # gate sums and selection counts ranked differently, shares dyadic (exact in floats): 0.5 reached exactly
    gate = torch.tensor([4.0, 2.0, 1.0, 1.0], dtype=torch.float64)  # shares 1/2, 1/4, 1/8, 1/8
    count = torch.tensor([1.0, 1.0, 2.0, 4.0], dtype=torch.float64)  # shares 1/8, 1/8, 1/4, 1/2
    sums = torch.stack([gate, count])
    for criterion, score in (("gate", gate), ("token", count)):
        chosen = esft.select(sums, criterion, p)
        assert set(torch.nonzero(chosen).flatten().tolist()) == direct_choice(score.tolist(), p), (criterion, p)


def test_usage_sums_the_combine_weights_and_selections_of_real_tokens(family_or_deepseek):
    model = tiny_model(family_or_deepseek)
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0  # padding: not counted
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
    got = esft.usage(out.routings, mask)
    for i, r in enumerate(out.routings):
        if r is None:
            assert i not in got
            continue
        E = r.logits.shape[-1]
        gate, count = [0.0] * E, [0.0] * E
        for t, real in enumerate(mask.flatten().tolist()):
            for k in range(r.experts.shape[-1]):
                if real:
                    gate[r.experts[t, k]] += r.weights[t, k].item()
                    count[r.experts[t, k]] += 1
        torch.testing.assert_close(got[i], torch.tensor([gate, count], dtype=torch.float64))


@pytest.fixture(params=list(FAMILY_SWITCHES))
def family_or_deepseek(request):
    return request.param


def test_only_the_chosen_experts_lora_trains(family_or_deepseek):
    model = tiny_model(family_or_deepseek).train()
    add_lora(model, targets=["q", "experts"], dropout=0.0)
    set_router(model, "esft", layers="all")
    esft.restrict(model)
    layers = esft.esft_layers(model)
    assert layers  # every family's MoE layers take ESFT
    for i, mlp in layers.items():
        mlp.router.chosen.copy_(torch.tensor([i % 2 == 0, True, False, False, True, False, False, False]))
        with torch.no_grad():  # B off zero, so that A gets gradient too
            for bank in esft.banks(mlp.experts):
                getattr(mlp.experts, bank).lora_B.normal_()
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))  # not the global RNG: order-proof
    model(ids).logits.square().mean().backward()
    for name, p in model.named_parameters():
        if ".lora_" in name and "experts" not in name:
            assert not p.requires_grad, name
        elif ".lora_" in name and int(name.split(".")[2]) not in layers:  # a hash-routed layer's: out of scope
            assert not p.requires_grad, name
        elif ".lora_" in name:
            chosen = layers[int(name.split(".")[2])].router.chosen
            assert p.grad[~chosen].abs().max() == 0 and p.grad[chosen].abs().max() > 0, name
        else:
            assert not p.requires_grad, name  # gates and base


def test_the_full_form_trains_the_chosen_rows_and_nothing_else():
    """--esft-form full: the only trainable parameters are the chosen experts' rows [k, out, in] per bank;
    after AdamW steps every other tensor of the model (the other experts' rows, attention, gates, LoRA) is
    bit-identical, the rows have moved, and the forward equals a plain model with those rows in its banks."""
    model = tiny_model("olmoe").train()
    add_lora(model, targets=["q", "experts"], dropout=0.0)
    set_router(model, "esft", layers="all", esft_form="full")
    esft.restrict(model)
    layers = esft.esft_layers(model)
    for i, mlp in layers.items():
        mlp.router.chosen.copy_(torch.tensor([i % 2 == 0, True, False, False, True, False, False, False]))
        mlp.router.take_rows(mlp)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert all(".mlp.router.rows." in n for n in trainable)
    assert {n: tuple(p.shape) for n, p in trainable.items()} == {
        f"model.layers.{i}.mlp.router.rows.{bank}": (int(mlp.router.chosen.sum()),
                                                     *getattr(mlp.experts, bank).weight.shape[1:])
        for i, mlp in layers.items() for bank in esft.banks(mlp.experts)}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(trainable.values(), lr=1e-2)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model(ids).logits.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    after = model.state_dict()
    for k, v in before.items():
        assert torch.equal(after[k], v) != (".mlp.router.rows." in k), k
    plain = tiny_model("olmoe").eval()  # the same base, the trained rows written into its banks
    with torch.no_grad():
        for i, mlp in layers.items():
            for bank, weight in mlp.router.merged_banks(mlp).items():
                getattr(plain.model.layers[i].mlp.experts, bank).weight.copy_(weight)
    torch.testing.assert_close(model.eval()(ids).logits, plain(ids).logits)
