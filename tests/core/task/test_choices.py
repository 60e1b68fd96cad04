"""Packed answer-choice rows against per-candidate rows (the reference path), on tiny models of both
families under every routing method with LoRA: scores, the choice loss, the TES/ACS supervision
term, their gradients and the diagnostics at the supervised positions agree in fp32 within 1e-5.

Per-candidate rows are the independent reference here: a plain causal forward of prompt + candidate,
the LM head at every position, nothing packed or gathered (`full_forward_logprobs` below).
"""
import pytest
import torch
import torch.nn.functional as F

from minimoe.core.task.choices import choice_loss, choice_scores, forward_choices, make_choice_batch
from minimoe.core.adaptation.lora import add_lora
from minimoe.core.routing_methods.methods import set_router
from minimoe.core.routing_methods.objectives import supervision_loss
from minimoe.data.benchmarks import Example
from minimoe.evaluation.accuracy import evaluate_split
from tests.conftest import NEW_FAMILIES, OTHER_ROUTERS, tiny_model

METHODS = {"native": {}, "dual": {}, "tes": {"gamma": 1.0}, "acs": {}}


class CharTokenizer:
    """One token per character (ids 3..127), BOS 2 before a prompt: lengths are exactly controlled."""

    pad_token_id, eos_token_id = 0, None

    def encode(self, text, add_special_tokens=True):
        return ([2] if add_special_tokens else []) + [3 + ord(ch) % 125 for ch in text]


def examples():
    # Candidates of different lengths, examples of different lengths (padding) and candidate counts.
    return [Example("a", "Which gas do plants take in?", ["carbon dioxide", "O2", "helium gas", "N"], 0, {}),
            Example("b", "What is 2 + 2?", ["four", "five or six"], 1, {}),
            Example("c", "A much longer question whose prompt max_length will cut from the left, never an answer?",
                    ["yes", "no, certainly not", "maybe"], 2, {})]


def model_with(family, method):
    torch.manual_seed(0)
    model = tiny_model(family)
    set_router(model, method, layers="all", **METHODS[method])
    add_lora(model, rank=4, alpha=8, dropout=0.0, targets=["q", "k", "v", "o", "experts"])
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # LoRA B and the method heads start at zero: move them so every gradient shows
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.train()  # dropout is 0: train mode changes nothing else


def concentration(logits, k):
    """C_t directly: sum of squares of the native top-K softmax probabilities, renormalised over the K."""
    top = logits.softmax(-1).topk(k, -1).values
    return ((top / top.sum(-1, keepdim=True)) ** 2).sum(-1)


def terms(model, batch, method):
    """Scores, choice loss, supervision term and the diagnostics of one layout, plus both gradients."""
    params = [p for p in model.parameters() if p.requires_grad]
    out, logp = forward_choices(model, batch)
    scores = choice_scores(logp, batch)
    loss = choice_loss(scores["mean"], batch)
    mask = batch.supervised_mask
    got = {k: v.detach() for k, v in scores.items()}
    got["loss"] = loss.detach()
    got["grad_loss"] = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    flat = mask.flatten()
    routings = [r for r in out.routings if r is not None]  # dense layers are not routed
    got["c_t"] = [concentration(r.logits[flat].detach(), 2) for r in routings]
    got["token_ce"] = batch.at_supervised(-logp).flatten()[flat].detach()
    if method in ("tes", "acs"):
        sup = supervision_loss(out.routings, batch.at_supervised(-logp), mask, "is")
        got["supervision"] = sup.detach()
        got["grad_supervision"] = torch.autograd.grad(sup, params, allow_unused=True)
        got["e_hat"] = [r.prediction[flat].detach() for r in routings]
    return got


def assert_close(a, b, name):
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b), name
        for i, (x, y) in enumerate(zip(a, b)):
            assert_close(x, y, f"{name}[{i}]")
    elif a is None or b is None:
        assert a is None and b is None or torch.count_nonzero(a if a is not None else b) == 0, name
    else:
        torch.testing.assert_close(a.double(), b.double(), atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("max_length", [None, 40])
def test_packed_rows_equal_per_candidate_rows(family, method, max_length):
    model, tok = model_with(family, method), CharTokenizer()
    packed = make_choice_batch(examples(), tok, 0, max_length)
    rows = make_choice_batch(examples(), tok, 0, max_length, packed=False)
    assert packed.input_ids.shape[0] == 3 and rows.input_ids.shape[0] == 9
    a, b = terms(model, packed, method), terms(model, rows, method)
    assert a.keys() == b.keys()
    for name in a:
        assert_close(a[name], b[name], name)
    assert any(g is not None and g.abs().sum() > 0 for g in a["grad_loss"])
    if method in ("tes", "acs"):
        assert any(g is not None and g.abs().sum() > 0 for g in a["grad_supervision"])


@pytest.mark.parametrize("method", list(METHODS))
def test_gemma4_packed_rows_equal_per_candidate_rows(method):
    """Gemma 4's sliding and global layers (their own head width and KV heads, keys = values, a rope per layer type)
    and its dense MLP beside the experts, in packed rows: every method's terms and gradients as per-candidate rows."""
    test_packed_rows_equal_per_candidate_rows("gemma4_text", method, 40)


def full_forward_logprobs(model, prompt, answer):
    """Reference: one causal row prompt + answer, every position's logits, log-softmax, pick the answer."""
    ids = torch.tensor([prompt + answer])
    logits = model(ids).logits[0].float()  # [T, V]
    logp = F.log_softmax(logits, -1)
    P = len(prompt)
    return torch.stack([logp[P - 1 + j, t] for j, t in enumerate(answer)])


@pytest.mark.parametrize("family", ["granitemoe", "olmoe", *NEW_FAMILIES, *OTHER_ROUTERS])
def test_packed_scores_equal_a_plain_forward_per_candidate(family):
    model, tok = tiny_model(family), CharTokenizer()
    exs = examples()
    batch = make_choice_batch(exs, tok, 0)
    with torch.no_grad():
        _, logp = forward_choices(model, batch)
        total = choice_scores(logp, batch)["sum"]
        i = 0
        for ex in exs:
            for text in ex.choices:
                ref = full_forward_logprobs(model, tok.encode("Question: " + ex.question + "\nAnswer:"),
                                            tok.encode(" " + text, add_special_tokens=False))
                torch.testing.assert_close(total[i], ref.sum(), atol=1e-5, rtol=1e-5)
                i += 1


def test_packed_layout_positions_segments_and_max_length():
    tok = CharTokenizer()
    ex = Example("x", "Q?", ["ab", "cde"], 1, {})  # prompt: BOS + 20 characters
    b = make_choice_batch([ex], tok, 0)
    P = 21
    assert b.input_ids.shape == (1, P + 3 + 4)  # " ab", " cde"
    assert b.position_ids[0].tolist() == list(range(P)) + [P, P + 1, P + 2] + [P, P + 1, P + 2, P + 3]
    assert b.segment_ids[0].tolist() == [0] * P + [1] * 3 + [2] * 4
    # both candidates' first tokens are predicted at the prompt's last position
    assert b.col.tolist() == [P - 1, P, P + 1, P - 1, P + 3, P + 4, P + 5]
    assert b.target.tolist() == b.input_ids[0, [P, P + 1, P + 2, P + 3, P + 4, P + 5, P + 6]].tolist()
    # the gold candidate (1) is supervised at its own positions, the prompt's last included
    assert b.supervised_mask[0].nonzero()[:, 0].tolist() == [P - 1, P + 3, P + 4, P + 5]
    # max_length: prompt + longest answer <= 10, so the prompt keeps its last 6 tokens; answers are whole
    cut = make_choice_batch([ex], tok, 0, max_length=10)
    assert cut.input_ids[0].tolist() == b.input_ids[0, P - 6:].tolist()
    rows = make_choice_batch([ex], tok, 0, max_length=10, packed=False)
    assert rows.attention_mask.sum(-1).tolist() == [9, 10]
    with pytest.raises(ValueError, match="max_length=4 leaves no prompt token"):
        make_choice_batch([ex], tok, 0, max_length=4)


def test_logits_at_equals_the_full_head_with_logits_scaling(family):
    model = tiny_model(family)  # Granite's tiny config has logits_scaling 6
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    rows, cols = torch.tensor([0, 0, 1, 1]), torch.tensor([8, 3, 0, 3])
    with torch.no_grad():
        full = model(ids).logits
        picked = model(ids, logits_at=(rows, cols)).logits
    assert picked.shape == (4, model.config.vocab_size)
    torch.testing.assert_close(picked, full[rows, cols], atol=1e-6, rtol=1e-6)


def test_packed_rows_under_gradient_checkpointing_give_the_same_gradients():
    model, tok = model_with("olmoe", "tes"), CharTokenizer()
    batch = make_choice_batch(examples(), tok, 0)
    plain = terms(model, batch, "tes")
    model.gradient_checkpointing_enable()
    ckpt = terms(model, batch, "tes")
    for name in ("grad_loss", "grad_supervision"):
        assert_close(ckpt[name], plain[name], name)


def test_evaluate_split_packed_equals_per_candidate_rows_records_and_token_arrays():
    model, tok = model_with("granitemoe", "tes"), CharTokenizer()
    runs = [evaluate_split(model, tok, examples(), batch_size=2, max_length=40, packed=p) for p in (True, False)]
    (rec_a, met_a, arr_a), (rec_b, met_b, arr_b) = runs
    assert [r["n_tokens"] for r in rec_a] == [r["n_tokens"] for r in rec_b]
    for ra, rb in zip(rec_a, rec_b):
        for key in ("logprob_mean", "logprob_sum", "logprob_per_char"):
            torch.testing.assert_close(torch.tensor(ra[key]), torch.tensor(rb[key]), atol=1e-5, rtol=1e-5)
    assert met_a["choice_nll"] == pytest.approx(met_b["choice_nll"], abs=1e-5)
    assert (arr_a.target == arr_b.target).all() and (arr_a.example == arr_b.example).all()
    torch.testing.assert_close(torch.tensor(arr_a.token_ce), torch.tensor(arr_b.token_ce), atol=1e-5, rtol=1e-5)
    for layer in arr_b.e_hat:
        torch.testing.assert_close(torch.tensor(arr_a.e_hat[layer]), torch.tensor(arr_b.e_hat[layer]), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(torch.tensor(arr_a.concentration[layer]), torch.tensor(arr_b.concentration[layer]),
                                   atol=1e-5, rtol=1e-5)
