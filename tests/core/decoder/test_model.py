"""Logit and gradient parity with transformers 4.57 (the reference), and the model's own invariants.

The reference model is built and randomised by transformers itself and saved with its own
save_pretrained; ours loads those files through the same `from_pretrained` that reads official
checkpoints. Gradients are compared parameter by parameter, mapped through the checkpoint name table.
"""
import contextlib
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import minimoe
import minimoe.core.layers.experts as mm
import minimoe.core.decoder.model as model_module
from minimoe.core.decoder.family_record import family_of
from minimoe.core.layers import cpu_memory
from minimoe.core.task.choices import forward_choices, make_choice_batch
from minimoe.core.routing_methods.objectives import load_balancing_loss
from minimoe.loading.checkpoint import checkpoint_layout, to_disk_layout
from minimoe.loading.config_json import config_to_dict
from tests.conftest import NEW_FAMILIES, OTHER_ROUTERS, indexer_margin, oracle, routing_margin, spy_grouped_mm, tie_free, tiny_config, tiny_model


transformers = oracle("transformers")  # its tests skip without the test extra

FP32_TOL = 2e-5  # max |ours - ref| / max |ref| on the logits


def reference_model(kw: dict, folder, seed=0, *, shard=False):
    """transformers' model of the config fields `kw` (`tiny` below, tests/tiny_families.py's variant_config)
    with random weights (norms near 1, DeepSeek-V3's selection bias large enough to change choices, Gemma 4's
    layer scalars off 1), saved
    by its own save_pretrained into `folder` (`shard`: several files); ours loads it."""
    config = transformers.AutoConfig.for_model(**kw)
    torch.manual_seed(seed)
    auto = transformers.AutoModelForCausalLM  # Mistral 4's causal LM is no AutoModelForCausalLM in transformers 5.23
    build = auto.from_config if type(config) in auto._model_mapping else \
        getattr(transformers, family_of(kw["model_type"]).architecture)._from_config
    ref = build(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
        for name, b in ref.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias")):  # selection only: large enough to change choices
                b.copy_(0.5 * torch.randn_like(b))
            elif name.endswith("tid2eid"):  # DeepSeek-V4's hash table (zeros at init): K distinct experts per token id
                b.copy_(torch.rand(b.shape[0], config.num_local_experts).argsort(-1)[:, :b.shape[1]])
            elif name.endswith("layer_scalar"):  # Gemma 4's, a checkpoint buffer: off 1, so that a lost one shows
                b.copy_(1 + 0.1 * torch.randn_like(b))
        ref.get_input_embeddings().weight[config.pad_token_id].zero_()
    ref.save_pretrained(folder, max_shard_size="200KB" if shard else "5GB")
    return with_v2_softmax_mscale(ref).eval()


def hf_causal_lm(folder, **kwargs):
    """transformers' causal LM of the checkpoint in `folder`, by the class its config.json names (as a user of a
    family that transformers' AutoModelForCausalLM does not map, Mistral 4, loads it)."""
    architecture = json.loads((Path(folder) / "config.json").read_text())["architectures"][0]
    return getattr(transformers, architecture).from_pretrained(folder, **kwargs)


def tiny(family, **overrides) -> dict:
    """tests/conftest.py's tiny config of `family` as transformers' config fields."""
    return config_to_dict(tiny_config(family, **overrides))


def with_v2_softmax_mscale(model):
    """transformers 4.57's DeepSeek-V2 leaves out the YaRN softmax mscale that DeepSeek's code applies (its
    V3 applies it; fixed upstream in transformers PR 47435): the reference gets it, from V3's yarn_get_mscale."""
    config = model.config
    scaling = getattr(config, "rope_scaling", None) or {}
    if config.model_type == "deepseek_v2" and scaling.get("mscale_all_dim"):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_get_mscale
        for layer in model.model.layers:
            layer.self_attn.scaling *= yarn_get_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return model


def batch(model=None, vocab=128, seed=1):
    """ids [3, 16] and a right-padding mask. With `model` (what a parity test compares): the first draw on
    which it routes every token clear of ties, padded or not (conftest.routing_margin; a DSA indexer's keys too:
    conftest.indexer_margin), so that a reference
    rounding otherwise picks the same experts."""
    def draw(s):
        g = torch.Generator().manual_seed(s)
        ids = torch.randint(3, vocab, (3, 16), generator=g)
        mask = torch.ones_like(ids)
        mask[1, 11:] = 0  # right padding
        mask[2, 5:] = 0
        return ids, mask
    if model is None:
        return draw(seed)

    def margin(drawn):
        with torch.no_grad():
            return min(*(routing_margin(model, model(drawn[0], attention_mask=m).routings, m) for m in (drawn[1], None)),
                       indexer_margin(model, *drawn))
    return tie_free(lambda s: draw(seed + 1000 * s), margin)


def rel_err(ours, ref, mask):
    real = mask.bool()
    return ((ours.float() - ref.float())[real].abs().max() / ref.float()[real].abs().max()).item()


def test_fp32_logits_match_transformers(family, tmp_path):
    """Every config switch on (GQA, Granite multipliers + tied head, OLMoE clip_qkv + norm_topk_prob), padded batch."""
    ref = reference_model(tiny(family), path := tmp_path / "ref")
    ours = minimoe.from_pretrained(path, dtype=torch.float32)
    ids, mask = batch(ours)
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    assert rel_err(got, want, mask) <= FP32_TOL


def test_olmoe_default_switches_match_transformers(tmp_path):
    """The released OLMoE settings: no clip_qkv, norm_topk_prob false (weights keep the selected mass)."""
    ref = reference_model(tiny("olmoe", clip_qkv=None, norm_topk_prob=False, num_key_value_heads=4),
                          path := tmp_path / "ref")
    ours = minimoe.from_pretrained(path)
    ids, mask = batch(ours)
    with torch.no_grad():
        assert rel_err(ours(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits, mask) <= FP32_TOL


@pytest.mark.parametrize("family,switches", [
    # Dense layers placed by decoder_sparse_step (layers 1 and 3 sparse) and by mlp_only_layers.
    ("qwen2_moe", dict(num_hidden_layers=4, decoder_sparse_step=2, dense_intermediate_size=48)),
    ("qwen3_moe", dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3], dense_intermediate_size=48)),
    # norm_topk_prob the other way from the fixture's; no biases; no window; the window off by its switch.
    ("qwen3_moe", dict(norm_topk_prob=False, attention_bias=False, use_sliding_window=False)),
    ("qwen2_moe", dict(norm_topk_prob=True, qkv_bias=False, use_sliding_window=True, sliding_window=4,
                       shared_expert_intermediate_size=24)),
    ("mixtral", dict(sliding_window=None, head_dim=None, num_experts_per_tok=2)),
])
def test_family_switches_match_transformers(family, switches, tmp_path):
    """Each family's other switches: fp32 logits with and without padding (gradients: the fixture's switches)."""
    ref = reference_model(tiny(family, **switches), path := tmp_path / "ref")
    ours = minimoe.from_pretrained(path)
    theirs = [type(getattr(l, "mlp", None) or l.block_sparse_moe).__name__ for l in ref.model.layers]
    assert [type(l.mlp).__name__ for l in ours.model.layers] == ["MoEBlock" if "Sparse" in t else "DenseMLP" for t in theirs]
    ids, mask = batch(ours)
    with torch.no_grad():
        for m in (mask, torch.ones_like(mask)):
            assert rel_err(ours(ids, attention_mask=m).logits, ref(ids, attention_mask=m).logits, m) <= FP32_TOL


def test_clip_qkv_actually_clips(tmp_path):
    """Guard for the test above: with clip_qkv=0.5 some projections exceed the clip, so it is exercised."""
    ref = reference_model(tiny("olmoe"), path := tmp_path / "ref")
    attn = minimoe.from_pretrained(path).model.layers[0].self_attn
    x = torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(0))
    assert attn.q_norm(attn.q_proj(x)).abs().max() > 0.5


# The GPU recipe runs a bf16 model under autocast; the CPU replays it under CPU autocast, which makes the
# same dtype choices (an fp32 router's F.linear ran in bf16 there until the router left autocast).
GPU_RECIPE = pytest.mark.parametrize("autocast", [False, True], ids=["plain", "autocast"])


def bf16_recipe(autocast: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()


@GPU_RECIPE
def test_bf16_error_no_worse_than_reference_bf16(family, tmp_path, autocast):
    """bf16: our error against the fp32 reference is within 2x of transformers' own bf16 error, with
    and without autocast."""
    ref = reference_model(tiny(family), path := tmp_path / "ref")
    ids, mask = batch()
    with torch.no_grad():
        exact = ref(ids, attention_mask=mask).logits
        ref_bf16 = ref.to(torch.bfloat16)(ids, attention_mask=mask).logits
        with bf16_recipe(autocast):
            ours_bf16 = minimoe.from_pretrained(path, dtype=torch.bfloat16)(ids, attention_mask=mask).logits
    assert ours_bf16.dtype == torch.bfloat16
    assert rel_err(ours_bf16, exact, mask) <= 2 * rel_err(ref_bf16, exact, mask)


def test_bf16_packed_answer_logprobs_no_worse_than_reference_bf16(family, tmp_path):
    """The CPU bf16 scoring path (packed rows, block-causal mask, LM head at the answer positions, fp32
    log-softmax): its answer-token log-probs are within 2x of transformers' own bf16 error, both
    against transformers in fp32 on plain per-candidate rows."""
    from tests.core.task.test_choices import CharTokenizer, examples
    ref = reference_model(tiny(family), path := tmp_path / "ref")
    tok, pad = CharTokenizer(), ref.config.pad_token_id
    packed = make_choice_batch(examples(), tok, pad)
    rows = make_choice_batch(examples(), tok, pad, packed=False)
    assert torch.equal(packed.target, rows.target)  # the same answer tokens in the same order

    def reference_logprobs(model):  # [n] per-candidate rows, the full head, no packing
        logits = model(rows.input_ids, attention_mask=rows.attention_mask).logits[rows.row, rows.col].float()
        return logits.log_softmax(-1).gather(-1, rows.target[:, None])[:, 0]
    with torch.no_grad():
        exact = reference_logprobs(ref)
        ref_bf16 = reference_logprobs(ref.to(torch.bfloat16))
        ours_bf16 = forward_choices(minimoe.from_pretrained(path, dtype=torch.bfloat16), packed)[1]
    assert ours_bf16.dtype == torch.float32  # the log-softmax runs in fp32
    err = lambda x: ((x - exact).abs().max() / exact.abs().max()).item()
    assert 0 < err(ours_bf16) <= 2 * err(ref_bf16)


def next_token_grads(model, ids, mask):
    """{parameter name: fp32 copy of d(next-token CE over the real positions)/d(it)}, in train mode."""
    targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    model.train().zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=mask).logits
    F.cross_entropy(logits[:, :-1].float().flatten(0, 1), targets.flatten(), ignore_index=-100).backward()
    return {n: p.grad.float().clone() for n, p in model.named_parameters()}


def worst_grad_err(got, exact):
    """The worst weight's max |got - exact| / max |exact| (both by transformers' parameter names)."""
    return max(((got[k] - want).abs().max() / want.abs().max().clamp(min=1e-8)).item() for k, want in exact.items())


@GPU_RECIPE
def test_bf16_gradients_no_worse_than_reference_bf16(family, tmp_path, autocast):
    """The bf16 training path's gradients, with and without autocast: per weight, our bf16 error against
    transformers' fp32 gradient is within 2x of transformers' own bf16 error (the worst weight of each
    model compared)."""
    ref = reference_model(tiny(family), path := tmp_path / "ref")
    ids, mask = batch()
    exact = next_token_grads(ref, ids, mask)
    ref_bf16 = next_token_grads(ref.to(torch.bfloat16), ids, mask)
    ours = minimoe.from_pretrained(path, dtype=torch.bfloat16)
    with bf16_recipe(autocast):
        ours_bf16 = to_disk_layout(ours.config, next_token_grads(ours, ids, mask))
    assert 0 < worst_grad_err(ours_bf16, exact) <= 2 * worst_grad_err(ref_bf16, exact)


def test_gradients_match_transformers(family, tmp_path):
    """d(next-token CE)/d(every weight) equals the reference's, mapped by checkpoint name (fp32)."""
    ref = reference_model(tiny(family), path := tmp_path / "ref")
    ours = minimoe.from_pretrained(path).train()
    ref.train()
    ids, mask = batch(ours)

    def next_token_ce(logits):
        targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), targets.flatten(), ignore_index=-100)

    next_token_ce(ours(ids, attention_mask=mask).logits).backward()
    next_token_ce(ref(ids, attention_mask=mask).logits).backward()
    names = checkpoint_layout(ours.config)
    ours_grads = to_disk_layout(ours.config, {n: ours.get_parameter(n).grad for n in names})
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    assert set(ours_grads) == set(ref_grads)
    for key, want in ref_grads.items():
        scale = want.abs().max().clamp(min=1e-8)
        assert ((ours_grads[key] - want).abs().max() / scale).item() <= 1e-4, key


@pytest.mark.parametrize("family", ["granitemoe", "olmoe", *NEW_FAMILIES, *OTHER_ROUTERS])
def test_padding_gives_unpadded_logits(family):
    """Right-padded rows equal the same rows run alone, at every real position."""
    from tests.conftest import tiny_model
    model = tiny_model(family)
    ids, mask = batch()
    with torch.no_grad():
        padded = model(ids, attention_mask=mask).logits
        for row in range(ids.shape[0]):
            n = int(mask[row].sum())
            alone = model(ids[row:row + 1, :n]).logits[0]
            torch.testing.assert_close(padded[row, :n], alone, rtol=1e-5, atol=1e-5)


def grouped_mm_and_loop_paths(model, ids, monkeypatch):
    """[(logits, layer 0's gate_up gradient)] with USE_GROUPED_MM True, then False, in fp32 for comparison;
    asserts that the first really ran F.grouped_mm."""
    calls = spy_grouped_mm(monkeypatch)
    outs = []
    for use in (True, False):
        monkeypatch.setattr(mm, "USE_GROUPED_MM", use)
        calls.clear()
        model.zero_grad()
        logits = model(ids).logits
        logits.float().square().mean().backward()
        outs.append((logits.detach().float(), model.model.layers[0].mlp.experts.gate_up_proj.weight.grad.float()))
        assert bool(calls) == use, "grouped_mm was never called" if use else "the loop path called grouped_mm"
    return outs


def test_grouped_mm_path_equals_loop_path(family, monkeypatch):
    """The two dispatch paths (F.grouped_mm and the per-expert loop) give the same outputs and grads."""
    from tests.conftest import tiny_model
    assert hasattr(F, "grouped_mm"), "torch 2.13 has grouped_mm on CPU; this test must exercise it"
    for dtype, tol in [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]:
        (grouped, grouped_grad), (loop, loop_grad) = grouped_mm_and_loop_paths(tiny_model(family).to(dtype), batch()[0],
                                                                               monkeypatch)
        torch.testing.assert_close(grouped, loop, rtol=tol, atol=tol)
        torch.testing.assert_close(grouped_grad, loop_grad, rtol=tol, atol=tol)


def test_experts_run_only_on_routed_rows(monkeypatch):
    """Sparse dispatch: each expert matmul sees exactly T*K rows, never T*E (no dense evaluation)."""
    from tests.conftest import tiny_model
    model = tiny_model("olmoe")
    seen = []
    real = mm.expert_matmul
    monkeypatch.setattr(mm, "expert_matmul", lambda x, w, d: seen.append(x.shape[0]) or real(x, w, d))
    ids, _ = batch()
    model(ids)
    T, K = ids.numel(), model.config.num_experts_per_tok
    assert seen and all(n == T * K for n in seen)


@pytest.mark.parametrize("family", ["granitemoe", "olmoe"])  # the dispatch is every family's; its float noise is not
def test_rounded_expert_blocks_equal_exact_blocks(family, monkeypatch):
    """Dispatch(block=8): every expert block is a multiple of 8 rows, the stand-in rows have combine
    weight 0, and logits and gradients (experts, router gate, embeddings) equal exact blocks'."""
    from tests.conftest import tiny_model
    experts = torch.tensor([[1, 4], [1, 6], [6, 1]])
    d = mm.Dispatch(experts, num_experts=8, block=8)
    assert d.counts.tolist() == [0, 8, 0, 0, 8, 0, 8, 0] and d.padding == 18
    weights = torch.tensor([[.6, .4], [.7, .3], [.2, .8]])
    real = d.order < experts.numel()
    assert torch.equal(d.row_weights(weights)[real, 0], weights.flatten()[d.order[real]])
    assert not d.row_weights(weights)[~real].any() and not d.token[~real].any()
    # fp64: the padded blocks change the matmuls' summation order, which fp32 rounding shows at ~1e-6
    # (CPU-dependent); in fp64 anything but rounding (a stand-in row with weight, a row out of place) is plain
    model = tiny_model(family).double()
    ids, _ = batch()
    outs = []
    for block in (1, 8):
        monkeypatch.setattr(cpu_memory, "expert_block", lambda x, rows, E: block)
        model.zero_grad()
        logits = model(ids).logits
        logits.square().mean().backward()
        layer = model.model.layers[0].mlp
        outs.append([logits.detach(), layer.experts.gate_up_proj.weight.grad, layer.gate.weight.grad,
                     model.model.embed_tokens.weight.grad])
    for exact, rounded in zip(*outs):
        torch.testing.assert_close(rounded, exact, rtol=1e-12, atol=1e-12)


def test_bf16_expert_blocks_are_rounded_on_cpu_only_with_enough_rows():
    x = torch.zeros(64, 8)
    assert cpu_memory.expert_block(x, 128, 8) == 1  # fp32: MKL, no per-shape kernels
    assert cpu_memory.expert_block(x.bfloat16(), 128, 8) == cpu_memory.EXPERT_BLOCK
    assert cpu_memory.expert_block(x.bfloat16(), 2, 8) == 1  # a decoding step keeps its two rows


def test_every_layer_returns_its_routing(family):
    """Each layer exposes native logits [T,E], its top-K experts [T,K] and weights; Granite weights sum to 1."""
    from tests.conftest import tiny_model
    model = tiny_model(family)
    ids, mask = batch()
    out = model(ids, attention_mask=mask)
    c = model.config
    assert len(out.routings) == c.num_hidden_layers
    assert [i for i, r in enumerate(out.routings) if r is not None] == c.sparse_layers  # dense layers: None
    for r in (r for r in out.routings if r is not None):
        assert r.logits.shape == (ids.numel(), c.num_experts) and r.logits.dtype == torch.float32
        assert r.experts.shape == r.weights.shape == (ids.numel(), c.num_experts_per_tok)
        probs = r.logits.softmax(-1)
        torch.testing.assert_close(r.experts, probs.topk(c.num_experts_per_tok).indices)
        if c.norm_topk_prob:
            torch.testing.assert_close(r.weights.sum(-1), torch.ones(ids.numel()))


def test_aux_loss_matches_transformers(family, tmp_path):
    """The load-balancing loss over all layers, padding-aware, equals transformers' load_balancing_loss_func."""
    if family == "gpt_oss":
        pytest.skip("transformers 4.57's gpt-oss feeds its router *scores* (the softmax of the K, zeros elsewhere) "
                    "to load_balancing_loss_func as if they were logits; ours is the Switch loss on the logits "
                    "(docs/families.md)")
    ref = reference_model(tiny(family), path := tmp_path / "ref")
    ours = minimoe.from_pretrained(path)
    ids, mask = batch(ours)
    with torch.no_grad():
        want = ref(ids, attention_mask=mask, output_router_logits=True).aux_loss
        got = load_balancing_loss(ours(ids, attention_mask=mask).routings, mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_bad_config_values_raise():
    """Config values the model cannot honour are refused with the field's name."""
    with pytest.raises(ValueError, match="model_type"):
        tiny_config("olmoe", model_type="llama4")
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        tiny_config("olmoe", num_experts_per_tok=9)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        tiny_config("olmoe", num_key_value_heads=3)
    with pytest.raises(ValueError, match="rope_scaling"):
        tiny_config("olmoe", rope_scaling={"type": "dynamic", "factor": 2.0})  # linear and yarn are honoured (core/layers/rope.py)


@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3"])  # plain top-K; sigmoid + correction + groups
def test_routing_margin_sees_a_tie(family):
    """conftest.routing_margin, which the parity tests' inputs clear: positive on a random router, zero where
    two experts' gate rows are equal (each token's scores for them tie), and batch(model) then refuses."""
    model = tiny_model(family)
    ids, mask = batch()
    with torch.no_grad():
        assert routing_margin(model, model(ids, attention_mask=mask).routings) > 0
        for i, r in enumerate(model(ids).routings):
            if r is not None:
                gate = model.model.layers[i].mlp.gate.weight
                gate[:] = gate[0]  # every expert ties with every other
                if hasattr(model.model.layers[i].mlp.gate, "e_score_correction_bias"):  # which would part them
                    model.model.layers[i].mlp.gate.e_score_correction_bias.zero_()
        assert routing_margin(model, model(ids, attention_mask=mask).routings) == 0
    with pytest.raises(AssertionError, match="routing margin"):
        batch(model)
