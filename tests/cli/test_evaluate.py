"""Tests for evaluate.py and minimoe.evaluation.accuracy: each test names the reference it checks against
(transformers, a recount from the written files, hand-computed statistics) or the bad input.

Models are tiny random OLMoE/Granite checkpoints saved in tmp with a BPE tokenizer trained on a
toy manifest (train/val/test.jsonl), so nothing here reads a benchmark or the network.
"""
import json
import math
import random
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

from minimoe.cli import evaluate
from minimoe.core.decoder.model import MoEConfig, MoEForCausalLM, init_weights
from minimoe.core.routing_methods.routing import ConcentrationRouter, Scoring, native_concentration
from minimoe.data.benchmarks import EOS_TOKEN, PAD_TOKEN, Example, train_tokenizer
from minimoe.evaluation.accuracy import TokenArrays, diagnostics_report, evaluate_split, json_safe
from minimoe.loading.checkpoint import from_pretrained, save_pretrained
from minimoe.runs.run_folder import resolve_adapter

WORDS = ("red", "blue", "green", "stone", "water", "light", "heavy", "plant", "animal", "energy", "metal", "cloud",
         "river", "sun", "moon", "seed", "leaf", "magnet", "sound", "heat", "ice", "salt", "sugar", "wind")
GRANITE = dict(tie_word_embeddings=True, embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=6.0,
               attention_multiplier=0.1)


def toy_examples(split: str, n: int, seed: int) -> list[Example]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        question = f"Which {rng.choice(WORDS)} makes the {rng.choice(WORDS)} {rng.choice(WORDS)}?"
        choices = set()
        while len(choices) < rng.choice((3, 4, 4)):
            choices.add(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3))))
        choices = sorted(choices)
        out.append(Example(f"toy:{split}:{i}", question, choices, rng.randrange(len(choices)),
                           {"dataset": "toy", "partition": split, "source_id": str(i)}))
    return out


def write_manifest(path: Path, examples) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(asdict(ex)) + "\n" for ex in examples), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """Manifests (train 30, val 6, test 12) and one tiny checkpoint per family sharing a tokenizer."""
    root = tmp_path_factory.mktemp("toy")
    splits = {"train": toy_examples("train", 30, 0), "val": toy_examples("val", 6, 1), "test": toy_examples("test", 12, 2)}
    for split, exs in splits.items():
        write_manifest(root / "data" / f"{split}.jsonl", exs)
    texts = [t for exs in splits.values() for ex in exs for t in (ex.question, *ex.choices)]
    tokenizer = train_tokenizer(texts, vocab_size=300)  # small vocab: answers span several tokens
    vocab = -(-tokenizer.get_vocab_size() // 8) * 8
    models = {}
    for family in ("olmoe", "granitemoe"):
        config = MoEConfig(model_type=family, vocab_size=vocab, hidden_size=32, intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                           num_experts_per_tok=2, norm_topk_prob=True, eos_token_id=tokenizer.token_to_id(EOS_TOKEN),
                           pad_token_id=tokenizer.token_to_id(PAD_TOKEN), **(GRANITE if family == "granitemoe" else {}))
        model = init_weights(MoEForCausalLM(config), std=0.2, generator=torch.Generator().manual_seed(0))
        save_pretrained(model, root / family)
        tokenizer.save(str(root / family / "tokenizer.json"))
        models[family] = root / family
    return {"root": root, "data": root / "data", "models": models, "splits": splits}


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def no_leftovers(out: Path):
    """Neither the output folder nor an atomic_directory temp folder beside it."""
    return not out.exists() and not list(out.parent.glob(f".{out.name}.*"))


# ---- scoring ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["olmoe", "granitemoe"])
def test_scores_match_transformers_unbatched(toy, family, tmp_path):
    """Reference: log p(answer tokens | prompt) per candidate, one unpadded row at a time, through
    transformers' eager model on the same folder; ours comes batched and padded from the CLI."""
    from tokenizers import Tokenizer
    AutoModelForCausalLM = pytest.importorskip("transformers").AutoModelForCausalLM

    folder, out = toy["models"][family], tmp_path / "out"
    evaluate.main(["--model", str(folder), "--data", str(toy["data"] / "test.jsonl"), "--out-dir", str(out),
                   "--eval-batch-size", "4", "--max-examples", "5"])
    records = read_jsonl(out / "predictions.jsonl")
    ref = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for ex, rec in zip(toy["splits"]["test"][:5], records):
        assert rec["id"] == ex.id and rec["gold"] == ex.answer
        prompt = tok.encode(f"Question: {ex.question}\nAnswer:").ids
        for c, text in enumerate(ex.choices):
            answer = tok.encode(" " + text, add_special_tokens=False).ids
            with torch.no_grad():
                logp = ref(torch.tensor([prompt + answer])).logits[0].float().log_softmax(-1)
            # Position t predicts token t+1: the answer's tokens are predicted from len(prompt)-1 on.
            picked = logp[len(prompt) - 1:-1].gather(-1, torch.tensor(answer)[:, None])[:, 0].double()
            assert rec["n_tokens"][c] == len(answer)
            assert rec["logprob_sum"][c] == pytest.approx(picked.sum().item(), abs=1e-4)
            assert rec["logprob_mean"][c] == pytest.approx(picked.mean().item(), abs=1e-4)
            assert rec["logprob_per_char"][c] == pytest.approx(picked.sum().item() / len(text), abs=1e-4)


def test_cli_writes_consistent_outputs(toy, tmp_path):
    """metrics.json against a recount from predictions.jsonl: the three accuracies (argmax, first on
    ties), choice NLL = mean CE over candidates scored by mean log-prob; the identity keys of a base
    model; diagnostics of its final layer over exactly the gold answers' tokens."""
    out = tmp_path / "eval"
    evaluate.main(["--model", str(toy["models"]["olmoe"]), "--data", str(toy["data"] / "test.jsonl"),
                   "--out-dir", str(out), "--eval-batch-size", "5"])
    assert sorted(p.name for p in out.iterdir()) == [".minimoe-written", "metrics.json", "predictions.jsonl",
                                                     "tokens-test.npz"]
    metrics, records = json.loads((out / "metrics.json").read_text()), read_jsonl(out / "predictions.jsonl")
    assert [r["id"] for r in records] == [ex.id for ex in toy["splits"]["test"]]  # input order, not length order
    assert metrics["n_examples"] == len(records) == 12
    for key, field in (("accuracy", "logprob_mean"), ("accuracy_sum", "logprob_sum"),
                       ("accuracy_per_char", "logprob_per_char")):
        argmax = [int(np.argmax(r[field])) for r in records]
        assert metrics[key] == sum(a == r["gold"] for a, r in zip(argmax, records)) / len(records)
    assert [r["prediction"] for r in records] == [int(np.argmax(r["logprob_mean"])) for r in records]
    for r in records:
        assert r["logprob_mean"] == pytest.approx([s / n for s, n in zip(r["logprob_sum"], r["n_tokens"])], abs=1e-5)
        assert r["logprob_per_char"] == pytest.approx([s / n for s, n in zip(r["logprob_sum"], r["n_chars"])], abs=1e-5)
    nll = [-(r["logprob_mean"][r["gold"]] - math.log(sum(math.exp(s) for s in r["logprob_mean"]))) for r in records]
    assert metrics["choice_nll"] == pytest.approx(np.mean(nll), abs=1e-5)
    assert (metrics["model"], metrics["method"], metrics["seed"], metrics["split"], metrics["adapter"]) == (
        str(toy["models"]["olmoe"]), "native", None, "test", None)

    layer = metrics["diagnostics"]["layers"]["1"]["test"]  # no router spec: the final of 2 layers
    assert list(metrics["diagnostics"]["layers"]) == ["1"]
    assert layer["tokens"] == sum(r["n_tokens"][r["gold"]] for r in records)
    assert 0.5 <= layer["C_bar"] <= 1 and layer["N_eff"] == pytest.approx(1 / layer["C_bar"])
    tokens = np.load(out / "tokens-test.npz")
    assert layer["C_bar"] == pytest.approx(tokens["concentration_layer1"].mean())
    assert layer["r"] == pytest.approx(np.corrcoef(tokens["concentration_layer1"], tokens["token_ce"])[0, 1])
    # The gold answers' token CEs sum to minus their summed log-probs.
    assert tokens["token_ce"].sum() == pytest.approx(-sum(r["logprob_sum"][r["gold"]] for r in records), abs=1e-3)


def test_batch_size_and_order_do_not_change_scores(toy):
    """One example per forward (no padding) against five per forward (padded, length-sorted)."""
    from minimoe.loading.tokenizer import load_tokenizer
    folder = toy["models"]["granitemoe"]
    model, tokenizer = from_pretrained(folder), load_tokenizer(folder)
    one, m1, a1 = evaluate_split(model, tokenizer, toy["splits"]["test"], batch_size=1)
    five, m5, a5 = evaluate_split(model, tokenizer, toy["splits"]["test"], batch_size=5)
    for r1, r5 in zip(one, five):
        assert r1["id"] == r5["id"] and r1["n_tokens"] == r5["n_tokens"]
        assert r1["logprob_sum"] == pytest.approx(r5["logprob_sum"], abs=1e-4)
    assert m1["accuracy"] == m5["accuracy"]
    order1, order5 = np.lexsort((a1.token_ce, a1.example)), np.lexsort((a5.token_ce, a5.example))
    assert np.allclose(a1.concentration[1][order1], a5.concentration[1][order5], atol=1e-5)


def test_evaluation_and_validation_run_in_trainings_autocast(toy, tmp_path, monkeypatch):
    """evaluate.py's forwards run in the autocast that runs.device.autocast_for picks for the model's device
    and dtype, and train.py's validation in the one it picks for the run's: the training step's policy."""
    from contextlib import contextmanager

    from minimoe.evaluation import accuracy
    from minimoe.runs import eval_run, training
    from minimoe.runs.config import TrainConfig
    from minimoe.runs.recipes import RECIPES
    calls, inside, forwards = [], [], []

    @contextmanager
    def context():
        inside.append(1)
        yield
        inside.pop()

    def forward_choices(*args, **kwargs):
        forwards.append(bool(inside))
        return original(*args, **kwargs)
    original = accuracy.forward_choices
    monkeypatch.setattr(accuracy, "forward_choices", forward_choices)

    def policy(device, dtype):
        calls.append((torch.device(device).type, str(dtype).removeprefix("torch.")))
        return context()
    monkeypatch.setattr(eval_run, "autocast_for", policy)
    monkeypatch.setattr(training, "autocast_for", policy)
    folder = toy["models"]["olmoe"]
    evaluate.main(["--model", str(folder), "--data", str(toy["data"] / "test.jsonl"), "--out-dir", str(tmp_path / "e"),
                   "--eval-batch-size", "5", "--dtype", "bfloat16"])
    assert calls == [("cpu", "bfloat16")] * 3 and forwards == [True] * 3  # 12 examples, 5 a forward
    calls.clear()
    from minimoe.loading.tokenizer import load_tokenizer
    cfg = TrainConfig(**RECIPES["tiny"], device="cpu", dtype="bfloat16", eval_batch_size=5, quiet=True)
    training.score_split(from_pretrained(folder, dtype="bfloat16"), load_tokenizer(folder), toy["splits"]["test"], cfg)
    assert calls == [("cpu", "bfloat16")] * 3 and forwards == [True] * 6


def test_scoring_turns_lora_dropout_off_and_restores_train_mode(toy):
    """A trainer's model in train mode with dropout 0.5: two scorings agree exactly (dropout was off)
    and every module is back in train mode afterwards."""
    from minimoe.core.adaptation import lora
    from minimoe.loading.tokenizer import load_tokenizer
    folder = toy["models"]["olmoe"]
    model = lora.add_lora(from_pretrained(folder), rank=4, dropout=0.5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".lora_B"):
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(0))
    model.train()
    examples = toy["splits"]["val"]
    first = evaluate_split(model, load_tokenizer(folder), examples, batch_size=3, diagnostics=False)[0]
    second = evaluate_split(model, load_tokenizer(folder), examples, batch_size=3, diagnostics=False)[0]
    assert first == second
    assert all(m.training for m in model.modules())


# ---- diagnostics -----------------------------------------------------------------------------------

def test_diagnostic_concentration_by_hand_and_against_the_router():
    """p = (.4, .3, .2, .1), K = 2: pbar = (4/7, 3/7), C = 25/49 (Eq. diagnostic_token_concentration);
    and on random logits the evaluation's C_t equals what the acs policy supervises."""
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    assert native_concentration(logits, 2)[0].item() == pytest.approx(25 / 49, abs=1e-7)
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(0)) * 3
    for renormalize in (True, False):  # C_t renormalises over the K whatever the combine weights do
        ours = native_concentration(logits, 2).double().numpy()
        theirs = ConcentrationRouter(Scoring(2, renormalize))(None, logits).prediction.double().numpy()
        assert np.allclose(ours, theirs, atol=1e-6)


def test_diagnostics_on_synthetic_tokens_with_known_answers():
    """C_bar is the token mean, N_eff = 1 / C_bar (not mean 1/C_t), r the Pearson of Eq.
    diagnostic_concentration_loss_correlation. e_hat = 3 CE + 1 gives pointwise, group r and rho of 1.
    A test population whose CE is the train's + 1 sits 1/sd_train(obs groups) higher in every decile,
    because both populations are standardised with the train groups' moments."""
    rng = np.random.default_rng(0)
    n = 200
    target = rng.integers(0, 40, n)
    ce = target * 0.1 + rng.uniform(0, 0.01, n)  # strictly increasing in the token id, up to noise
    conc = rng.uniform(0.5, 1.0, n)
    train = TokenArrays(ce, target, np.arange(n), {3: conc}, {3: 3 * ce + 1})
    test = TokenArrays(ce + 1, target, np.arange(n), {3: np.full(n, 0.5)}, {3: 3 * ce + 1})
    report, plots = diagnostics_report(test, "test", train)
    layer = report["layers"]["3"]
    assert report["populations"] == ["train", "test"]
    assert layer["train"]["C_bar"] == pytest.approx(conc.mean())
    assert layer["train"]["N_eff"] == pytest.approx(1 / conc.mean()) != pytest.approx(np.mean(1 / conc))
    assert layer["train"]["r"] == pytest.approx(np.corrcoef(conc, ce)[0, 1])
    assert math.isnan(layer["test"]["r"])  # constant C_t: undefined, not 0 ...
    assert json_safe(layer)["test"]["r"] is None  # ... and null in JSON
    for split in ("train", "test"):
        assert layer[split]["pointwise_r"] == pytest.approx(1.0)
        assert layer[split]["group_r"] == pytest.approx(1.0) and layer[split]["group_rho"] == pytest.approx(1.0)
    obs_sd = layer["reference_moments"]["obs_std"]
    shift = np.subtract(layer["test"]["deciles"]["obs_mean"], layer["train"]["deciles"]["obs_mean"])
    assert np.allclose(shift, 1 / obs_sd)
    assert np.allclose(layer["test"]["deciles"]["pred_mean"], layer["train"]["deciles"]["pred_mean"])
    assert list(plots) == ["error-prediction-layer3.png"] and layer["plot"] == "error-prediction-layer3.png"
    # Two tes layers: a pooled entry whose groups are (layer, token), so twice each layer's groups.
    two = TokenArrays(ce, target, np.arange(n), {2: conc, 3: conc}, {2: 2 * ce, 3: 3 * ce + 1})
    report, plots = diagnostics_report(two, "test", train=TokenArrays(ce, target, np.arange(n), {2: conc, 3: conc},
                                                                       {2: 2 * ce, 3: 3 * ce + 1}))
    pooled = report["pooled"]
    assert pooled["layers"] == [2, 3] and pooled["test"]["groups"] == 2 * report["layers"]["3"]["test"]["groups"]
    assert pooled["test"]["pointwise_r"] < 1 and pooled["test"]["group_rho"] < 1  # the layers' scales differ
    assert sorted(plots) == ["error-prediction-layer2.png", "error-prediction-layer3.png", "error-prediction-pooled.png"]
    # Too few groups for ten bins: the deciles are skipped with a reason, not an exception.
    few = TokenArrays(ce[:20], np.arange(20) % 5, np.arange(20), {3: conc[:20]}, {3: ce[:20] + 1})
    report, plots = diagnostics_report(few, "test", few)
    assert report["layers"]["3"]["test"]["deciles"] is None and not plots


def tes_run(toy, run: Path, seed: int = 43) -> Path:
    """A run folder as train.py writes it: a tes adapter per epoch (different weights), selection.json."""
    from minimoe.core.routing_methods import methods
    from minimoe.core.adaptation.lora import add_lora
    from minimoe.runs.adapters import save_adapter
    from minimoe.runs.config import method_for
    folder = toy["models"]["olmoe"]
    for epoch in (1, 2):
        model = add_lora(from_pretrained(folder), rank=4)
        methods.set_router(model, method_for({"method": "tes", "objective": "is"}))  # config.json's below
        g = torch.Generator().manual_seed(epoch)
        with torch.no_grad():  # trained-looking weights: a non-constant error head, nonzero LoRA B
            for name, p in model.named_parameters():
                if ".router.error_head." in name or name.endswith(".lora_B"):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        save_adapter(model, run / "checkpoints" / f"epoch-{epoch}", base_model=str(folder))
    config = {"model": str(folder), "data": str(toy["data"]), "data_dir": "unused", "seed": seed, "method": "tes",
              "objective": "is", "tune_router": False, "label": "TES-IS", "max_length": 512}
    (run / "config.json").write_text(json.dumps(config))
    (run / "selection.json").write_text(json.dumps({"selected_epoch": 1, "last_epoch": 2, "rule": "min val choice_nll"}))
    return run


def test_tes_run_folder_gives_error_prediction_diagnostics_and_plot(toy, tmp_path):
    """--adapter RUN alone: model and data from config.json, the last epoch's adapter, the run's label
    and seed; tes readouts give e_hat statistics on test and on the automatically scored train split."""
    run, out = tes_run(toy, tmp_path / "run"), tmp_path / "eval"
    metrics = evaluate.main(["--adapter", str(run), "--out-dir", str(out), "--eval-batch-size", "8"])
    assert (metrics["model"], metrics["method"], metrics["seed"], metrics["epoch"], metrics["checkpoint"]) == (
        str(toy["models"]["olmoe"]), "TES-IS", 43, 2, "last")
    assert metrics["adapter"] == str(run / "checkpoints" / "epoch-2") and metrics["router"]["name"] == "tes"
    diag = metrics["diagnostics"]
    assert diag["populations"] == ["train", "test"] and diag["train_examples"] == 30
    layer = diag["layers"]["1"]
    for split in ("train", "test"):
        assert {"C_bar", "N_eff", "r", "pointwise_r", "group_r", "group_rho", "groups", "deciles"} <= set(layer[split])
        assert len(layer[split]["deciles"]["obs_mean"]) == 10
    png = out / layer["plot"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    tokens = np.load(out / "tokens-test.npz")
    assert layer["test"]["pointwise_r"] == pytest.approx(np.corrcoef(tokens["e_hat_layer1"], tokens["token_ce"])[0, 1])
    assert (out / "tokens-train.npz").is_file()
    assert json.loads((out / "metrics.json").read_text()) == metrics
    assert (metrics["dataset"], metrics["max_length"], metrics["dtype"]) == ("data", 512, "float32")

    # train.py's route: the model it holds (here: rebuilt from the last epoch) gives the same file.
    from minimoe.loading.tokenizer import load_tokenizer
    from minimoe.runs.adapters import load_adapter
    from minimoe.runs.eval_run import evaluate_run
    model = load_adapter(from_pretrained(toy["models"]["olmoe"]), run / "checkpoints" / "epoch-2")
    in_memory = evaluate_run(run, model=model, tokenizer=load_tokenizer(toy["models"]["olmoe"]), batch_size=8)
    # provenance: the loading process's for evaluate.py, the training process's (config.json) in memory
    assert in_memory.pop("provenance") is None and metrics.pop("provenance")["weights"]["source"] == "local"
    assert in_memory == metrics
    written = json.loads((run / "eval" / "test" / "metrics.json").read_text())
    assert written.pop("provenance") is None and written == metrics

    selected = resolve_adapter(run, "selected")
    assert (selected.folder, selected.epoch, selected.router["name"]) == (run / "checkpoints" / "epoch-1", 1, "tes")
    in_run = resolve_adapter(run / "checkpoints" / "epoch-1")  # a checkpoint folder keeps its run's identity
    assert (in_run.run, in_run.epoch, in_run.run_config["label"]) == (run, 1, "TES-IS")


def test_train_population_of_a_cut_run_is_exactly_its_trained_examples(toy, tmp_path, monkeypatch):
    """A TES run cut by --max-train-examples 7 (of 30): the train-side diagnostics, at the end of
    train.py and from evaluate.py --adapter RUN, score exactly the examples the loop trained on
    (recorded from the loop), not the uncut split."""
    from minimoe.cli import train
    from minimoe.runs import eval_run
    from minimoe.runs import training
    trained, scored = set(), []
    real_batches, real_evaluate = training.micro_batches, eval_run.evaluate_split

    def record_trained(examples, *args):
        trained.update(ex.id for ex in examples)
        return real_batches(examples, *args)

    def record_scored(model, tokenizer, examples, **kw):
        scored.append([ex.id for ex in examples])
        return real_evaluate(model, tokenizer, examples, **kw)
    monkeypatch.setattr(training, "micro_batches", record_trained)
    monkeypatch.setattr(eval_run, "evaluate_split", record_scored)
    train.main(["--out-dir", str(tmp_path), "--run-name", "run", "--model", "tiny", "--data", str(toy["data"]),
                "--method", "tes", "--max-train-examples", "7", "--batch-size", "4", "--epochs", "1", "--quiet"])
    run = tmp_path / "run"
    assert trained == {ex.id for ex in toy["splits"]["train"][:7]}
    test_ids = [ex.id for ex in toy["splits"]["test"]]
    out = evaluate.main(["--adapter", str(run), "--out-dir", str(tmp_path / "again"), "--eval-batch-size", "8"])
    at_end = json.loads((run / "eval" / "test" / "metrics.json").read_text())
    assert [sorted(ids) for ids in scored] == [sorted(test_ids), sorted(trained)] * 2  # train.py's, evaluate.py's
    for metrics, folder in ((at_end, run / "eval" / "test"), (out, tmp_path / "again")):
        assert metrics["diagnostics"]["populations"] == ["train", "test"]
        assert metrics["diagnostics"]["train_examples"] == 7
        with np.load(folder / "tokens-train.npz") as z:
            assert sorted(set(z["example"].tolist())) == list(range(7))


# ---- report ----------------------------------------------------------------------------------------

def test_report_table_mean_and_sample_std(tmp_path, capsys):
    """Three seeds at 60/70/80 % -> 70.00 ± 10.00 (sample std); a base-model evaluation (seed null)
    and a val evaluation are skipped, not counted."""
    def fake(name, method, dataset, seed, accuracy, split="test"):
        folder = tmp_path / "runs" / name
        folder.mkdir(parents=True)
        (folder / "metrics.json").write_text(json.dumps(
            {"model": "granite", "method": method, "dataset": dataset, "seed": seed, "split": split,
             "accuracy": accuracy}))
    for seed, acc in zip((42, 43, 45), (0.6, 0.7, 0.8)):
        fake(f"tes-{seed}", "TES-IS", "arc_challenge", seed, acc)
        fake(f"ce-{seed}", "CE", "arc_challenge", seed, 0.5)
    fake("tes-42-val", "TES-IS", "arc_challenge", 42, 0.1, split="val")
    fake("native", "native", "arc_challenge", None, 0.25)
    table = evaluate.main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "table.md")])
    rows = {line.split(" | ")[1]: line for line in table.splitlines()[2:]}
    assert set(rows) == {"TES-IS", "CE"}
    assert "| 70.00 ± 10.00 |" in rows["TES-IS"] and "| 50.00 ± 0.00 |" in rows["CE"]
    assert table.splitlines()[0] == "| Model | Method | arc_challenge |"
    assert (tmp_path / "table.md").read_text() == table == capsys.readouterr().out
    assert evaluate.main(["report", str(tmp_path / "runs"), "--seeds", "42", "43"]).count("(n=") == 0


def test_a_run_folder_stands_for_its_test_evaluation_in_the_report(tmp_path):
    """`report RUN` reads RUN/eval/test (and the zero-shot eval/test-base), as compare does: a re-evaluation
    into RUN/eval/again, as docs/data.md shows, is not a second run with the same identity."""
    def fake(folder, method, accuracy):
        folder.mkdir(parents=True)
        (folder / "metrics.json").write_text(json.dumps({"model": "m", "method": method, "dataset": "d", "seed": 42,
                                                         "split": "test", "accuracy": accuracy}))
    run = tmp_path / "runs" / "m-d-CE-seed42"
    fake(run / "eval" / "test", "CE", 0.5)
    fake(run / "eval" / "again", "CE", 0.25)
    fake(run / "eval" / "test-base", "zero-shot", 0.125)
    (run / "config.json").write_text(json.dumps({"seed": 42}))
    for path in (run, tmp_path / "runs"):
        rows = {line.split(" | ")[1]: line for line in evaluate.main(["report", str(path)]).splitlines()[2:]}
        assert set(rows) == {"CE", "zero-shot"} and "| 50.00 (n=1) |" in rows["CE"]


def test_report_of_seeds_it_has_no_evaluation_of_is_refused(tmp_path):
    folder = tmp_path / "eval"
    folder.mkdir()
    (folder / "metrics.json").write_text(json.dumps({"model": "m", "method": "CE", "dataset": "d", "seed": 42,
                                                     "split": "test", "accuracy": 0.5}))
    with pytest.raises(ValueError, match=r"no evaluation of seeds \[7\] .* have seeds \[42\]: pass --seeds"):
        evaluate.main(["report", str(folder), "--seeds", "7"])


# ---- bad input -------------------------------------------------------------------------------------

def other_base_adapter(tmp_path) -> Path:
    from minimoe.core.adaptation.lora import add_lora
    from minimoe.runs.adapters import save_adapter
    config = MoEConfig(model_type="olmoe", vocab_size=304, hidden_size=64, intermediate_size=32,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                       num_experts_per_tok=2)
    model = add_lora(init_weights(MoEForCausalLM(config)), rank=4)
    save_adapter(model, tmp_path / "other-adapter", base_model="some/other-model")
    return tmp_path / "other-adapter"


def bad_case(case, toy, tmp_path) -> tuple[list, type, str]:
    model, test = ["--model", str(toy["models"]["olmoe"])], str(toy["data"] / "test.jsonl")
    if case == "unknown dataset":
        return model + ["--data", "no_such_benchmark"], ValueError, "unknown dataset 'no_such_benchmark'"
    if case == "empty manifest":
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "test.jsonl").write_text("")
        return model + ["--data", str(tmp_path / "empty" / "test.jsonl")], ValueError, "manifest is empty"
    if case == "malformed line":
        path = write_manifest(tmp_path / "bad" / "test.jsonl", toy["splits"]["test"][:2])
        path.write_text(path.read_text() + '{"id": "x", "question": \n')
        return model + ["--data", str(path)], ValueError, r"test.jsonl:3: invalid JSON"
    if case == "missing adapter":
        return model + ["--data", test, "--adapter", str(tmp_path / "nope")], FileNotFoundError, "no such folder"
    if case == "adapter of another base model":
        return (model + ["--data", test, "--adapter", str(other_base_adapter(tmp_path))], ValueError,
                "some/other-model.*hidden_size")
    if case == "adapter of other weights with the same shapes":
        from minimoe.core.adaptation.lora import add_lora
        from minimoe.runs.adapters import save_adapter
        other = init_weights(MoEForCausalLM(from_pretrained(toy["models"]["olmoe"]).config), std=0.2,
                             generator=torch.Generator().manual_seed(1))  # the toy model is seed 0
        save_adapter(add_lora(other, rank=4), tmp_path / "seed1-adapter", base_model="toy-seed1")
        return (model + ["--data", test, "--adapter", str(tmp_path / "seed1-adapter")], ValueError,
                "toy-seed1', whose weights differ.*--allow-other-base")
    if case == "unfinished run":
        run = tes_run(toy, tmp_path / "run")
        (run / "selection.json").unlink()
        return ["--adapter", str(run)], FileNotFoundError, "has not finished"
    if case == "no train manifest for tes":
        run = tes_run(toy, tmp_path / "run")
        lone = write_manifest(tmp_path / "lone" / "test.jsonl", toy["splits"]["test"][:3])
        return ["--adapter", str(run), "--data", str(lone)], FileNotFoundError, "no train manifest"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["unknown dataset", "empty manifest", "malformed line", "missing adapter",
                                  "adapter of another base model", "adapter of other weights with the same shapes",
                                  "unfinished run", "no train manifest for tes"])
def test_bad_input_raises_before_any_output(toy, tmp_path, case):
    argv, error, message = bad_case(case, toy, tmp_path)
    out = tmp_path / "out" / "eval"
    with pytest.raises(error, match=message):
        evaluate.main(argv + ["--out-dir", str(out), "--max-examples", "4"])
    assert no_leftovers(out)


def test_evaluate_run_refuses_examples_without_the_model_they_go_with(tmp_path):
    """evaluate_run scores a model in memory on the examples it is handed, or loads the run's checkpoint
    and its own splits: examples without a model would be dropped unread, so they are refused, before
    any output."""
    from minimoe.runs.eval_run import evaluate_run
    with pytest.raises(ValueError, match="examples and train_examples go with an in-memory model"):
        evaluate_run(tmp_path / "run", examples=[Example("q1", "Which?", ["a", "b"], 0, {})])
    assert not (tmp_path / "run").exists()


def test_other_base_weights_only_with_the_override(toy, tmp_path):
    argv, _, _ = bad_case("adapter of other weights with the same shapes", toy, tmp_path)
    metrics = evaluate.main(argv + ["--out-dir", str(tmp_path / "eval"), "--max-examples", "4", "--allow-other-base"])
    assert metrics["n_examples"] == 4


def tree(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("target", ["run", "runs", "adapter"])
def test_out_never_replaces_what_evaluate_did_not_write(toy, tmp_path, target):
    """--out a run folder, its parent, or an adapter folder: refused naming it, every byte left as it was;
    an earlier evaluation folder is replaced."""
    run = tes_run(toy, tmp_path / "runs" / "run")
    out = {"run": run, "runs": tmp_path / "runs", "adapter": run / "checkpoints" / "epoch-2"}[target]
    before = tree(tmp_path)
    with pytest.raises(FileExistsError, match=f"{out}: exists and"):
        evaluate.main(["--adapter", str(run), "--out-dir", str(out), "--max-examples", "2"])
    assert tree(tmp_path) == before
    evaluate.main(["--adapter", str(run), "--out-dir", str(run / "eval"), "--max-examples", "2"])
    evaluate.main(["--adapter", str(run), "--out-dir", str(run / "eval"), "--max-examples", "3"])
    assert json.loads((run / "eval" / "metrics.json").read_text())["n_examples"] == 3


def test_cli_refusal_is_one_line_and_nonzero(toy, tmp_path):
    import subprocess
    import sys
    run = tes_run(toy, tmp_path / "run")
    before = tree(run)
    repo = Path(evaluate.__file__).resolve().parent
    out = subprocess.run([sys.executable, str(repo / "evaluate.py"), "--adapter", str(run), "--eval-dir", str(run)],
                         capture_output=True, text=True, cwd=repo, timeout=300)
    assert out.returncode != 0 and out.stderr.startswith(f"evaluate.py: error: {run}: exists and was not written by")
    assert len(out.stderr.strip().splitlines()) == 1 and tree(run) == before


@pytest.mark.parametrize("flag", ["--eval-batch-size", "--max-examples", "--max-length"])
def test_bad_number_is_refused_before_any_output(toy, tmp_path, capsys, flag):
    with pytest.raises(SystemExit) as exit_info:
        evaluate.main(["--model", str(toy["models"]["olmoe"]), "--out-dir", str(tmp_path / "eval"), flag, "0"])
    assert exit_info.value.code == 2 and f"argument {flag}: 0: expected an integer >= 1" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_failed_write_keeps_the_previous_output(toy, tmp_path, monkeypatch):
    """A failure while writing removes the temp folder; the previous complete output stays as it was."""
    out = tmp_path / "eval"
    argv = ["--model", str(toy["models"]["olmoe"]), "--data", str(toy["data"] / "test.jsonl"), "--out-dir", str(out)]
    evaluate.main(argv + ["--max-examples", "3"])
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def broken_save(self, path):
        raise OSError("disk full")
    monkeypatch.setattr(TokenArrays, "save", broken_save)
    with pytest.raises(OSError, match=f"{out}: could not write it.*disk full"):
        evaluate.main(argv + ["--max-examples", "2"])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not list(tmp_path.glob(".eval.*"))


def test_help_names_the_report_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        evaluate.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "evaluate.py report runs/*/eval/test" in text and "--adapter" in text and "--checkpoint" in text


def test_report_is_an_argparse_command(capsys):
    """--help lists `report`, `compare` and `plot` as commands with their own --help; an evaluation option before
    one is refused, not dropped."""
    with pytest.raises(SystemExit) as exit_info:
        evaluate.main(["--help"])
    assert exit_info.value.code == 0 and "{report,compare,plot}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        evaluate.main(["report", "--help"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("usage: evaluate.py report")
    with pytest.raises(SystemExit) as exit_info:
        evaluate.main(["--max-examples", "3", "report", "runs"])
    assert exit_info.value.code == 2 and "--max-examples before 'report'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        evaluate.main(["--split", "val", "compare", "runs/a", "runs/b"])
    assert exit_info.value.code == 2 and "--split before 'compare'" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--model", "tiny", "--max-exampels", "8", "--eval-dir", "X"],
                                  ["--max-exampels=8", "report", "X"]])
def test_an_unknown_flag_is_named_as_unknown(tmp_path, capsys, argv):
    """A mistyped option with a value: argparse would read the value as the command ("argument command:
    invalid choice: '8'"); the message names the option instead, before anything is loaded or written."""
    with pytest.raises(SystemExit) as exit_info:
        evaluate.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "unrecognized arguments: --max-exampels" in err and "invalid choice" not in err
