"""Tests for minimoe.runs.training: transformers' Trainer schedule rules over the paper's recipes (tests/runs/test_config.py
writes its table out), and direct computation of the task loss, the selection rule and the learning-rate groups."""
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minimoe.cli import train
from tests.conftest import NEW_FAMILIES, oracle, tiny_model
from tests.runs.test_config import PAPER, resolved
from minimoe import from_pretrained, load_tokenizer
from minimoe.core.task.choices import format_choice, format_prompt
from minimoe.core.task.choices import forward_choices
from minimoe.core.routing_methods.esft import esft_layers
from minimoe.core.routing_methods.objectives import load_balancing_loss
from minimoe.core.task.step import step_loss
from minimoe.data.benchmarks import load_split
from minimoe.making.tiny import tiny_checkpoint
from minimoe.runs import training
from minimoe.core.adaptation.trainable import trainable_parameters
from minimoe.runs.config import build_config
from minimoe.runs.training import install_method, lr_factor, make_optimizer, warmup_steps, write_selection

transformers = oracle("transformers")  # its tests skip without the test extra

@pytest.mark.parametrize("recipe,dataset", [(r, d) for r in PAPER for d in ("arc_challenge", "sciq")])
def test_warmup_and_schedule_follow_transformers(recipe, dataset, tmp_path):
    """Warmup steps = transformers' Trainer rule; the factor per step = transformers' scheduler."""
    cfg = resolved(recipe)
    total = PAPER[recipe]["steps_per_epoch"][dataset] * cfg.epochs
    args = transformers.TrainingArguments(output_dir=str(tmp_path), warmup_ratio=cfg.warmup, report_to=[])
    warmup = warmup_steps(total, cfg.warmup)
    assert warmup == args.get_warmup_steps(total)
    if (recipe, dataset) == ("granite", "arc_challenge"):
        assert warmup == 19  # 0.05 * 375 = 18.75, rounded up
    make = (transformers.get_cosine_schedule_with_warmup if cfg.schedule == "cosine"
            else transformers.get_linear_schedule_with_warmup)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    ref = make(opt, warmup, total)
    for step in range(total + 1):
        assert lr_factor(step, total, warmup, cfg.schedule) == pytest.approx(ref.lr_lambdas[0](step), abs=1e-12)


def test_train_steps_and_learning_rates_per_step(tmp_path):
    """train.py end to end: 20 examples at 8 per step -> 3 steps per epoch (not 2); the logged learning
    rates are transformers' linear schedule with ceil(0.3 * 6) = 2 warmup steps."""
    run = tmp_path / "run"
    train.main(["--out-dir", str(tmp_path), "--run-name", "run", "--model", "tiny", "--data-dir", str(tmp_path / "splits"),
                "--quiet",
                "--no-test-eval", "--method", "ce", "--max-train-examples", "20", "--batch-size", "8",
                "--epochs", "2", "--warmup", "0.3"])
    steps = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "step"]
    assert len(steps) == 6
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=2e-3)
    ref = transformers.get_linear_schedule_with_warmup(opt, 2, 6)
    for record in steps:  # the rate logged after step s is the one the next step uses
        opt.step()
        ref.step()
        assert record["lr"] == pytest.approx(ref.get_last_lr()[0], rel=1e-12)


def test_task_loss_scores_candidates_by_mean_answer_log_prob(tmp_path):
    """Step 1's logged task loss (LoRA B = 0, so the base model) equals the candidates' CE computed here
    one row at a time: score = mean log p(answer token | prefix), then softmax over candidates."""
    run = tmp_path / "run"
    train.main(["--out-dir", str(tmp_path), "--run-name", "run", "--model", "tiny", "--data-dir", str(tmp_path / "splits"),
                "--quiet",
                "--no-test-eval", "--method", "ce", "--lora-dropout", "0", "--max-train-examples", "8",
                "--batch-size", "8", "--epochs", "1"])
    logged = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["task"]
    model, tokenizer = from_pretrained(tiny_checkpoint()).eval(), load_tokenizer(tiny_checkpoint())
    examples = load_split("arc_challenge", "train", data_dir=tmp_path / "splits")[:8]
    losses, lengths = [], set()
    with torch.no_grad():
        for ex in examples:
            prompt = tokenizer.encode(format_prompt(ex.question))
            scores = []
            for text in ex.choices:
                answer = tokenizer.encode(format_choice(text), add_special_tokens=False)
                ids = torch.tensor([prompt + answer])
                logp = model(ids).logits[0].float().log_softmax(-1)
                n = len(answer)
                lengths.add(n)
                picked = [logp[len(prompt) - 1 + j, answer[j]] for j in range(n)]
                scores.append(sum(picked) / n)
            losses.append(-torch.stack(scores).log_softmax(0)[ex.answer])
    assert len(lengths) > 1  # candidates of different lengths, so that mean and sum rank differently
    assert logged == pytest.approx(torch.stack(losses).mean().item(), rel=1e-5)


def write_metrics(run, nlls):
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"kind": "epoch", "epoch": e, "step": 10 * e, "val_choice_nll": v, "val_accuracy": 0.5}) + "\n"
        for e, v in enumerate(nlls, start=1)))


@pytest.mark.parametrize("nlls,selected", [([0.7, 0.5, 0.5], 2), ([0.5, 0.5, 0.5], 1), ([0.9, 0.8, 0.3], 3)])
def test_selection_minimum_validation_nll_ties_to_the_earlier_epoch(tmp_path, nlls, selected):
    write_metrics(tmp_path / "run", nlls)
    assert write_selection(tmp_path / "run")["selected_epoch"] == selected
    assert json.loads((tmp_path / "run" / "selection.json").read_text())["selected_epoch"] == selected


def method_cfg(recipe="olmoe", **settings):
    return build_config(settings, recipe)


@pytest.mark.parametrize("recipe", PAPER)
@pytest.mark.parametrize("method,tune,groups", [
    ("tes", False, {"lora": None, "error_head": 1e-5}),
    ("dual", False, {"lora": None, "copied_head": 1e-3}),
    ("ce", True, {"lora": None, "router": None}),  # a tuned gate: the LoRA rate (the paper gives none)
    ("acs", True, {"lora": None, "router": None}),
])
def test_learning_rate_groups(recipe, method, tune, groups):
    model = tiny_model("olmoe")
    cfg = method_cfg(recipe, method=method, tune_router=tune)
    install_method(model, cfg)
    lrs = {g["name"]: g["lr"] for g in make_optimizer(model, cfg).param_groups}
    assert lrs == {name: PAPER[recipe]["lr"] if lr is None else lr for name, lr in groups.items()}
    if tune:
        install_method(model := tiny_model("olmoe"), cfg := replace(cfg, router_lr=3e-3))
        assert {g["name"]: g["lr"] for g in make_optimizer(model, cfg).param_groups}["router"] == 3e-3


@pytest.mark.parametrize("method,group,lr", [("tes", "error_head", 3e-4), ("dual", "copied_head", 2e-2)])
def test_the_optimizer_groups_the_parameters_by_the_method_it_is_given(method, group, lr):
    """make_optimizer's one source is the run's configured method (cfg.method): the heads' groups and their
    rates both come from it (Method.head_groups), not the groups from the model's own record of what is
    installed."""
    model = tiny_model("olmoe")
    cfg = method_cfg(method=method, method_options={f"{group}_lr": lr})
    install_method(model, cfg)
    model.router_method = None  # what the model says it holds is not read
    groups = make_optimizer(model, cfg).param_groups
    assert {g["name"]: g["lr"] for g in groups} == {"lora": cfg.lr, group: lr}
    assert [n for n, p in model.named_parameters() if p.requires_grad and ".mlp.router." in n]
    heads = {id(p) for n, p in model.named_parameters() if ".mlp.router." in n and p.requires_grad}
    assert {id(p) for g in groups if g["name"] == group for p in g["params"]} == heads


@pytest.mark.parametrize("family", ["granitemoe", "olmoe", *NEW_FAMILIES])  # dense layers, shared experts, windows
@pytest.mark.parametrize("method,tune", [("tes", False), ("dual", False), ("ce", True), ("acs", True),
                                         ("tes", True), ("dual", True)])
def test_trainable_parameters_are_fp32_on_a_bf16_base(family, method, tune):
    """Every trainable parameter (LoRA, error head, copied head, tuned gate) is stored in fp32; the
    frozen base stays bf16; a training step runs and gives them fp32 gradients."""
    model = tiny_model(family).to(torch.bfloat16)
    install_method(model, method_cfg(method=method, tune_router=tune, layers="all"))
    groups = trainable_parameters(model)
    heads = {"tes": {"error_head"}, "dual": {"copied_head"}}.get(method, set())
    expected = {"lora"} | heads | ({"router"} if tune else set())
    assert {g for g, params in groups.items() if params} == expected
    for name, p in model.named_parameters():
        assert p.dtype == (torch.float32 if p.requires_grad else torch.bfloat16), name
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    logits = model(ids).logits
    F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
    for name, p in model.named_parameters():
        if p.requires_grad and ".lora_A" not in name:  # lora_A gets no gradient while B = 0
            assert p.grad is not None and p.grad.dtype == torch.float32, name


@pytest.mark.parametrize("family", ["granitemoe", "olmoe"])
def test_fp32_heads_and_tuned_gate_keep_bf16_logits_bitwise_at_init(family):
    """Cast at use: the copied head and a tuned fp32 gate compute their logits in bf16 as the frozen
    gate does, so at init the bf16 model's output is bit for bit the native one."""
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    ref = tiny_model(family).to(torch.bfloat16)(ids).logits
    for method, tune in (("dual", False), ("ce", True)):
        model = tiny_model(family).to(torch.bfloat16)
        install_method(model, method_cfg(method=method, tune_router=tune, layers="all"))
        assert torch.equal(model(ids).logits, ref), (method, tune)


def test_a_rank_without_examples_runs_a_placeholder_that_counts_zero(tmp_path):
    """5 examples, micro-batches of 4, two ranks: the second micro-batch (example 4) has nothing for rank 1.
    Rank 1 must still run a forward/backward (DDP all-reduces every backward), and that pass must add
    nothing: the step's terms and gradients are those of its real micro-batches alone."""
    tokenizer = load_tokenizer(tiny_checkpoint())
    examples = load_split("arc_challenge", "train", data_dir=tmp_path / "splits")[:5]
    cfg = replace(method_cfg("tiny", method="tes"), lora_dropout=0.0, batch_size=4, pad_token_id=0, device="cpu")
    rank0, rank1 = (training.micro_batches(examples, tokenizer, cfg, rank, 2) for rank in (0, 1))
    assert [b.placeholder for b in rank0] == [False, False] and [b.placeholder for b in rank1] == [False, True]
    assert rank0[1].gold.shape == (1,) and torch.equal(rank1[1].input_ids, rank0[1].input_ids)  # example 4 twice

    model = from_pretrained(tiny_checkpoint())
    training.install_method(model, cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    counts = {"examples": 2, "tokens": rank1[0].supervised_mask.sum().item(), "rows": rank1[0].input_ids.shape[0]}

    def run(batches):
        model.zero_grad(set_to_none=True)
        logs = step_loss(model, batches, cfg.method, counts, world_size=1, **training.loss_settings(cfg))
        return logs, [p.grad.clone() for p in params]
    (alone, grads), (with_placeholder, grads_with) = run(rank1[:1]), run(rank1)
    assert with_placeholder == alone and alone["method"] != 0
    for g, h in zip(grads, grads_with):
        assert torch.equal(g, h)



def manifest_folder(tmp_path, train_examples, val=2, test=2) -> Path:
    """A manifest folder: `train_examples` as train.jsonl, and the next offline ARC-Challenge examples after
    the first 40 as a small val and test (fast validation)."""
    from dataclasses import asdict

    from minimoe.data.benchmarks import load_examples
    pool = load_examples("arc_challenge")[40:]
    folder = tmp_path / "data"
    folder.mkdir()
    for split, rows in (("train", train_examples), ("val", pool[:val]), ("test", pool[val:val + test])):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(asdict(ex)) + "\n" for ex in rows))
    return folder


def test_epoch_e_shuffles_the_training_examples_with_seed_plus_e(tmp_path, monkeypatch):
    """The documented data order, step by step: epoch e takes torch.randperm(n) drawn with seed + e, in
    consecutive slices of batch_size * grad_accum (the last one partial), recorded from the loop itself."""
    from minimoe.data.benchmarks import load_examples
    examples = load_examples("arc_challenge")[:10]
    seen = []
    real = training.micro_batches

    def spy(batch, *args):
        seen.append([ex.id for ex in batch])
        return real(batch, *args)
    monkeypatch.setattr(training, "micro_batches", spy)
    train.main(["--out-dir", str(tmp_path), "--run-name", "run", "--model", "tiny", "--data", str(manifest_folder(tmp_path, examples)),
                "--quiet", "--no-test-eval", "--method", "ce", "--batch-size", "2", "--grad-accum", "2", "--epochs", "3",
                "--seed", "5"])
    expected = []
    for epoch in (1, 2, 3):
        order = torch.randperm(10, generator=torch.Generator().manual_seed(5 + epoch)).tolist()
        expected += [[examples[i].id for i in order[s:s + 4]] for s in (0, 4, 8)]
    assert seen == expected
    assert len({tuple(seen[3 * e]) for e in range(3)}) == 3  # the epochs' orders differ


def test_two_micro_batches_give_the_aux_and_method_terms_of_one_full_batch():
    """--grad-accum 2 = one batch for every term, the load-balancing one included. The Switch loss is a
    product of means, so this holds exactly where each micro-batch holds the same mix as the full
    batch: [a, a, b, b] twice. Its value is then the full batch's (= each half's), not twice it."""
    from minimoe.data.benchmarks import load_examples
    tokenizer = load_tokenizer(tiny_checkpoint())
    a, b = load_examples("arc_challenge")[:2]
    examples = [replace(ex, id=f"{ex.id}-{i}") for i, ex in enumerate([a, a, b, b, a, a, b, b])]
    results = []
    for batch_size, accum in ((8, 1), (4, 2)):
        cfg = replace(method_cfg("tiny", method="acs"), lora_dropout=0.0, aux_coef=0.5, batch_size=batch_size,
                      grad_accum=accum, pad_token_id=0, device="cpu", clip=1e9)
        torch.manual_seed(0)
        model = from_pretrained(tiny_checkpoint())
        install_method(model, cfg)
        model.train()
        batches = training.micro_batches(examples, tokenizer, cfg, 0, 1)
        assert len(batches) == accum
        if accum == 1:  # the full batch's own load-balancing loss (= transformers', tests/core/decoder/test_model.py)
            with torch.no_grad():
                out = forward_choices(model, batches[0])[0]
                full_batch_aux = load_balancing_loss(out.routings, batches[0].attention_mask).item()
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        before = {n: p.detach().clone() for n, p in params.items()}
        optimizer = torch.optim.SGD(params.values(), lr=1.0)  # the update is minus the step's gradient
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        logs = training.optimizer_step(model, batches, len(examples), optimizer, scheduler, cfg, world_size=1)
        results.append((logs, {n: before[n] - p.detach() for n, p in params.items()}))
    (full, full_grads), (accumulated, accumulated_grads) = results
    assert full["aux"] == pytest.approx(full_batch_aux, rel=1e-6) and full["method"] > 0
    for key in ("task", "method", "aux", "grad_norm"):
        assert accumulated[key] == pytest.approx(full[key], rel=1e-5), key
    for name in full_grads:
        torch.testing.assert_close(accumulated_grads[name], full_grads[name], rtol=1e-4, atol=1e-7, msg=name)


def test_the_loops_hooks_see_each_position_a_checkpoint_resumes_from(tmp_path):
    """train's on_step and on_epoch_end (tests/kill.py's kill points) are called after every optimizer step
    and every epoch with where training stands: 10 examples at 4 a step are 3 steps an epoch (the last
    partial), and the position equals the newest checkpoint's (--save-every-steps 1: a step checkpoint
    after each step but an epoch's last, whose checkpoint is the epoch's, written after validation)."""
    from functools import partial
    from unittest import mock

    from minimoe.data.benchmarks import load_examples
    from minimoe.runs.run_folder import latest_checkpoint
    seen = {"step": [], "epoch": []}
    run = tmp_path / "run"

    def hook(kind, position):
        _, state = latest_checkpoint(run)
        seen[kind].append((position, training.Position(state["epoch"], state.get("epoch_step", 0), state["step"])))
    data = manifest_folder(tmp_path, load_examples("arc_challenge")[:10])
    with mock.patch.object(train, "train", partial(training.train, on_step=partial(hook, "step"),
                                                   on_epoch_end=partial(hook, "epoch"))):
        train.main(["--out-dir", str(tmp_path), "--run-name", "run", "--model", "tiny", "--data", str(data),
                    "--quiet", "--no-test-eval", "--method", "ce", "--batch-size", "4", "--epochs", "2",
                    "--save-every-steps", "1"])
    P = training.Position
    assert [p for p, _ in seen["step"]] == [P(0, 1, 1), P(0, 2, 2), P(0, 3, 3), P(1, 1, 4), P(1, 2, 5), P(1, 3, 6)]
    assert [p for p, _ in seen["epoch"]] == [P(1, 0, 3), P(2, 0, 6)]
    assert all(p == saved for p, saved in seen["epoch"] + [s for s in seen["step"] if s[0].epoch_step < 3])


@pytest.mark.parametrize("recipe", PAPER)
def test_the_esft_full_forms_rows_train_at_the_releases_rate(recipe):
    """ESFT's full form: the chosen experts' rows are the only group, at esft_lr's default 1e-5 (the public
    release's), whatever the recipe's LoRA rate; --esft-lr sets it."""
    for options, want in (({"esft_form": "full"}, 1e-5), ({"esft_form": "full", "esft_lr": 3e-4}, 3e-4)):
        model = tiny_model("olmoe")
        cfg = method_cfg(recipe, method="esft", method_options=options)
        install_method(model, cfg)
        rows = []
        for mlp in esft_layers(model).values():  # a choice, as prepare makes from the data
            mlp.router.chosen[:2] = True
            mlp.router.take_rows(mlp)
            rows += list(mlp.router.rows.values())
        groups = make_optimizer(model, cfg).param_groups
        assert {g["name"]: g["lr"] for g in groups} == {"esft": want}
        assert {id(p) for g in groups for p in g["params"]} == {id(p) for p in rows}
