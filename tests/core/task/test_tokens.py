"""core/task/tokens.py and step_loss on chat/completion rows, against the loss written out by hand from the full
logits: labels shifted by one, -100 off the supervised tokens, F.cross_entropy summed over the step's
supervised tokens (TRL's completion-only SFT loss), plus lambda * the paper's IS term at the same tokens."""
import pytest
import torch
import torch.nn.functional as F

from minimoe import from_pretrained
from minimoe.core.task.step import step_loss
from minimoe.core.task.tokens import make_token_batch
from minimoe.data.chat import TokenRow
from minimoe.making.tiny import tiny_checkpoint
from minimoe.runs import training
from minimoe.runs.config import build_config

LAMBDA = 0.7


def rows(seed, n, length):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        T = length + 3 * i  # rows of different lengths: padding in every batch
        ids = torch.randint(2, 200, (T,), generator=g).tolist()
        supervised = [False] + (torch.rand(T - 1, generator=g) < 0.4).tolist()
        supervised[-1] = True
        out.append(TokenRow(ids, supervised, id=f"r{i}"))
    return out


def moved_model(cfg):
    """The tiny model with LoRA and the method installed, every trainable weight moved off its start (LoRA's
    B = 0 would leave paths without a gradient)."""
    torch.manual_seed(0)
    model = from_pretrained(tiny_checkpoint())
    training.install_method(model, cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape) * 0.05)
    return model


def by_hand(model, batches):
    ce, method, tokens, layers = 0.0, 0.0, 0, None
    for b in batches:
        out = model(b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids)
        labels = torch.full_like(b.input_ids, -100)
        for r, row in enumerate(b.rows):
            for t in range(1, len(row.ids)):
                if row.supervised[t]:
                    labels[r, t - 1] = row.ids[t]
        per_token = F.cross_entropy(out.logits.float().flatten(0, 1), labels.flatten(), reduction="none")
        keep = labels.flatten() != -100
        ce = ce + per_token[keep].sum()
        tokens += int(keep.sum())
        supervised = [r for r in out.routings if r.prediction is not None]
        layers = len(supervised)
        for routing in supervised:  # Eq. token_is_loss at the supervised tokens
            ratio = per_token[keep].clamp_min(1e-8) / routing.prediction[keep].float()
            method = method + (ratio - torch.log(ratio) - 1).sum()
    return ce / tokens, method / (tokens * layers)


@pytest.mark.parametrize("method", ["tes", "acs"])
def test_step_loss_on_token_rows_is_the_completion_only_loss(method):
    cfg = build_config({"method": method, "objective": "is", "layers": "all", "lambda_": LAMBDA, "lora_dropout": 0.0,
                        "batch_size": 3, "pad_token_id": 0, "device": "cpu"}, "tiny")
    data = rows(0, 6, 9)
    batches = training.micro_batches(data, None, cfg, 0, 1)
    for b, part in zip(batches, (data[:3], data[3:])):
        b.rows = part
    model = moved_model(cfg)
    counts = {"examples": 6, "tokens": sum(b.supervised_tokens for b in batches),
              "rows": sum(b.input_ids.shape[0] for b in batches)}
    logs = step_loss(model, batches, cfg.method, counts, 1, **training.loss_settings(cfg))
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    ce, term = by_hand(model, batches)
    (ce + LAMBDA * term).backward()
    assert float(logs["task"]) == pytest.approx(ce.item(), rel=1e-5)
    assert float(logs["method"]) == pytest.approx(term.item(), rel=1e-5)
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-7, msg=n)


def test_token_batch_layout():
    data = [TokenRow([5, 6, 7, 8], [False, False, True, True]), TokenRow([9, 10], [False, True])]
    b = make_token_batch(data, pad_token_id=0, pad_to=4)
    assert b.input_ids.tolist() == [[5, 6, 7, 8], [9, 10, 0, 0]]
    assert list(zip(b.row.tolist(), b.col.tolist(), b.target.tolist())) == [(0, 1, 7), (0, 2, 8), (1, 0, 10)]
    assert b.supervised_mask.tolist() == [[False, True, True, False], [True, False, False, False]]
    assert b.supervised_tokens == 3 and b.real_tokens == 6
    with pytest.raises(ValueError, match="no supervised token"):
        make_token_batch([TokenRow([1, 2], [False, False])], 0)


def test_chunked_ce_equals_the_plain_loss_in_value_and_gradient():
    """fp64, 10 positions in chunks of 3 (a short last chunk): the CE per token and the gradients of a
    weighted sum of it (as TES reads each token's CE) wrt the hidden states and the head's weight."""
    from minimoe.core.task.tokens import chunked_token_ce, token_ce
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False).double()
    hidden = torch.randn(10, 16, dtype=torch.float64, requires_grad=True)
    target, weights = torch.randint(0, 50, (10,)), torch.rand(10, dtype=torch.float64)
    results = []
    for loss in (lambda: token_ce(head, hidden, target), lambda: chunked_token_ce(head, hidden, target, chunk=3)):
        head.zero_grad(), hidden.grad is not None and hidden.grad.zero_()
        ce = loss()
        (ce * weights).sum().backward()
        results.append((ce.detach(), hidden.grad.clone(), head.weight.grad.clone()))
    for plain, chunked in zip(*results):
        torch.testing.assert_close(chunked, plain, rtol=1e-12, atol=1e-12)
    shapes = []  # the head sees at most 3 positions at a time: forward 3+3+3+1, then each again in the backward
    head.register_forward_hook(lambda module, args, out: shapes.append(out.shape[0]))
    chunked_token_ce(head, hidden, target, chunk=3).sum().backward()
    assert shapes[:4] == [3, 3, 3, 1] and sorted(shapes[4:]) == [1, 3, 3, 3]  # the backward goes last chunk first


def test_chunked_forward_with_gradient_checkpointing_equals_the_plain_forward():
    """forward_tokens with chunks of 4 supervised positions, the layers checkpointed, against the head run
    once inside the forward (forward_choices): the same per-token CE and LoRA gradients."""
    from minimoe.core.task.choices import forward_choices
    from minimoe.core.task.tokens import forward_tokens
    cfg = build_config({"method": "tes", "lora_dropout": 0.0, "pad_token_id": 0, "device": "cpu"}, "tiny")
    batch = make_token_batch(rows(1, 3, 12), 0)
    assert batch.supervised_tokens > 8
    model = moved_model(cfg)
    results = []
    for checkpointed, forward in ((False, forward_choices), (True, lambda m, b: forward_tokens(m, b, chunk=4))):
        model.gradient_checkpointing_enable(checkpointed)
        model.zero_grad(set_to_none=True)
        _, logp = forward(model, batch)
        (logp * torch.linspace(0.5, 1.5, len(logp))).sum().backward()
        results.append((logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (plain, plain_grads), (chunked, chunked_grads) = results
    torch.testing.assert_close(chunked, plain, rtol=1e-5, atol=1e-6)
    assert plain_grads.keys() == chunked_grads.keys() and any("lora" in n for n in plain_grads)
    for n in plain_grads:
        torch.testing.assert_close(chunked_grads[n], plain_grads[n], rtol=1e-4, atol=1e-7, msg=n)


@pytest.mark.parametrize("family", ["olmoe", "gpt_oss", "llama4_text", "deepseek_v3", "granitemoehybrid", "qwen3_next"])
def test_a_packed_row_equals_each_examples_own_row(family):
    """fp64 (the routers in fp32), LoRA and TES on: 5 examples packed into rows of at most 30 tokens (several a row) give each
    example the per-token CE of its own unpacked forward, and the summed loss the same gradients. The
    families cover sliding windows and sinks (gpt_oss), chunked attention (llama4_text), MLA (deepseek_v3),
    and the recurrent mixers whose state must restart at each example (granitemoehybrid: Mamba-2,
    qwen3_next: Gated DeltaNet)."""
    from minimoe.core.adaptation.lora import add_lora
    from minimoe.core.routing_methods.methods import set_router
    from minimoe.making.tiny import tiny_model
    model = tiny_model(family).double()
    set_router(model, "tes", layers="all")
    add_lora(model, rank=4, alpha=8, dropout=0.0, targets=["q", "k", "v", "o", "experts"])
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)
    data = [TokenRow([t % 120 + 3 for t in r.ids], r.supervised, r.id) for r in rows(2, 5, 6)]  # 6..18 tokens

    def forward_choices(model, b):  # in fp64 throughout (the library's takes the log-softmax in fp32)
        out = model(b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids,
                    segment_ids=b.segment_ids, logits_at=b.scored_positions)
        return out, F.log_softmax(out.logits, -1).gather(-1, b.target[:, None])[:, 0]
    params = [p for p in model.parameters() if p.requires_grad]
    packed = make_token_batch(data, 0, packed=True, max_length=30)
    assert packed.input_ids.shape[0] < len(data) and packed.segment_ids.max() >= 2  # several examples share a row
    _, logp = forward_choices(model, packed)
    want_grads = torch.autograd.grad(-logp.sum(), params, allow_unused=True)
    own, own_grads = [], None
    for row in data:
        _, lp = forward_choices(model, make_token_batch([row], 0))
        own.append(lp.detach())
        grads = torch.autograd.grad(-lp.sum(), params, allow_unused=True)
        own_grads = grads if own_grads is None else [a if b is None else b if a is None else a + b
                                                     for a, b in zip(own_grads, grads)]
    # to fp32 rounding: the routers' softmax runs in fp32 by design (core/routing_methods/routing.py); an example that saw
    # another's tokens or state would differ by 1e-2 or more
    torch.testing.assert_close(logp.detach(), torch.cat(own), rtol=1e-6, atol=1e-6)
    for a, b in zip(want_grads, own_grads):
        if a is not None or b is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
