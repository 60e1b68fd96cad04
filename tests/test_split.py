"""minimoe.split: splitting a dense Llama's MLP neurons into distinct experts with a fitted router.

References: transformers' LlamaForCausalLM (the dense model the split must equal when K = E with a
zero router) and GraniteMoeForCausalLM (which must load the written checkpoint with our logits);
a synthetic MLP whose neuron groups fire on known input directions (the routing the fit must find).
"""
import json

import pytest
import torch

import minimoe
from minimoe.split import SplitError, SplitSettings, neuron_activations, split_layer
from minimoe.upcycle import upcycle

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
