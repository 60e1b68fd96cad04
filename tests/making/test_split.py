"""minimoe.making.split: splitting a dense Llama's MLP neurons into distinct experts with a fitted router.

References: transformers' LlamaForCausalLM (the dense model the split must equal when K = E with a
zero router) and GraniteMoeForCausalLM (which must load the written checkpoint with our logits);
a synthetic MLP whose neuron groups fire on known input directions (the routing the fit must find);
and, for each documented step (the shared set, the router's fit and its per-token logit scale, the
output scale, the repair, the assignment, the layer inputs), a recomputation in the test itself with
plain torch, neuron by neuron or token by token (float64 least squares where the step is one).
"""
import json

import pytest
import torch

import minimoe
from minimoe.making.split import SplitError, SplitSettings, neuron_activations, split_layer
from minimoe.making.upcycle import upcycle

transformers = pytest.importorskip("transformers")

E, K, SHARED, I = 4, 2, 16, 96  # (I - SHARED) / E = 20 neurons in each expert's own group
FAST = {"fit_tokens": 512, "seq_len": 64}  # a few rows of fitting text: the tests check structure, not quality


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """A tiny random Llama written by transformers, with a byte-level BPE (folder, model)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    folder = tmp_path_factory.mktemp("dense")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog."] * 3, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    cfg = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=I,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=True,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # weights large enough that a misplaced neuron shows in the logits
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() == 2 else 0.1) + (1.0 if p.dim() == 1 else 0.0))
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    return folder, model


def ids(vocab):
    return torch.randint(1, vocab, (2, 24), generator=torch.Generator().manual_seed(7))


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def split(dense, out, top_k=K, seed=0, **options):
    upcycle(dense[0], out, mode="split", num_experts=E, top_k=top_k, seed=seed, split={"shared": SHARED,
                                                                                       **FAST, **options})
    return minimoe.from_pretrained(out)


def test_all_experts_with_a_zero_router_equal_the_dense_model(dense, tmp_path):
    """K = E, zero router (weights 1/E), output scale E, no repair: the groups sum back to the dense MLP."""
    moe = split(dense, tmp_path / "moe", top_k=E, router_std=0.0, repair=False)
    assert moe.config.num_experts == E and moe.config.intermediate_size == SHARED + (I - SHARED) // E
    assert moe.get_parameter("model.layers.1.mlp.gate.weight").abs().sum() == 0
    x = ids(moe.config.vocab_size)
    with torch.no_grad():
        assert rel(moe(x).logits, dense[1](x).logits) < 2e-5


def test_repair_recovers_the_dense_model_when_it_can(dense, tmp_path):
    """K = E and a zero router: the dense down projection is an exact solution of the repair's least
    squares (no ridge), so the repaired model is the dense one again; a misplaced column would not be."""
    moe = split(dense, tmp_path / "moe", top_k=E, router_std=0.0, repair=True, ridge=0.0)
    x = ids(moe.config.vocab_size)
    with torch.no_grad():
        assert rel(moe(x).logits, dense[1](x).logits) < 1e-4


def expert_neurons(moe, dense_model, layer):
    """Which dense neuron each expert row is: [E, M] indices, matched on the gate rows."""
    gate = dense_model.model.layers[layer].mlp.gate_proj.weight  # [I, D]
    bank = moe.get_parameter(f"model.layers.{layer}.mlp.experts.gate_up_proj.weight")  # [E, 2M, D]
    M = bank.shape[1] // 2
    match = torch.cdist(bank[:, :M].reshape(-1, gate.shape[1]), gate).argmin(1).view(E, M)
    assert torch.equal(bank[:, :M], gate[match]) and torch.equal(  # gate and up rows moved together
        bank[:, M:], dense_model.model.layers[layer].mlp.up_proj.weight[match])
    return match


def test_groups_are_balanced_disjoint_and_deterministic(dense, tmp_path):
    a, b = split(dense, tmp_path / "a"), split(dense, tmp_path / "b")
    c = split(dense, tmp_path / "c", seed=1)
    for layer in range(2):
        na, nb, nc = (expert_neurons(m, dense[1], layer) for m in (a, b, c))
        shared, own = na[:, :SHARED], na[:, SHARED:]
        assert (shared == shared[0]).all()  # the same shared neurons in every expert
        assert sorted(torch.cat([shared[0], own.flatten()]).tolist()) == list(range(I))  # a partition
        assert torch.equal(na, nb) and not torch.equal(na, nc)  # the seed decides, and only the seed
    for name, p in a.named_parameters():
        assert torch.equal(p, b.get_parameter(name)), name


@pytest.mark.parametrize("repair", [False, True])
def test_shared_neurons_pass_unscaled(dense, tmp_path, repair):
    """With every expert's own columns zeroed, the MoE MLP is the shared neurons' dense output, whatever
    the router picks: Granite's renormalised weights sum to 1 over copies of the same columns."""
    moe = split(dense, tmp_path / "moe", repair=repair, router_std=1.0)  # weights far from uniform
    mlp, ref = moe.model.layers[0].mlp, dense[1].model.layers[0].mlp
    shared = expert_neurons(moe, dense[1], 0)[0, :SHARED]
    down = mlp.experts.down_proj.weight  # [E, D, M]
    assert all(torch.equal(down[0, :, :SHARED], down[e, :, :SHARED]) for e in range(E))  # tied
    if not repair:
        assert torch.equal(down[0, :, :SHARED], ref.down_proj.weight[:, shared])
    with torch.no_grad():
        down[:, :, SHARED:] = 0
        x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(1))
        a = torch.nn.functional.silu(ref.gate_proj(x)) * ref.up_proj(x)
        expected = a[..., shared] @ down[0, :, :SHARED].T
        out, routing = mlp(x)
        assert routing.weights.min() < 0.45  # the weights are not uniform: the pass-through is exact anyway
        assert rel(out, expected) < 1e-6


def test_transformers_granitemoe_loads_the_split_with_our_logits(dense, tmp_path):
    moe = split(dense, tmp_path / "moe")
    ref = transformers.GraniteMoeForCausalLM.from_pretrained(tmp_path / "moe", dtype=torch.float32).eval()
    x = ids(moe.config.vocab_size)
    with torch.no_grad():
        ours, theirs = moe(x).logits, ref(x).logits
        assert rel(ours, theirs) < 2e-5
        assert rel(ours, dense[1](x).logits) > 1e-3  # not the dense model: the split is real
    record = json.loads((tmp_path / "moe" / "split.json").read_text())
    assert record["settings"]["num_experts"] == E and len(record["layers"]) == 2
    assert set(record["layers"][0]) >= {"recall_at_k", "rel_error_split", "rel_error_repaired"}
    assert all(len(sha) == 64 for sha in record["fitting_files"].values())


def planted_mlp(D=32, groups=8, width=8, seed=0):
    """An MLP whose neuron group e fires only on input direction u_e: gate rows 3 u_e, random up and down."""
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(D, D, generator=g))[0][:, :groups].T  # [groups, D] orthonormal
    gate = (3 * u).repeat_interleave(width, dim=0) + 0.05 * torch.randn(groups * width, D, generator=g)
    perm = torch.randperm(groups * width, generator=g)  # planted groups are not contiguous
    up = torch.randn(groups * width, D, generator=g) / D ** 0.5
    down = torch.randn(D, groups * width, generator=g) / (groups * width) ** 0.5
    truth = torch.arange(groups).repeat_interleave(width)[perm]  # neuron -> planted group
    return torch.cat([gate[perm], up[perm]]), down[:, perm], u, truth


def test_router_fit_recovers_a_planted_routing():
    groups, k, T = 8, 2, 4096
    gate_up, down, u, truth = planted_mlp(groups=groups)
    g = torch.Generator().manual_seed(1)
    active = torch.rand(T, groups, generator=g).argsort(1)[:, :k]  # each token carries K directions
    strength = 1 + torch.rand(T, k, generator=g)
    x = (strength[..., None] * u[active]).sum(1) + 0.3 * torch.randn(T, u.shape[1], generator=g)
    s = SplitSettings(num_experts=groups, top_k=k, shared=0, repair=False)
    bank, _, router, stats = split_layer(gate_up, down, x, s, torch.Generator().manual_seed(0))
    # each found expert is one planted group: its neurons (gate rows) all carry one planted label
    gate = gate_up[:gate_up.shape[0] // 2]
    found = torch.cdist(bank[:, :bank.shape[1] // 2].reshape(-1, gate.shape[1]), gate).argmin(1).view(groups, -1)
    labels = truth[found]  # [E, G]
    assert (labels == labels[:, :1]).all() and sorted(labels[:, 0].tolist()) == list(range(groups))
    assert stats["recall_at_k"] >= 0.9  # against the oracle's top-K output norms
    picked = labels[:, 0][(x @ router.T).topk(k, dim=1).indices]  # planted group of each chosen expert
    planted = (picked[:, :, None] == active[:, None, :]).any(2).float().mean().item()
    assert planted >= 0.9, planted


@pytest.mark.parametrize("options,match", [
    ({"shared": 15}, "do not divide into 4 equal groups"),
    ({"shared": I}, "shared 96 must be in"),
    ({"router_std": -1.0}, "router_std -1.0"),
    ({"fit_tokens": 10}, "less than one row"),
])
def test_bad_split_settings_raise(dense, tmp_path, options, match):
    with pytest.raises(SplitError, match=match):
        upcycle(dense[0], tmp_path / "moe", mode="split", num_experts=E, top_k=K,
                split={"shared": SHARED, **FAST, **options})
    assert not (tmp_path / "moe").exists()


def test_activations_are_swiglu():
    gate_up, x = torch.randn(6, 4), torch.randn(3, 4)
    assert torch.allclose(neuron_activations(gate_up, x),
                          torch.nn.functional.silu(x @ gate_up[:3].T) * (x @ gate_up[3:].T))


# ---------------------------------------------------------------------------------------------------
# Each documented step of minimoe/making/split.py against a computation of its own in the test: plain torch,
# neuron by neuron or token by token, not split.py's functions. The layer is random; every test first
# checks that its data tells the documented choice from the plausible wrong ones (otherwise it could
# not fail), then checks split_layer's output.

LN, LE, LG, LK = 8, 4, 6, 2  # shared neurons, experts, neurons per group, experts per token
LI, LD, LT = LN + LE * LG, 32, 1024  # neurons, hidden size, tokens


def random_layer(seed=0):
    """gate_up [2I, D], down [D, I] with column norms spread over 0.2-2 (so that importance is not
    mean |a| alone), inputs x [T, D]."""
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(2 * LI, LD, generator=g) / LD ** 0.5
    down = torch.randn(LD, LI, generator=g) / LI ** 0.5 * (0.2 + 1.8 * torch.rand(LI, generator=g))
    x = torch.randn(LT, LD, generator=g)
    return gate_up, down, x


def by_hand_activations(gate_up, x):
    """[T, I]: silu(x . gate_j) * (x . up_j), one neuron at a time."""
    return torch.stack([torch.nn.functional.silu(x @ gate_up[j]) * (x @ gate_up[LI + j]) for j in range(LI)], dim=1)


def bank_neurons(bank, gate_up):
    """Which dense neuron each expert row is: [E, M], matched exactly on the gate and up rows."""
    M = bank.shape[1] // 2
    found = torch.tensor([[next(j for j in range(LI) if torch.equal(bank[e, m], gate_up[j])) for m in range(M)]
                          for e in range(bank.shape[0])])
    assert torch.equal(bank[:, M:], gate_up[LI + found])  # the up rows moved with their gate rows
    return found


def by_hand_routing(logits, k):
    """Granite's renormalised top-K, token by token -> weights [T, E] (0 where not selected)."""
    w = torch.zeros_like(logits)
    for t, row in enumerate(logits.double()):
        pick = sorted(range(len(row)), key=lambda e: -row[e].item())[:k]
        p = torch.exp(row[pick] - row[pick].max())
        w[t, pick] = (p / p.sum()).float()
    return w


def top_set(values, n):
    return frozenset(sorted(range(len(values)), key=lambda j: -float(values[j]))[:n])


def test_shared_neurons_are_the_most_important_by_mean_abs_activation_times_down_column_norm():
    """Step 2: the shared set is the N neurons with the largest mean_t |a_tj| * ||W_down[:, j]||,
    not the least important ones, nor the top N of either factor alone."""
    gate_up, down, x = random_layer()
    a = by_hand_activations(gate_up, x)
    mean_abs = [a[:, j].abs().mean().item() for j in range(LI)]
    column = [down[:, j].square().sum().sqrt().item() for j in range(LI)]
    importance = [m * c for m, c in zip(mean_abs, column)]
    expected = top_set(importance, LN)
    assert len({expected, top_set([-v for v in importance], LN), top_set(mean_abs, LN),
                top_set(column, LN)}) == 4  # the data tells the four apart
    s = SplitSettings(num_experts=LE, top_k=LK, shared=LN, repair=False)
    bank, _, _, _ = split_layer(gate_up, down, x, s, torch.Generator().manual_seed(0))
    neurons = bank_neurons(bank, gate_up)
    assert (neurons[:, :LN] == neurons[0, :LN]).all()  # the same shared neurons first in every expert
    assert set(neurons[0, :LN].tolist()) == expected


@pytest.mark.parametrize("router_std", [0.37, 2.5])
def test_router_logits_have_router_std_as_their_per_token_std_across_experts(router_std):
    """Step 4: the router is scaled so that std over experts of each token's logits, averaged over
    tokens, is `router_std` (the fitted router's own scale is about 1: it fits z-scores)."""
    gate_up, down, x = random_layer()
    s = SplitSettings(num_experts=LE, top_k=LK, shared=LN, router_std=router_std)
    _, _, router, _ = split_layer(gate_up, down, x, s, torch.Generator().manual_seed(0))
    logits = (x.double() @ router.double().T)  # [T, E]
    centred = logits - logits.sum(1, keepdim=True) / LE
    per_token = (centred.square().sum(1) / (LE - 1)).sqrt()  # sample std over the E experts
    assert per_token.mean().item() == pytest.approx(router_std, rel=1e-4)


def test_router_is_the_least_squares_fit_to_each_tokens_z_scored_group_output_norms():
    """Step 4: with no ridge, the router's logits are a positive multiple of the least-squares fit
    (lstsq in float64) of each token's z-scored ||W_down[:, g_e] a_g_e|| over experts, the oracle's
    norms computed group by group; recall@K in the stats is that of the logits against those norms."""
    gate_up, down, x = random_layer()
    s = SplitSettings(num_experts=LE, top_k=LK, shared=LN, ridge=0.0, repair=False, router_std=1.0)
    bank, _, router, stats = split_layer(gate_up, down, x, s, torch.Generator().manual_seed(0))
    groups = bank_neurons(bank, gate_up)[:, LN:]  # [E, G]
    a = by_hand_activations(gate_up, x).double()
    norms = torch.stack([(a[:, g] @ down[:, g].double().T).norm(dim=1) for g in groups], dim=1)  # [T, E]
    z = (norms - norms.mean(1, keepdim=True)) / norms.std(1, keepdim=True)
    fit = x.double() @ torch.linalg.lstsq(x.double(), z).solution  # [T, E]
    raw = x.double() @ torch.linalg.lstsq(x.double(), norms).solution  # the un-z-scored fit: must differ
    logits = x.double() @ router.double().T
    c = (logits * fit).sum() / (fit * fit).sum()
    assert c > 0 and rel(logits, c * fit) < 1e-4
    c_raw = (logits * raw).sum() / (raw * raw).sum()
    assert rel(logits, c_raw * raw) > 1e-2  # the data tells z-scores from raw norms
    recall = sum(len(top_set(logits[t], LK) & top_set(norms[t], LK)) for t in range(LT)) / (LK * LT)
    assert stats["recall_at_k"] == pytest.approx(recall, abs=1e-6)


def test_each_experts_own_group_is_scaled_by_one_over_its_mean_weight_when_selected():
    """Step 5 (no repair): expert e's own down columns are W_down[:, g_e] / mean_{t: e selected} w_te,
    from the router's own renormalised top-K; the shared columns are W_down[:, shared] unscaled."""
    gate_up, down, x = random_layer()
    s = SplitSettings(num_experts=LE, top_k=LK, shared=LN, repair=False, router_std=1.0)
    bank, downs, router, _ = split_layer(gate_up, down, x, s, torch.Generator().manual_seed(0))
    neurons = bank_neurons(bank, gate_up)
    w = by_hand_routing(x @ router.T, LK)  # [T, E]
    mean_weight = torch.stack([w[w[:, e] > 0, e].mean() for e in range(LE)])  # [E]
    assert mean_weight.max() / mean_weight.min() > 1.05  # the experts' scales differ: not one constant
    for e in range(LE):
        assert torch.equal(downs[e][:, :LN], down[:, neurons[e, :LN]])
        torch.testing.assert_close(downs[e][:, LN:], down[:, neurons[e, LN:]] / mean_weight[e], rtol=1e-5, atol=0)


def moe_output(bank, downs, x, w):
    """Granite's MoE MLP token by token: sum over selected e of w_te * W_down_e (silu(gate_e x) * up_e x)."""
    M = bank.shape[1] // 2
    out = torch.zeros(x.shape[0], downs.shape[1], dtype=torch.float64)
    for e in range(bank.shape[0]):
        act = torch.nn.functional.silu(x @ bank[e, :M].T) * (x @ bank[e, M:].T)  # [T, M]
        out += w[:, e:e + 1].double() * (act.double() @ downs[e].double().T)
    return out


def test_repair_is_the_joint_least_squares_fit_of_the_down_projections_given_the_routing():
    """Step 6: with no ridge, the repaired MoE output (computed expert by expert as Granite runs it) is
    the float64 least-squares prediction of the dense MLP output from the features [a_shared,
    w_t1 a_g1, ..., w_tE a_gE] under the router's own selection and weights; the shared columns stay
    tied; the stats' relative errors are those of the MoE outputs before and after the repair."""
    gate_up, down, x = random_layer()
    kw = dict(num_experts=LE, top_k=LK, shared=LN, ridge=0.0, router_std=1.0)
    bank, downs, router, stats = split_layer(gate_up, down, x, SplitSettings(**kw), torch.Generator().manual_seed(0))
    _, plain, router0, _ = split_layer(gate_up, down, x, SplitSettings(**kw, repair=False),
                                       torch.Generator().manual_seed(0))
    assert torch.equal(router, router0)  # the repair comes after the routing: the same router either way
    neurons = bank_neurons(bank, gate_up)
    a = by_hand_activations(gate_up, x).double()
    y = a @ down.double().T  # [T, D] the dense MLP output
    w = by_hand_routing(x @ router.T, LK)
    features = torch.cat([a[:, neurons[0, :LN]]] + [w[:, e:e + 1].double() * a[:, neurons[e, LN:]]
                                                     for e in range(LE)], dim=1)  # [T, N + E*G]
    best = features @ torch.linalg.lstsq(features, y).solution
    unweighted = torch.cat([a[:, neurons[0, :LN]]] + [a[:, neurons[e, LN:]] for e in range(LE)], dim=1)
    repaired, before = moe_output(bank, downs, x, w), moe_output(bank, plain, x, w)
    assert all(torch.equal(downs[0][:, :LN], downs[e][:, :LN]) for e in range(LE))  # shared columns tied
    assert rel(repaired, best) < 1e-4
    assert rel(before, best) > 1e-2  # the repair changes the output: the test can tell it from no repair
    assert rel(unweighted @ torch.linalg.lstsq(unweighted, y).solution, best) > 1e-2  # weights matter here
    assert stats["rel_error_repaired"] == pytest.approx(rel(repaired, y), rel=1e-4)
    assert stats["rel_error_split"] == pytest.approx(rel(before, y), rel=1e-4)
    assert stats["rel_error_repaired"] < stats["rel_error_split"]


def test_balanced_assignment_fills_the_most_similar_pairs_first_under_the_size_cap():
    """Step 3's assignment on a case worked by hand: pairs by similarity .95 (1, 0), .9 (0, 0): group 0 is
    full; .8 (0, 1) row 0 has a group; .5 (2, 0) full; .4 (2, 1); .3 (3, 1) -> [0, 0, 1, 1]."""
    from minimoe.making.split import balanced_assign
    sim = torch.tensor([[0.9, 0.8], [0.95, 0.1], [0.5, 0.4], [0.2, 0.3]])
    assert balanced_assign(sim, 2).tolist() == [0, 0, 1, 1]


def test_each_layer_is_split_on_the_hidden_states_of_the_split_layers_below(dense):
    """Step 1: layer 1's shared set is the top N by importance on the MLP inputs of the model being
    built (its split layer 0 below), recomputed here from that model's forward pass, and differs from
    the top N on the dense model's own layer-1 inputs."""
    from minimoe.making.split import split_model
    from minimoe.making.upcycle import assemble, moe_config, read_llama_folder, upcycle_tensors
    llama, tensors, _ = read_llama_folder(dense[0])
    config = moe_config(llama, 1, 1, torch.float32)
    one = assemble(config, upcycle_tensors(config, tensors, seed=0, noise=0.0, dtype=torch.float32))
    fit = torch.randint(1, config.vocab_size, (8, 32), generator=torch.Generator().manual_seed(3))
    s = SplitSettings(num_experts=E, top_k=1, shared=SHARED, repair=False, router_std=1.0)
    moe, _ = split_model(one, fit, s)
    seen = {}
    hooks = [moe.model.layers[1].mlp.register_forward_pre_hook(lambda m, args: seen.update(split=args[0])),
             dense[1].model.layers[1].mlp.register_forward_pre_hook(lambda m, args: seen.update(dense=args[0]))]
    with torch.no_grad():
        moe(fit), dense[1](fit)
    for hook in hooks:  # the dense model is the module's fixture: leave it as it was
        hook.remove()
    ref = dense[1].model.layers[1].mlp
    down_norm = ref.down_proj.weight.norm(dim=0)

    def top(x):
        a = torch.nn.functional.silu(ref.gate_proj(x)) * ref.up_proj(x)  # [B, L, I]
        importance = a.abs().mean((0, 1)) * down_norm
        order = importance.argsort(descending=True)
        assert importance[order[SHARED - 1]] > 1.001 * importance[order[SHARED]]  # no near-tie at the cut
        return set(order[:SHARED].tolist())

    assert top(seen["split"]) != top(seen["dense"])  # the two inputs give other shared sets
    assert set(expert_neurons(moe, dense[1], 1)[0, :SHARED].tolist()) == top(seen["split"])


def test_the_held_out_fifth_of_the_prose_is_never_fitted(dense, tmp_path, monkeypatch):
    """The fitting text: the documents whose sha256(id) is 0 mod 5, counted here with hashlib, are kept
    for bench/split.py's held-out NLL; the upcycler fits on all the others and on none of those."""
    import hashlib
    from minimoe.making import split as splitting
    seen = []
    token_rows = splitting.token_rows
    monkeypatch.setattr(splitting, "token_rows", lambda tok, docs, *a: seen.append(docs) or token_rows(tok, docs, *a))
    split(dense, tmp_path / "moe")
    every = splitting.prose_documents()
    kept = {i for i, _ in every if int(hashlib.sha256(i.encode()).hexdigest(), 16) % 5 == 0}
    assert 0.15 < len(kept) / len(every) < 0.25
    assert [[i for i, _ in docs] for docs in seen] == [[i for i, _ in every if i not in kept]]  # ids: a short diff
