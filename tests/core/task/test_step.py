"""core/task/step.py's step_loss against the paper's Eq. (total_loss) written out by hand.

L_total = L_CE + lambda_m * L_m, with L_m (Eq. averaged_training_losses) the mean of the per-token
objective over the supervised layers M and the step's supervised tokens B_tok: one pool of tokens
across micro-batches, so a micro-batch's share of L_m is its *tokens'* share of the step, not its
examples'. The two micro-batches below differ in gold-answer tokens per example, so the two
normalisers disagree.
"""
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from minimoe import from_pretrained, load_tokenizer
from minimoe.core.task.choices import forward_choices
from minimoe.core.routing_methods.objectives import load_balancing_loss
from minimoe.core.routing_methods.routing import moe_blocks
from minimoe.core.task.step import step_loss
from minimoe.data.benchmarks import load_examples
from minimoe.making.tiny import tiny_checkpoint
from minimoe.runs import training
from minimoe.runs.config import build_config

LAMBDA = 0.7
MY_OBJECTIVE = Path(__file__).resolve().parents[3] / "examples" / "my_objective.py"


def by_hand(model, batches, objective, detach_observed=False):
    """Eq. total_loss over the step's micro-batches, from the model's per-token outputs: (L_CE, L_m)."""
    ce_terms, examples, method_terms, tokens = [], 0, {}, 0  # method_terms: layer -> [per-token losses]
    for batch in batches:
        out, logp = forward_choices(model, batch)  # logp [n]: every candidate's answer tokens
        T = batch.input_ids.shape[1]
        for x, gold in enumerate(batch.gold.tolist()):  # answer-choice CE over each example's candidates
            cands = (batch.example == x).nonzero().flatten().tolist()
            means = torch.stack([logp[batch.cand == c].mean() for c in cands])
            ce_terms.append(-torch.log_softmax(means, 0)[gold])
            examples += 1
        gold_token = batch.choice[batch.cand] == batch.gold[batch.example[batch.cand]]  # [n]
        observed = -logp[gold_token]  # the gold answer's next-token CE, attached
        observed = observed.detach() if detach_observed else observed
        at = batch.row[gold_token] * T + batch.col[gold_token]  # its routing position, rows flattened
        tokens += len(at)
        for layer, routing in enumerate(out.routings):
            if routing.prediction is None:
                continue
            e = routing.prediction[at].float()
            if objective == "is":  # Eq. token_is_loss: L+/e - log(L+/e) - 1, L+ = max(L, eps)
                r = observed.clamp_min(1e-8) / e
                per_token = r - torch.log(r) - 1
            elif objective == "enll":  # Eq. token_enll_loss: L/e + log e
                per_token = observed / e + torch.log(e)
            else:  # examples/my_objective.py's squared log error: (log e - log L+)^2
                per_token = (torch.log(e) - torch.log(observed.clamp_min(1e-8))) ** 2
            method_terms.setdefault(layer, []).append(per_token)
    ce = torch.stack(ce_terms).sum() / examples
    layers = [torch.cat(v) for v in method_terms.values()]
    method = sum(v.sum() for v in layers) / (len(layers) * tokens)
    return ce, method


def setup(method, objective):
    """The tiny model with LoRA and `method` on every layer, and one step of two micro-batches whose
    gold answers have different token counts per example."""
    cfg = build_config({"method": method, "objective": objective, "layers": "all", "lambda_": LAMBDA,
                        "lora_dropout": 0.0, "batch_size": 2, "pad_token_id": 0, "device": "cpu",
                        "method_module": None if objective in ("is", "enll") else str(MY_OBJECTIVE)}, "tiny")
    tokenizer = load_tokenizer(tiny_checkpoint())
    examples = load_examples("arc_challenge")[:4]
    batches = training.micro_batches(examples, tokenizer, cfg, 0, 1)
    per_example = [b.supervised_tokens / b.gold.shape[0] for b in batches]
    assert len(batches) == 2 and per_example[0] != per_example[1], per_example  # the normalisers differ
    torch.manual_seed(0)
    model = from_pretrained(tiny_checkpoint())
    training.install_method(model, cfg)
    with torch.no_grad():  # LoRA's B starts at zero: move it, so that every path carries a gradient
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape) * 0.05)
    counts = {"examples": len(examples), "tokens": sum(b.supervised_tokens for b in batches),
              "rows": sum(b.input_ids.shape[0] for b in batches)}
    return cfg, model, batches, counts


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("objective", ["is", "enll", "sle"])
@pytest.mark.parametrize("method", ["acs", "tes"])
def test_step_loss_is_the_papers_total_loss_over_two_micro_batches(method, objective):
    """The logged terms and every trainable parameter's gradient equal those of L_CE + lambda * L_m
    over the pooled micro-batches, L_m normalised by the step's supervised tokens and layers; with an
    objective from a file of one's own (sle, examples/my_objective.py) as with the paper's two."""
    cfg, model, batches, counts = setup(method, objective)
    model.zero_grad(set_to_none=True)
    logs = step_loss(model, batches, cfg.method, counts, world_size=1, **training.loss_settings(cfg))
    got = grads(model)
    model.zero_grad(set_to_none=True)
    ce, method_term = by_hand(model, batches, objective)
    (ce + LAMBDA * method_term).backward()
    want = grads(model)
    assert float(logs["task"]) == pytest.approx(ce.item(), rel=1e-5)
    assert float(logs["method"]) == pytest.approx(method_term.item(), rel=1e-5)
    assert got.keys() == want.keys() and any("lora" in n for n in got)
    assert any("error_head" in n for n in got) == (method == "tes")  # TES's head trains through L_m alone
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-7, msg=name)


def test_answer_choices_past_the_loss_chunk_give_the_papers_total_loss():
    """--loss-chunk 3: each micro-batch's answer tokens (more than 3) go through the LM head 3 at a time, each chunk's
    logits recomputed in the backward (core/task/tokens.py), and step_loss is still Eq. total_loss by hand (the head
    on all answer tokens at once): its logged terms and every trainable parameter's gradient, TES with IS."""
    cfg, model, batches, counts = setup("tes", "is")
    assert all(b.target.shape[0] > 3 for b in batches)
    chunks = []
    model.lm_head.register_forward_hook(lambda module, args, out: chunks.append(out.shape[0]))
    model.zero_grad(set_to_none=True)
    logs = step_loss(model, batches, cfg.method, counts, world_size=1,
                     **training.loss_settings(replace(cfg, loss_chunk=3)))
    got = grads(model)
    assert max(chunks) == 3 and len(chunks) > 2 * len(batches)  # chunked, in the forward and again in the backward
    model.zero_grad(set_to_none=True)
    ce, method_term = by_hand(model, batches, "is")
    (ce + LAMBDA * method_term).backward()
    want = grads(model)
    assert float(logs["task"]) == pytest.approx(ce.item(), rel=1e-5)
    assert float(logs["method"]) == pytest.approx(method_term.item(), rel=1e-5)
    assert got.keys() == want.keys() and any("lora" in n for n in got)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize("method", ["acs", "tes"])
def test_the_observed_ce_stays_attached_in_the_method_term(method):
    """The method term's gradient flows through the observed CE too (the paper keeps it attached: IS and
    ENLL differ exactly in that gradient, objectives.py): step_loss's gradient of lambda * L_m (its
    lambda minus its lambda-zero gradient) is the attached one, measurably not the detached one."""
    cfg, model, batches, counts = setup(method, "is")

    def step(lambda_):
        model.zero_grad(set_to_none=True)
        step_loss(model, batches, replace(cfg.method, lambda_=lambda_), counts, world_size=1,
                  **training.loss_settings(cfg))
        return grads(model)
    with_term, without = step(LAMBDA), step(0.0)
    got = {n: with_term[n] - without[n] for n in with_term}
    expected = {}
    for detach in (False, True):
        model.zero_grad(set_to_none=True)
        (LAMBDA * by_hand(model, batches, "is", detach_observed=detach)[1]).backward()
        expected[detach] = grads(model)
    lora = [n for n in got if "lora" in n]
    for name in lora:
        torch.testing.assert_close(got[name], expected[False][name], rtol=1e-3, atol=1e-6, msg=name)
    # the test has power: detaching changes the LoRA gradients well beyond the tolerance above
    # (a detached CE leaves the final layer's experts no gradient from L_m at all: a zero)
    gap = max((expected[True].get(n, 0) - expected[False][n]).abs().max().item() for n in lora)
    assert gap > 1e-4


def test_the_load_balancing_term_reaches_the_gradient_times_its_coefficient():
    """Eq. total_loss's + aux_coef * L_aux: the routers' gates get aux_coef times L_aux's gradient, written
    out here (each micro-batch's loss over its rows' share of the step's rows), on top of the task's.
    Linear in the coefficient and not zero: a step that added L_aux unscaled (or dropped it) fails."""
    cfg, model, batches, counts = setup("ce", "is")
    gates = {f"model.layers.{i}.mlp.gate.weight": mlp.gate.weight for i, mlp in moe_blocks(model).items()}
    for w in gates.values():
        w.requires_grad_(True)

    def gate_grads(aux_coef):
        model.zero_grad(set_to_none=True)
        step_loss(model, batches, cfg.method, counts, world_size=1, aux_coef=aux_coef)
        return {n: w.grad.clone() for n, w in gates.items()}
    model.zero_grad(set_to_none=True)
    for batch in batches:  # d(L_aux)/d(gate) by hand
        out, _ = forward_choices(model, batch)
        (load_balancing_loss(out.routings, batch.attention_mask) * batch.input_ids.shape[0] / counts["rows"]).backward()
    aux = {n: w.grad.clone() for n, w in gates.items()}
    assert all(g.abs().max() > 1e-6 for g in aux.values())  # the term has a gradient to scale
    base = gate_grads(0.0)
    for coef in (0.01, 0.3):
        got = gate_grads(coef)
        for name in gates:
            torch.testing.assert_close(got[name] - base[name], coef * aux[name], rtol=1e-3, atol=1e-8, msg=name)
