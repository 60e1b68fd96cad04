"""The GPU path on a CUDA device (the GPU-speed issue). Every test here is marked `cuda`: it runs only
where CUDA is present and is skipped elsewhere (tests/conftest.py, `cpu_unless_marked_cuda`). Each one
holds the device to an oracle the CPU tests already use (tests/core/decoder/test_model.py, test_lora.py,
test_choices.py, test_gpu_path.py, test_train_cli.py), in the GPU recipe where training is concerned:
bf16 base weights, CUDA autocast (`training.autocast`), fp32 adapters and method heads.

MINIMOE_CUDA_TESTS_DEVICE=cpu runs these tests' logic on the CPU, as a check of the tests themselves:
DEVICE is then the CPU, the recipe's autocast is the CPU's (none), torch.cuda.set_sync_debug_mode is
not there to ask (HostSyncs still counts), and train.py --compile, which needs CUDA, is skipped.

    python -m pytest -q tests/test_cuda.py                                 # on a GPU machine
    MINIMOE_CUDA_TESTS_DEVICE=cpu python -m pytest -q tests/test_cuda.py   # the tests' own check, anywhere
"""
import json
import math
import os
import warnings
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch

import minimoe
from minimoe.core.layers import cpu_memory
from minimoe.core.task.choices import make_choice_batch
from minimoe.core.adaptation.lora import add_lora
from minimoe.core.task.step import step_loss
from minimoe.loading.checkpoint import to_disk_layout
from minimoe.making.tiny import tiny_checkpoint
from minimoe.runs import training
from minimoe.runs.config import TrainConfig, build_config
from minimoe.runs.tracking import RoutingStats

from tests.conftest import CUDA_TESTS_DEVICE, tiny_model
from tests.kill import killed_after
from tests.test_gpu_path import no_expert_loop, step_batches  # noqa: F401 (no_expert_loop: a fixture)
from bench.common import HostSyncs  # importable once test_gpu_path has put the repository root on sys.path
from tests.core.adaptation.test_lora import check_dropout_step_equals_peft, check_fused_bank_lora_equals_peft
from tests.core.layers.test_masks import packed_rows
from tests.core.decoder.test_model import (FP32_TOL, batch, grouped_mm_and_loop_paths, next_token_grads, reference_model,
                                   rel_err, tiny, worst_grad_err)
from tests.core.task.test_choices import METHODS, CharTokenizer, assert_close, examples, model_with, terms
from tests.cli.test_train_cli import TIMINGS, adapter, records, run_train

pytestmark = pytest.mark.cuda

DEVICE = os.environ.get(CUDA_TESTS_DEVICE, "cuda")
DEVICE_TYPE = torch.device(DEVICE).type
ON_CUDA = DEVICE_TYPE == "cuda"
# train.py on the device in the GPU recipe: on CUDA --dtype auto is bfloat16 (the tests check config.json
# says so); the CPU's auto is float32, so the CPU check asks for bfloat16 by name.
DEVICE_FLAGS = ["--device", DEVICE] + ([] if ON_CUDA else ["--dtype", "bfloat16"])


def gpu_recipe(**settings) -> TrainConfig:
    """The tiny recipe on DEVICE in bf16: on CUDA training.autocast(cfg) is bf16 autocast, on the CPU none."""
    return build_config({"device": DEVICE, "dtype": "bfloat16", **settings}, "tiny")


def on_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


def tiny_bf16_model(method_cfg: TrainConfig):
    """The tiny checkpoint in bf16 on DEVICE with the method installed (LoRA and heads fp32), in train mode."""
    model = minimoe.from_pretrained(tiny_checkpoint(), dtype=torch.bfloat16, device=DEVICE)
    training.install_method(model, method_cfg)
    return model.train()


# ---- 1. parity with transformers -------------------------------------------------------------------

def test_fp32_logits_match_transformers(family, tmp_path):
    """fp32 on the device: our logits against transformers' fp32 eager model on the same device, within
    test_model's FP32_TOL (every config switch on, padded batch). On CUDA the fp32 banks take the
    per-expert loop (grouped_mm there is bf16 only)."""
    ref = reference_model(tiny(family), path := tmp_path / "ref")
    ref = ref.to(DEVICE)
    ours = minimoe.from_pretrained(path, dtype=torch.float32, device=DEVICE)
    ids, mask = on_device(*batch())
    with torch.no_grad():
        got, want = ours(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits
    assert got.device.type == DEVICE_TYPE
    assert rel_err(got, want, mask) <= FP32_TOL


def test_bf16_logits_no_worse_than_transformers_bf16(family, tmp_path):
    """bf16 on the device, ours in the GPU recipe (bf16 weights under training.autocast): our logits'
    error against transformers' fp32 logits is within 2x of transformers' own bf16 error (test_model's
    rule)."""
    ref = reference_model(tiny(family), path := tmp_path / "ref")
    ref = ref.to(DEVICE)
    ids, mask = on_device(*batch())
    ours = minimoe.from_pretrained(path, dtype=torch.bfloat16, device=DEVICE)
    with torch.no_grad():
        exact = ref(ids, attention_mask=mask).logits
        ref_bf16 = ref.to(torch.bfloat16)(ids, attention_mask=mask).logits
        with training.autocast(gpu_recipe()):
            ours_bf16 = ours(ids, attention_mask=mask).logits
    assert ours_bf16.dtype == torch.bfloat16
    assert rel_err(ours_bf16, exact, mask) <= 2 * rel_err(ref_bf16, exact, mask)


def test_bf16_gradients_no_worse_than_transformers_bf16(family, tmp_path):
    """bf16 gradients on the device, ours in the GPU recipe: per weight, our error against transformers'
    fp32 gradient of the next-token CE is within 2x of transformers' own bf16 error (the worst weight of
    each model compared, test_model's rule); nonzero, so that the comparison is not vacuous."""
    ref = reference_model(tiny(family), path := tmp_path / "ref")
    ref = ref.to(DEVICE)
    ids, mask = on_device(*batch())
    exact = next_token_grads(ref, ids, mask)
    ref_bf16 = next_token_grads(ref.to(torch.bfloat16), ids, mask)
    ours = minimoe.from_pretrained(path, dtype=torch.bfloat16, device=DEVICE)
    with training.autocast(gpu_recipe()):
        ours_bf16 = to_disk_layout(ours.config, next_token_grads(ours, ids, mask))
    assert 0 < worst_grad_err(ours_bf16, exact) <= 2 * worst_grad_err(ref_bf16, exact)


# ---- 2. grouped_mm, the dtype discipline -----------------------------------------------------------

def test_grouped_mm_equals_the_loop_in_bf16(family, monkeypatch):
    """A bf16 model on the device: F.grouped_mm (asserted called) and the per-expert loop give the same
    logits and expert-bank gradients within test_model's bf16 tolerance (2e-2)."""
    model = tiny_model(family).to(device=DEVICE, dtype=torch.bfloat16)
    (grouped, grouped_grad), (loop, loop_grad) = grouped_mm_and_loop_paths(model, batch()[0].to(DEVICE), monkeypatch)
    torch.testing.assert_close(grouped, loop, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grouped_grad, loop_grad, rtol=2e-2, atol=2e-2)


def test_autocast_bf16_model_with_lora_stays_on_grouped_mm_and_in_bf16(family, no_expert_loop):
    """A bf16 model with LoRA (fp32 adapters on every default target, the banks included) under
    torch.autocast(DEVICE's type, bfloat16), forward and backward: no expert bank falls back to the
    per-expert loop (reading Dispatch.counts_list fails the test), and every decoder layer takes and
    returns a bf16 residual stream (forward hooks), which CUDA autocast's fp32 `sum` would break without
    the combine's cast."""
    model = add_lora(tiny_model(family).to(device=DEVICE, dtype=torch.bfloat16), dropout=0.0).train()
    seen = []
    for layer in model.model.layers:
        layer.register_forward_hook(lambda module, args, out: seen.append((args[0].dtype, out[0].dtype)))
    ids, mask = on_device(*batch())
    with torch.autocast(DEVICE_TYPE, dtype=torch.bfloat16):
        logits = model(ids, attention_mask=mask).logits
        loss = logits.float().logsumexp(-1).mean()
    loss.backward()
    assert seen == [(torch.bfloat16, torch.bfloat16)] * model.config.num_hidden_layers
    lora = model.model.layers[0].mlp.experts.gate_up_proj
    assert lora.lora_B.grad is not None and lora.lora_B.grad.abs().sum() > 0  # B = 0 at init: A has none yet


# ---- 3. LoRA against peft --------------------------------------------------------------------------

def test_fused_bank_lora_equals_peft(tmp_path):
    """test_lora's oracle on the device: our fused gate_up LoRA (and down, q/k/v/o) in fp32 gives the
    logits of peft's per-expert LoRAs on transformers' OlmoeForCausalLM, within 2e-5."""
    check_fused_bank_lora_equals_peft(tmp_path, DEVICE)


def test_dropout_step_equals_peft(tmp_path):
    """test_lora's oracle on the device: a train-mode step at LoRA dropout 0.3 on q/k/v/o, seeded alike,
    gives peft's logits (2e-5) and LoRA gradients (1e-4). On CUDA our LoRA draws its mask with
    F.dropout as peft does, so the two draw the same masks from the device's generator."""
    check_dropout_step_equals_peft(tmp_path, DEVICE)


# ---- 4. packed rows --------------------------------------------------------------------------------

@pytest.mark.parametrize("method", list(METHODS))
def test_packed_rows_equal_per_candidate_rows(family, method):
    """test_choices's oracle on the device, fp32 with LoRA under every routing method, prompts cut from
    the left (max_length 40): packed rows and per-candidate rows give the same scores, choice loss,
    TES/ACS supervision term, their gradients and diagnostics, within 1e-5."""
    model, tok = model_with(family, method).to(DEVICE), CharTokenizer()
    packed = make_choice_batch(examples(), tok, 0, 40).to(DEVICE)
    rows = make_choice_batch(examples(), tok, 0, 40, packed=False).to(DEVICE)
    a, b = terms(model, packed, method), terms(model, rows, method)
    assert a.keys() == b.keys()
    for name in a:
        assert_close(a[name], b[name], name)
    assert any(g is not None and g.abs().sum() > 0 for g in a["grad_loss"])


# ---- 5. a training step of the GPU recipe ----------------------------------------------------------

@pytest.mark.parametrize("method,tune,group", [("tes", False, "error_head"), ("acs", True, "router")])
def test_a_gpu_recipe_step_moves_the_fp32_heads_at_1e_5(tmp_path, method, tune, group):
    """One optimizer step (training.optimizer_step: forward and backward under training.autocast, clip,
    AdamW) of the GPU recipe: bf16 base, fp32 LoRA and heads. What trains at 1e-5 (routing.METHODS):
    TES's error head (its own group, the paper's rate); ACS has no head, so it runs with --tune-router
    and router_lr 1e-5, its tuned native gate (fp32) being the slow group. Checked: autocast is on in
    every forward on CUDA (off on the CPU, as the CPU recipe runs); the slow group is fp32 and moved by
    exactly AdamW's first step at lr 1e-5 on the step's clipped gradient (-lr g / (|g| + eps), fp32
    rounding aside); LoRA B moved; the bf16 base did not."""
    cfg = gpu_recipe(method=method, tune_router=tune, router_lr=1e-5 if tune else None, batch_size=4)
    model = tiny_bf16_model(cfg)
    cfg = replace(cfg, pad_token_id=model.config.pad_token_id)
    optimizer = training.make_optimizer(model, cfg)
    groups = {g["name"]: g for g in optimizer.param_groups}
    assert groups.keys() == {"lora", group} and groups[group]["lr"] == 1e-5 and groups["lora"]["lr"] == 2e-3
    slow = groups[group]["params"]
    assert slow and all(p.dtype == torch.float32 for p in slow)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    grads = {}
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: grads.update({p: p.grad.clone() for p in slow}))
    autocast_on = []
    model.model.layers[0].register_forward_pre_hook(
        lambda module, args: autocast_on.append(torch.is_autocast_enabled(DEVICE_TYPE)))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    batches = step_batches(tmp_path, cfg)
    logs = training.optimizer_step(model, batches, 4, optimizer, scheduler, cfg, world_size=1, step=1)
    assert autocast_on and set(autocast_on) == {ON_CUDA}
    assert math.isfinite(logs["task"]) and logs["method"] > 0
    eps = optimizer.defaults["eps"]
    for p in slow:
        name = next(n for n, q in model.named_parameters() if q is p)
        delta = p.detach() - before[name]
        g = grads[p]
        assert g.abs().max() > 0, name
        torch.testing.assert_close(delta, -1e-5 * g / (g.abs() + eps), rtol=1e-3, atol=1e-7, msg=name)
    assert all(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters() if n.endswith(".lora_B"))
    assert all(p.dtype == torch.bfloat16 and torch.equal(p.detach(), before[n])
               for n, p in model.named_parameters() if not p.requires_grad)


# ---- 6. no host sync in a step ---------------------------------------------------------------------

@contextmanager
def sync_warnings():
    """While active on CUDA, torch.cuda.set_sync_debug_mode("warn"): yields a list that, on exit, holds
    "file:line: message" of each synchronizing CUDA call (a warning each, backward's replayed on the
    calling thread). Off CUDA there is no such mode: the list stays empty."""
    found = []
    if not ON_CUDA:
        yield found
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")
    found += [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "synchroniz" in str(w.message)]


@pytest.mark.parametrize("method", ["native", "tes", "acs", "dual"])
def test_a_training_step_makes_no_host_sync(tmp_path, method, monkeypatch):
    """step.step_loss (forward under autocast, task + method + load-balancing terms, routing
    statistics, backward) of each built-in method in the GPU recipe, LoRA dropout on: on CUDA no call
    that torch.cuda.set_sync_debug_mode flags (read-backs, device-to-host copies, synchronising
    kernels), and HostSyncs (bench/common.py) counts no syncing op. A first step runs unchecked (CUDA's
    lazy initialisation). Both detectors are first shown to catch an .item(). On the CPU the bf16
    banks round expert blocks with a host-side count (cpu_memory.expert_block, CPU only), so the CPU check
    runs them unrounded."""
    if not ON_CUDA:
        monkeypatch.setattr(cpu_memory, "expert_block", lambda x, rows, num_experts: 1)
    with sync_warnings() as flagged, HostSyncs() as syncs:
        torch.ones(1, device=DEVICE).item()
    assert syncs.counts == {"_local_scalar_dense": 1} and bool(flagged) == ON_CUDA

    cfg = gpu_recipe(method=method, batch_size=2, aux_coef=0.01, layers="all")
    model = tiny_bf16_model(cfg)
    cfg = replace(cfg, pad_token_id=model.config.pad_token_id)
    batches = step_batches(tmp_path, cfg)
    counts = {"examples": 4, "tokens": sum(b.supervised_tokens for b in batches),
              "rows": sum(b.input_ids.shape[0] for b in batches)}

    def step():
        stats = RoutingStats(list(range(model.config.num_hidden_layers)), model.config.num_experts,
                             model.config.num_experts_per_tok)
        return step_loss(model, batches, cfg.method, counts, world_size=1, stats=stats,
                         **training.loss_settings(cfg))
    step()
    with sync_warnings() as flagged:  # apart from HostSyncs: under a dispatch mode packed rows leave flex (masks.py)
        logs = step()
    with HostSyncs() as syncs:
        step()
    assert flagged == [], "synchronizing CUDA calls in a training step:\n" + "\n".join(flagged)
    assert syncs.counts == {}, f"host syncs in a training step: {syncs.counts}"
    assert logs["task"].device.type == DEVICE_TYPE
    assert isinstance(logs["method"], torch.Tensor) == (method in ("tes", "acs"))


# ---- 7. train.py on the device ---------------------------------------------------------------------

@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.skipif(
    not ON_CUDA, reason="train.py --compile needs CUDA (it refuses the CPU, tests/test_gpu_path.py)"))])
def test_train_py_runs_on_the_device(tmp_path, compile):
    """train.py --model tiny --device DEVICE (16 examples, one epoch of 2 steps, TES), and with --compile
    (CUDA only): config.json records the device, dtype bfloat16 (CUDA's auto) and the compile setting;
    metrics.jsonl has both steps, with finite losses and a nonzero TES term, and the epoch's finite
    validation NLL; the epoch's adapter holds fp32 LoRA and error-head tensors."""
    run = run_train(tmp_path, *DEVICE_FLAGS, "--method", "tes", *(["--compile"] if compile else []))
    cfg = json.loads((run / "config.json").read_text())
    assert (cfg["device"], cfg["dtype"], cfg["compile"]) == (DEVICE, "bfloat16", compile)
    logged = records(run)
    assert [r["kind"] for r in logged] == ["step", "step", "epoch"]
    assert all(math.isfinite(r["loss"]) and r["method"] > 0 for r in logged if r["kind"] == "step")
    assert math.isfinite(logged[-1]["val_choice_nll"])
    tensors = adapter(run, 1)
    assert any(".lora_B" in k for k in tensors) and any(".router.error_head." in k for k in tensors)
    assert all(t.dtype == torch.float32 for t in tensors.values())


# ---- 8. resume on the device -----------------------------------------------------------------------

RESUME = ["--method", "tes", "--epochs", "2", "--max-train-examples", "12", "--batch-size", "4",
          "--save-every-steps", "2"]  # 3 steps an epoch: step-4 is epoch 2's first


def close_records(got, want):
    """Step and epoch records alike: the same fields, numbers within rtol 1e-3 / atol 1e-5, wall-clock
    fields (TIMINGS) and the per-layer routing summary left out."""
    assert [r.keys() for r in got] == [r.keys() for r in want]
    for a, b in zip(got, want):
        for key in a.keys() - {*TIMINGS, "routing"}:
            if isinstance(a[key], float):
                assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-5), (a["step"], key)
            else:
                assert a[key] == b[key], (a["step"], key)


def test_resume_after_a_kill_ends_where_the_uninterrupted_run_does(tmp_path):
    """Killed after global step 5 (epoch 2, one step past its step-4 checkpoint), resumed: the epoch-2
    adapter and the log end where the uninterrupted run does, on the device in the GPU recipe (LoRA
    dropout on, so the device's RNG state must come back with the checkpoint).

    Within a tolerance, not bit for bit: on CUDA two runs of the same step may differ in the last bits,
    as index_add_ (expert counts, routing statistics, the backward of the token gather) and the
    backward of index_copy_ / gather accumulate with atomics in no fixed order, and grouped_mm's bf16
    kernels need not be deterministic; bf16 rounds such differences to ~4e-3 relative in the activations,
    far less in the fp32 adapter after AdamW. rtol 1e-3 / atol 1e-5 on adapter entries (LoRA B ~1e-2
    after 6 steps at lr 2e-3) admits that and still fails a resume that loses the RNG, optimizer or
    scheduler state or repeats a step: each moves entries by about a step, ~1e-3. On the CPU it is
    bit-identical (tests/cli/test_train_cli.py), which the tolerance admits too."""
    straight = run_train(tmp_path, *DEVICE_FLAGS, *RESUME, name="straight")
    with pytest.raises(SystemExit, match="stopped after step 5"), killed_after(steps=5):
        run_train(tmp_path, *DEVICE_FLAGS, *RESUME, name="killed")
    killed = tmp_path / "killed"
    assert sorted(p.name for p in (killed / "checkpoints").iterdir()) == ["epoch-1", "step-4"]
    run_train(tmp_path, *DEVICE_FLAGS, *RESUME, "--resume", name="killed")
    assert sorted(p.name for p in (killed / "checkpoints").iterdir()) == ["epoch-1", "epoch-2"]
    close_records(records(killed), records(straight))
    want, got = adapter(straight, 2), adapter(killed, 2)
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-3, atol=1e-5, msg=key)


# ---- FlexAttention on packed rows (the GPU round-2 issue) ------------------------------------------------

@pytest.mark.skipif(not ON_CUDA, reason="FlexAttention has no backward on the CPU (torch 2.13)")
def test_flex_attention_backward_equals_sdpa(family, monkeypatch):
    """Packed, padded rows through FlexAttention (CUDA's path) and through the SDPA reference: logits and
    every parameter's gradient agree (fp32, so that the two kernels' accumulation orders are all that differ)."""
    from minimoe.core.decoder import model as model_module
    seg, pad = on_device(*packed_rows()[:2])
    results = []
    for flex in (True, False):
        monkeypatch.setattr(model_module, "FLEX_DEVICES", {"cuda"} if flex else set())
        model = tiny_model(family).to(DEVICE).train()
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)).to(DEVICE)
        logits = model(ids, attention_mask=pad, segment_ids=seg).logits
        (logits[pad.bool()].float().logsumexp(-1).mean()).backward()
        results.append((logits[pad.bool()], {n: p.grad for n, p in model.named_parameters()}))
    (got, grads), (want, want_grads) = results
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-3, atol=1e-4, msg=name)
