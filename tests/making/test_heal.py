"""minimoe.making.heal: distilling the dense model into a split one, on a tiny random split of a tiny dense Granite.

References: torch's own F.kl_div for the loss; the student's weights before healing for what a stage
may change (bit for bit where nothing may, a per-expert factor on the own-group down columns where
the scales act); the record's probe KL recomputed from the written folder alone.
"""
import json

import pytest
import torch
import torch.nn.functional as F

import minimoe
from minimoe.cli.heal_split import main
from minimoe.data.benchmarks import train_tokenizer
from minimoe.loading.checkpoint import save_pretrained
from minimoe.loading.tokenizer import load_tokenizer
from minimoe.making.heal import (PROBE_ROWS, PROMPT_TOKENS, HealError, HealSettings, distil, heal, healing_text,
                                kl_divergence, unfitted_documents)
from minimoe.making.split import SplitSettings, held_out, prose_documents, record, split_model, token_rows
from tests.conftest import tiny_model

E, K, SHARED, I = 4, 2, 16, 48  # (I - SHARED) / E = 8 own neurons per expert, M = 24
FAST = HealSettings(tokens=8 * 32, seq_len=32, batch_rows=4)  # two steps of four rows


def dense_model(vocab: int, seed: int = 0):
    # std 0.4 and unscaled logits: peaked distributions, so the split's KL is far from 0 (0.18 nats)
    return tiny_model("granitemoe", seed=seed, std=0.4, vocab_size=vocab, intermediate_size=I, num_experts=1,
                      num_experts_per_tok=1, eos_token_id=0, pad_token_id=1, logits_scaling=1.0)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(student, teacher): a tiny dense Granite (one expert) and its split, with a BPE trained on the prose."""
    root = tmp_path_factory.mktemp("heal")
    tok = train_tokenizer([text for _, text in prose_documents()[:300]], vocab_size=320)
    dense = dense_model(320)
    settings = SplitSettings(num_experts=E, top_k=K, shared=SHARED, fit_tokens=256, seq_len=32)
    ids = torch.randint(2, 320, (8, 32), generator=torch.Generator().manual_seed(0))
    student, stats = split_model(dense, ids, settings)
    for folder, model in (("teacher", dense), ("student", student)):
        save_pretrained(model, root / folder)
        tok.save(str(root / folder / "tokenizer.json"))
    (root / "student" / "split.json").write_text(json.dumps(record(settings, stats, 0.0)))
    return root / "student", root / "teacher"


def test_kl_divergence_is_torch_kl_div():
    g = torch.Generator().manual_seed(0)
    t, s = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g)
    ref = F.kl_div(s.log_softmax(-1).flatten(0, 1), t.log_softmax(-1).flatten(0, 1), log_target=True,
                   reduction="batchmean")
    assert torch.allclose(kl_divergence(t, s), ref, atol=1e-6)
    assert kl_divergence(t, t).abs() < 1e-6


def test_kl_decreases_on_a_fixed_batch(folders):
    student, teacher = minimoe.from_pretrained(folders[0]), minimoe.from_pretrained(folders[1])
    batch = torch.randint(2, 320, (4, 32), generator=torch.Generator().manual_seed(1))
    rec, _ = distil(student, teacher, batch.repeat(10, 1), batch, "routers", SHARED,
                    HealSettings(batch_rows=4, router_lr=1e-2, scale_lr=1e-2))
    assert rec["steps"] == 10 and rec["kl_before"] > 0.05
    assert rec["kl_after"] < 0.8 * rec["kl_before"], rec


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_routers_stage_changes_routers_and_own_group_scales_only(folders, tmp_path, dtype):
    """Every weight but the routers and the own-group down columns is bit-identical (in bf16 too: the
    written model is the fp32 student's bits); each expert's own-group columns are its columns times one
    factor, and the shared columns are not scaled."""
    out = tmp_path / "healed"
    heal(folders[0], out, folders[1], HealSettings(**{**FAST.__dict__, "dtype": dtype, "scale_lr": 0.1}))
    before = dict(minimoe.from_pretrained(folders[0]).named_parameters())
    after = dict(minimoe.from_pretrained(out).named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    layers = range(sum(n.endswith("mlp.gate.weight") for n in before))
    assert changed == {f"model.layers.{i}.mlp.{w}" for i in layers
                       for w in ("gate.weight", "experts.down_proj.weight")}
    for i in layers:
        down0, down1 = (p[f"model.layers.{i}.mlp.experts.down_proj.weight"] for p in (before, after))  # [E, D, M]
        assert torch.equal(down0[..., :SHARED], down1[..., :SHARED])
        ratio = down1[..., SHARED:] / down0[..., SHARED:]  # [E, D, G]: one factor per expert
        factor = ratio.flatten(1).median(1).values
        assert torch.allclose(ratio, factor[:, None, None].expand_as(ratio), rtol=1e-5)
        assert (factor - 1).abs().max() > 1e-3  # the scales did train


def test_written_folder_loads_and_records_the_healing(folders, tmp_path):
    out = tmp_path / "healed"
    rec = heal(folders[0], out, folders[1], FAST)
    healed = minimoe.from_pretrained(out)
    split = json.loads((out / "split.json").read_text())
    assert split["settings"] == json.loads((folders[0] / "split.json").read_text())["settings"]
    assert split["healing"][-1] == json.loads(json.dumps(rec))
    assert rec["teacher"]["path"] == str(folders[1]) and rec["text"] == "prose" and rec["settings"]["seed"] == 0
    (stage,) = rec["stages"]
    assert stage["stage"] == "routers" and stage["steps"] == 2 and stage["tokens"] == 8 * 32
    assert set(stage) >= {"kl_before", "kl_after", "lr", "curve", "scales"} and "minimoe_git" in rec
    # the probe KL after healing, recomputed from the written folder alone: the scales were folded in
    tok = load_tokenizer(out)
    docs = unfitted_documents(tok, split["settings"])
    ids = healing_text("prose", tok, None, docs, PROBE_ROWS, FAST.seq_len, FAST.seed)
    with torch.no_grad():
        kl = kl_divergence(minimoe.from_pretrained(folders[1])(ids).logits, healed(ids).logits).item()
    assert kl == pytest.approx(stage["kl_after"], rel=1e-5)
    # the same seed writes the same bits
    again = heal(folders[0], tmp_path / "again", folders[1], FAST)
    assert again["stages"][0]["curve"] == stage["curve"]
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "again" / "model.safetensors").read_bytes()


def test_experts_stage_keeps_the_shared_neurons_tied(folders):
    student, teacher = minimoe.from_pretrained(folders[0]), minimoe.from_pretrained(folders[1])
    bank = student.model.layers[0].mlp.experts
    up0, down0 = bank.gate_up_proj.weight.clone(), bank.down_proj.weight.clone()
    batch = torch.randint(2, 320, (4, 32), generator=torch.Generator().manual_seed(1))
    distil(student, teacher, batch.repeat(3, 1), batch, "experts", SHARED, HealSettings(expert_lr=1e-2))
    M = down0.shape[-1]
    shared_rows = torch.cat([torch.arange(SHARED), M + torch.arange(SHARED)])
    for w, w0, part in ((bank.gate_up_proj.weight, up0, (slice(None), shared_rows)),
                        (bank.down_proj.weight, down0, (slice(None), slice(None), slice(0, SHARED)))):
        shared = w.detach()[part]
        assert not torch.equal(shared, w0[part])  # trained
        assert all(torch.equal(shared[0], shared[e]) for e in range(E))  # and still one copy


def test_generated_text_continues_document_starts(folders):
    tok, teacher = load_tokenizer(folders[0]), minimoe.from_pretrained(folders[1])
    docs = prose_documents()[:50]
    ids = healing_text("generated", tok, teacher, docs, 3, 16, seed=0)
    assert ids.shape == (3, 16)
    starts = {tuple(tok.encode(text)[:PROMPT_TOKENS]) for _, text in docs}
    assert all(tuple(row[:PROMPT_TOKENS].tolist()) in starts for row in ids)
    assert torch.equal(ids, healing_text("generated", tok, teacher, docs, 3, 16, seed=0))


def test_healing_text_leaves_out_the_documents_the_split_fitted_on(folders):
    """The split's fitting rows (token_rows with its settings, as upcycle.py calls it) hold exactly the
    documents that unfitted_documents leaves out of the held-in ones."""
    tok = load_tokenizer(folders[0])
    split = json.loads((folders[0] / "split.json").read_text())["settings"]
    held_in = [d for d in prose_documents() if not held_out(d[0])]
    kept = {i for i, _ in unfitted_documents(tok, split)}
    left_out = [text for i, text in held_in if i not in kept]
    fit = token_rows(tok.tokenizer, held_in, split["fit_tokens"], split["seq_len"], split["seed"], tok.eos_token_id)
    stream = fit.flatten().tolist()
    assert 1 <= len(left_out) and len(kept) == len(held_in) - len(left_out)
    at = 0  # each left-out document's tokens come next in the fitting stream (the last one cut at its end)
    for text in sorted(left_out, key=lambda t: _find(stream, tok.encode(t)[:8])):
        ids = tok.encode(text) + [tok.eos_token_id]
        assert stream[at:at + len(ids)] == ids[:len(stream) - at]
        at += len(ids)
    assert at >= len(stream)


def _find(stream, part):
    return next(i for i in range(len(stream)) if stream[i:i + len(part)] == part)


def test_a_teacher_with_another_vocabulary_is_refused(folders, tmp_path, capsys):
    other = tmp_path / "other"
    save_pretrained(dense_model(384), other)
    with pytest.raises(HealError, match=r"vocab_size 384, the student .* 320; expected the dense model"):
        heal(folders[0], tmp_path / "out", other, FAST)
    with pytest.raises(SystemExit) as e:
        main([str(folders[0]), str(tmp_path / "out"), "--teacher", str(other)])
    assert e.value.code == 2 and "heal: error: teacher" in capsys.readouterr().err
    with pytest.raises(HealError, match="no split.json; expected a split model"):
        heal(folders[1], tmp_path / "out", folders[1], FAST)
    assert not (tmp_path / "out").exists()


def test_both_stages_in_bf16_train_the_fp32_model_and_nothing_outside_the_mlps(folders, tmp_path):
    """--stage both --dtype bfloat16: the bf16 working copy trains the written fp32 model's own tensors
    (so the banks change), everything outside the MLP blocks keeps its bits, and the shared copies stay tied."""
    out = tmp_path / "healed"
    rec = heal(folders[0], out, folders[1], HealSettings(**{**FAST.__dict__, "stage": "both", "dtype": "bfloat16",
                                                          "expert_lr": 1e-2}))
    assert [r["stage"] for r in rec["stages"]] == ["routers", "experts"]
    before = dict(minimoe.from_pretrained(folders[0]).named_parameters())
    after = dict(minimoe.from_pretrained(out).named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed == {n for n in before if ".mlp." in n}
    down = after["model.layers.1.mlp.experts.down_proj.weight"]
    assert all(torch.equal(down[0, :, :SHARED], down[e, :, :SHARED]) for e in range(E))


def spy_training_kl(monkeypatch) -> list:
    """Record each KL that distil trains on (its student logits carry a gradient): (teacher arg, student arg, loss)."""
    import minimoe.making.heal as heal_module
    calls, real = [], heal_module.kl_divergence

    def spy(a, b):
        loss = real(a, b)
        if loss.requires_grad:  # the probe KLs run under no_grad
            calls.append((a.detach().clone(), b.detach().clone(), loss.detach().clone()))
        return loss
    monkeypatch.setattr(heal_module, "kl_divergence", spy)
    return calls


def test_training_minimises_kl_of_the_teacher_over_the_student(folders, monkeypatch):
    """The training call is KL(p_t || p_s), the teacher's logits first (kl_divergence's own order is
    test_kl_divergence_is_torch_kl_div's): on the first step, the logits passed are the teacher's and
    the untrained student's on that batch, in that order."""
    student, teacher = minimoe.from_pretrained(folders[0]), minimoe.from_pretrained(folders[1])
    batch = torch.randint(2, 320, (4, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        t_logits, s_logits = teacher(batch).logits, student(batch).logits
    calls = spy_training_kl(monkeypatch)
    distil(student, teacher, batch.repeat(2, 1), batch, "routers", SHARED, HealSettings(batch_rows=4))
    assert len(calls) == 2
    first, second, _ = calls[0]
    assert torch.equal(first, t_logits) and torch.equal(second, s_logits)


def test_training_runs_at_temperature_one(folders, monkeypatch):
    """The loss distil trains on is the KL of the raw logits' softmaxes (temperature 1, the module's
    formula), by torch's F.kl_div: a temperature T would divide both logits by T."""
    student, teacher = minimoe.from_pretrained(folders[0]), minimoe.from_pretrained(folders[1])
    batch = torch.randint(2, 320, (4, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        t_logits, s_logits = teacher(batch).logits, student(batch).logits
    ref = F.kl_div(s_logits.log_softmax(-1).flatten(0, 1), t_logits.log_softmax(-1).flatten(0, 1), log_target=True,
                   reduction="batchmean")
    calls = spy_training_kl(monkeypatch)
    distil(student, teacher, batch, batch, "routers", SHARED, HealSettings(batch_rows=4))
    (_, _, loss), = calls
    assert ref > 0.05 and loss.item() == pytest.approx(ref.item(), rel=1e-5)


def test_experts_stage_trains_the_banks_and_the_routers_only(folders):
    """The experts stage's documented contract: the expert banks and the routers train; nothing else changes."""
    student, teacher = minimoe.from_pretrained(folders[0]), minimoe.from_pretrained(folders[1])
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    batch = torch.randint(2, 320, (4, 32), generator=torch.Generator().manual_seed(1))
    distil(student, teacher, batch.repeat(3, 1), batch, "experts", SHARED, HealSettings(expert_lr=1e-2))
    changed = {n for n, p in student.named_parameters() if not torch.equal(p, before[n])}
    layers = range(len(student.model.layers))
    assert changed == {f"model.layers.{i}.mlp.{w}" for i in layers
                       for w in ("gate.weight", "experts.gate_up_proj.weight", "experts.down_proj.weight")}


def test_the_probe_rows_are_never_trained_on(folders, tmp_path, monkeypatch):
    """heal's first PROBE_ROWS rows of healing text only measure: no row the student trains on (a forward
    with gradients) is one of them, in either stage, and every other row is trained on once."""
    import minimoe.making.heal as heal_module
    trained, real = [], heal_module.from_pretrained

    def loaded(*args, **kwargs):
        model = real(*args, **kwargs)
        model.register_forward_pre_hook(lambda m, a: trained.extend(a[0].tolist()) if torch.is_grad_enabled() else None)
        return model
    monkeypatch.setattr(heal_module, "from_pretrained", loaded)
    settings = HealSettings(**{**FAST.__dict__, "stage": "both"})
    heal(folders[0], tmp_path / "healed", folders[1], settings)
    tok = load_tokenizer(folders[0])
    split = json.loads((folders[0] / "split.json").read_text())["settings"]
    rows = settings.tokens // settings.seq_len
    ids = healing_text("prose", tok, None, unfitted_documents(tok, split), PROBE_ROWS + 2 * rows, settings.seq_len,
                       settings.seed).tolist()
    probe, rest = ids[:PROBE_ROWS], ids[PROBE_ROWS:]
    assert not any(row in probe for row in trained)
    assert sorted(trained) == sorted(rest)
