"""The GPU path's rules, held on any device: dtype discipline (a bf16 bank runs grouped_mm in bf16
whatever dtype reaches it), no host sync in a training step's forward and backward, decoder layers
that torch.compile takes whole, and length buckets that do not change a score.

CUDA autocast runs ops such as `sum` and `pow` in fp32; without the dtype rule those fp32 tensors
reached the expert banks and fell into the per-expert loop (the GPU-speed issue). The CPU has no
such op list, so these tests feed the fp32 activations in directly.
"""
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_model
from minimoe import load_tokenizer
from minimoe.core.layers import cpu_memory
from minimoe.core.layers import experts as model_module
from minimoe.core.task.choices import forward_choices, make_choice_batch
from minimoe.core.adaptation.lora import add_lora
from minimoe.core.routing_methods.methods import set_router
from minimoe.core.decoder.model import compile_layers
from minimoe.core.task.step import step_loss
from minimoe.data.benchmarks import load_split
from minimoe.loading.checkpoint import from_pretrained
from minimoe.making.tiny import tiny_checkpoint
from minimoe.runs.config import build_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import BankCopies, HostSyncs  # noqa: E402


@pytest.fixture
def no_expert_loop(monkeypatch):
    """The per-expert loop is the only reader of Dispatch.counts_list: make reading it fail the test."""
    def refuse(self):
        raise AssertionError("an expert bank fell back to the per-expert loop")
    monkeypatch.setattr(model_module.Dispatch, "counts_list", property(refuse))


def test_fp32_activations_into_a_bf16_bank_with_lora_run_grouped_mm(family, no_expert_loop):
    """fp32 x (what CUDA autocast's fp32 ops hand on) into a bf16 model's MoE block with LoRA on both
    banks, under autocast as the GPU recipe runs: forward and backward never take the loop, and the
    block answers in the bank's dtype. (The CPU recipe, without autocast, adds each expert's LoRA
    delta by addmm per block: the bf16 fidelity fix, measured there.)"""
    model = add_lora(tiny_model(family).to(torch.bfloat16), dropout=0.0)
    block = model.model.layers[0].mlp
    x = torch.randn(2, 8, model.config.hidden_size, requires_grad=True)  # fp32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = block(x)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    lora = block.experts.gate_up_proj
    assert x.grad is not None and lora.lora_B.grad.abs().sum() > 0  # B = 0 at init: A has no gradient yet


def test_bank_input_is_cast_to_autocast_dtype(no_expert_loop):
    """Under autocast, an fp32 model's banks run in autocast's dtype, as F.linear does."""
    model = tiny_model("olmoe")
    x = torch.randn(1, 8, model.config.hidden_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = model.model.layers[0].mlp(x)
    assert out.dtype == torch.bfloat16


def step_batches(tmp_path, cfg):
    from minimoe.runs import training
    tokenizer = load_tokenizer(tiny_checkpoint())
    examples = load_split("arc_challenge", "train", data_dir=tmp_path / "splits")[:4]
    return training.micro_batches(examples, tokenizer, cfg, 0, 1)


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("method", ["native", "tes", "acs", "dual"])
def test_a_training_steps_forward_and_backward_make_no_host_sync(tmp_path, method, autocast, monkeypatch):
    """step_loss (forward, task + method + load-balancing terms, routing statistics, backward) of every
    built-in method: no op that makes the host wait for the device. The step's one read-back is
    optimizer_step's logging, outside. With autocast (the GPU recipe's ops: LoRA banks add their delta
    in one grouped_mm), the per-expert loop is refused too; the CPU-only row rounding of bf16 blocks,
    which counts on the host, is off."""
    from minimoe.runs import training
    from minimoe.runs.tracking import RoutingStats
    cfg = build_config({"method": method, "lora_dropout": 0.0, "batch_size": 2, "pad_token_id": 0, "device": "cpu",
                        "aux_coef": 0.01, "layers": "all"}, "tiny")
    batches = step_batches(tmp_path, cfg)
    model = from_pretrained(tiny_checkpoint())
    training.install_method(model, cfg)
    model.train()
    counts = {"examples": 4, "tokens": sum(b.supervised_tokens for b in batches),
              "rows": sum(b.input_ids.shape[0] for b in batches)}
    stats = RoutingStats(list(range(model.config.num_hidden_layers)), model.config.num_experts,
                         model.config.num_experts_per_tok)
    if autocast:  # training.autocast(cfg) is CUDA's bf16 autocast on a GPU; here the CPU's stands in
        monkeypatch.setattr(training, "autocast", lambda cfg: torch.autocast("cpu", dtype=torch.bfloat16))
        monkeypatch.setattr(cpu_memory, "EXPERT_BLOCK", 1)
        monkeypatch.setattr(model_module.Dispatch, "counts_list", property(lambda self: pytest.fail("the loop ran")))
    with HostSyncs() as syncs:
        logs = step_loss(model, batches, cfg.method, counts, world_size=1, stats=stats,
                         **training.loss_settings(cfg))
    assert syncs.counts == {}, f"host syncs in a training step: {syncs.counts}"
    assert all(isinstance(v, torch.Tensor) or v == 0.0 for v in logs.values())
    assert logs["task"] > 0 and logs["aux"] > 0 and (method in ("native", "dual")) == (logs["method"] == 0.0)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_compiled_layers_are_one_graph_each_and_equal_eager(checkpointing):
    """compile_layers with fullgraph=True: every decoder layer (TES routing, LoRA on the banks) traces as
    one graph, which a read-back (.item(), bool() of a tensor) would break, and the compiled model's
    logits and gradients equal eager's. Under bf16 autocast, as the GPU recipe runs; the aot_eager
    backend traces forward and backward as inductor would, without compiling kernels. With gradient
    checkpointing too (--compile --gradient-checkpointing): the eager layer's stash of its expert choice,
    a write to a dict, failed the trace ("HOP: Unsafe side effect"); traced, the checkpoint keeps top-K's
    output from forward instead."""
    def build():
        model = add_lora(tiny_model("granitemoe").to(torch.bfloat16), dropout=0.0)
        set_router(model, "tes", layers="all")
        model.gradient_checkpointing_enable(checkpointing)
        return model.train()
    eager, compiled = build(), compile_layers(build(), backend="aot_eager", fullgraph=True)
    compiled.load_state_dict(eager.state_dict())
    ids = torch.randint(0, eager.config.vocab_size, (2, 16))
    results = []
    for model in (eager, compiled):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(ids)
        loss = out.logits.float().logsumexp(-1).mean() + sum(r.prediction.sum() for r in out.routings)
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        results.append((out.logits, grads))
    (logits, grads), (logits_c, grads_c) = results
    assert torch.equal(logits, logits_c)
    assert grads.keys() == grads_c.keys() and any("error_head" in n for n in grads)
    for name in grads:
        torch.testing.assert_close(grads_c[name], grads[name], rtol=0, atol=0, msg=name)


def test_a_compiled_checkpointed_layers_backward_never_chooses_experts_again():
    """--compile --gradient-checkpointing: the traced checkpoint's recomputation in backward reruns no top-K (the
    expert choice is kept from forward, as eager's stash replays it), so that backward never runs experts the
    forward did not; the forward graph chooses. aot_eager's own partitioner, its graphs read as they compile."""
    from torch._dynamo.backends.debugging import aot_eager, boxed_nop
    ops = {"forward": [], "backward": []}

    def reader(side):
        def read(gm, inputs):
            ops[side] += [n.target for n in gm.graph.nodes if n.op == "call_function"]
            return boxed_nop(gm, inputs)
        return read
    model = add_lora(tiny_model("granitemoe").to(torch.bfloat16), dropout=0.0)
    set_router(model, "tes", layers="all")
    model.gradient_checkpointing_enable()
    def backend(gm, inputs):
        return aot_eager(gm, inputs, fw_compiler=reader("forward"), bw_compiler=reader("backward"))
    compile_layers(model.train(), backend=backend, fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randint(0, model.config.vocab_size, (2, 16)))
    out.logits.float().logsumexp(-1).mean().backward()
    topk = torch.ops.aten.topk.default
    assert topk in ops["forward"] and topk not in ops["backward"], ops["backward"].count(topk)


def test_length_buckets_pad_rows_and_leave_scores_unchanged(tmp_path):
    """pad_to=64 rounds the row length up to a multiple of 64 with masked padding; every answer token's
    log-probability is the unbucketed one (fp32, eval)."""
    tokenizer = load_tokenizer(tiny_checkpoint())
    examples = load_split("arc_challenge", "test", data_dir=tmp_path / "splits")[:3]
    model = from_pretrained(tiny_checkpoint()).eval()
    plain = make_choice_batch(examples, tokenizer, 0)
    bucketed = make_choice_batch(examples, tokenizer, 0, pad_to=64)
    assert bucketed.input_ids.shape[1] % 64 == 0 and bucketed.input_ids.shape[1] >= plain.input_ids.shape[1]
    assert bucketed.real_tokens == plain.real_tokens == int(plain.attention_mask.sum())
    with torch.no_grad():
        torch.testing.assert_close(forward_choices(model, bucketed)[1], forward_choices(model, plain)[1])
    with pytest.raises(ValueError, match="pad_to=0; expected a positive int"):
        make_choice_batch(examples, tokenizer, 0, pad_to=0)


def test_host_counts_equal_the_device_tensors(tmp_path):
    """The batch's host-side counts, which training reads instead of syncing, equal the tensors' own."""
    tokenizer = load_tokenizer(tiny_checkpoint())
    examples = load_split("arc_challenge", "test", data_dir=tmp_path / "splits")[:5]
    for packed in (True, False):
        b = make_choice_batch(examples, tokenizer, 0, packed=packed)
        assert b.supervised_tokens == int(b.supervised_mask.sum())
        assert b.real_tokens == int(b.attention_mask.sum())
        assert b.max_choices == int(b.choice.max()) + 1


def test_compile_is_refused_off_cuda(tmp_path, capsys):
    from minimoe.cli import train
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--model", "tiny", "--compile", "--device", "cpu", "--out-dir", str(tmp_path)])
    assert "--compile needs a CUDA device" in str(exit_info.value)


def test_the_suite_sees_no_cuda_unless_marked():
    """conftest's pin: on a GPU machine too, an unmarked test and the processes it starts see no CUDA."""
    import os
    assert not torch.cuda.is_available() and torch.cuda.device_count() == 0
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""


# ---- the GPU recipe at any LoRA rank, with no copy of a frozen bank (the GPU round-2 issue) --------------

def lora_pair(family, rank, **dims):
    """The same tiny model with LoRA (rank, on q, v and the experts, no dropout, B moved off zero so that
    every LoRA factor has a gradient) twice: fp32, and bf16 with fp32 adapters (the GPU recipe)."""
    models = []
    for dtype in (torch.float32, torch.bfloat16):
        models.append(add_lora(tiny_model(family, **dims).to(dtype), rank=rank, dropout=0.0, targets=["q", "v", "experts"]))
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for (name, p32), p16 in zip(models[0].named_parameters(), models[1].parameters()):
            if "lora_B" in name:
                p32.copy_(torch.randn(p32.shape, generator=g) * 0.05)
            if "lora_" in name:
                p16.copy_(p32)
    return [m.train() for m in models]


def lora_loss_and_grads(model, ids):
    out = model(ids)
    loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


ALL_EXPERTS = dict(num_experts=4, num_experts_per_tok=4)  # no top-K choice for bf16 to flip
DIMS = {"default": ALL_EXPERTS, "odd hidden": dict(ALL_EXPERTS, hidden_size=36, num_attention_heads=2, intermediate_size=20),
        "odd intermediate": dict(ALL_EXPERTS, intermediate_size=20)}


@pytest.mark.parametrize("dims", DIMS)
def test_every_lora_rank_trains_under_bf16_autocast_as_in_fp32(family, dims):
    """Ranks 1-16 (8 and 16 only, before: grouped_mm wants 16-byte strides, and [x | a] had in + r columns),
    and widths that are no multiple of 8 (the banks then take the per-expert loop): forward and backward
    under bf16 autocast run, and the loss (1%) and the LoRA gradients (relative norm) are fp32's within
    bf16's error. Every expert runs, so that no top-K choice flips between the two."""
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    for rank in range(1, 17) if dims == "default" else (3, 8):
        m32, m16 = lora_pair(family, rank, **DIMS[dims])
        loss32, grads32 = lora_loss_and_grads(m32, ids)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss16, grads16 = lora_loss_and_grads(m16, ids)
        torch.testing.assert_close(loss16, loss32, rtol=1e-2, atol=0, msg=f"rank {rank}")
        g16, g32 = (torch.cat([g[n].float().flatten() for n in grads32]) for g in (grads16, grads32))
        # bf16 on this std-0.2 toy: up to 0.31 at every rank, 8 and 16 included (OLMoE's q/k norms the worst)
        assert (g16 - g32).norm() / g32.norm() < 0.5, rank


def test_a_lora_train_step_copies_no_frozen_bank(family):
    """The GPU recipe's step (bf16 banks under autocast, LoRA on both banks) writes no tensor the size of a
    bank through cat/copy_/clone/casts, forward or backward: building [W_e | s B_e] per step copied every
    bank twice (about 52 GB a step for OLMoE-1B-7B). `stacked` is built once, by add_lora."""
    model = add_lora(tiny_model(family).to(torch.bfloat16), rank=4, dropout=0.0).train()
    banks = [m.weight for m in model.modules() if isinstance(m, model_module.GroupedLinear)]
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with BankCopies(banks) as copies, torch.autocast("cpu", dtype=torch.bfloat16):
        lora_loss_and_grads(model, ids)
    assert copies.bytes == {}, f"bank-shaped copies in a LoRA step: {copies.shapes}"


def test_the_bank_copy_counter_counts_a_banks_shape_not_its_size():
    """BankCopies counts the old per-step [W | s B] (a cat) and a cast of a bank, and not a cast of logits
    larger than the bank (bench/gpu.py's `copies` row counted 302 MB of logits casts as bank copies at
    Granite's real widths, where the vocabulary makes [B, T, V] larger than a bank)."""
    bank = torch.randn(8, 64, 32, dtype=torch.bfloat16)  # [E, out, in]
    logits = torch.randn(2, 16, 1024, dtype=torch.bfloat16)  # [B, T, V]: twice the bank's elements
    with BankCopies([bank]) as copies:
        logits.float()
        logits.flatten(0, 1).float()
        torch.cat([bank, bank[..., :8]], dim=-1)  # [E, out, in + k]
        bank.transpose(1, 2).contiguous()  # [E, in, out]
    assert copies.bytes == {"cat": 8 * 64 * 40 * 2, "clone": 8 * 32 * 64 * 2}, copies.shapes
    assert copies.shapes == ["cat [8, 64, 40] bfloat16", "clone [8, 32, 64] bfloat16"]


def test_a_cast_after_add_lora_keeps_the_stacked_bank(family):
    """add_lora(...) then .to(torch.bfloat16) (or a move): the bank is stacked again in the new dtype
    (LoRAGroupedLinear._apply), so a LoRA step on the GPU path copies no bank, and the model computes what
    the model cast before add_lora computes, bit for bit, with the same adapter values."""
    torch.manual_seed(0)
    before = add_lora(tiny_model(family).to(torch.bfloat16), rank=4, dropout=0.0).train()
    torch.manual_seed(0)
    after = add_lora(tiny_model(family), rank=4, dropout=0.0).to("cpu").to(torch.bfloat16).train()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B off zero, so that the stacked [W | s B] columns matter; values bf16 holds exactly
        for (name, p_before), p_after in zip(before.named_parameters(), after.parameters()):
            if "lora_" in name:
                value = (torch.randn(p_before.shape, generator=g) * 0.05).bfloat16()
                p_before.copy_(value)
                p_after.copy_(value)
    banks = [m.weight for m in after.modules() if isinstance(m, model_module.GroupedLinear)]
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with BankCopies(banks) as copies, torch.autocast("cpu", dtype=torch.bfloat16):
        loss_after, _ = lora_loss_and_grads(after, ids)
    assert copies.bytes == {}, f"bank-shaped copies in a LoRA step after .to(): {copies.shapes}"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_before, _ = lora_loss_and_grads(before, ids)
    assert torch.equal(loss_after, loss_before)


def test_a_frozen_banks_backward_computes_no_bank_gradient(family):
    """Issue 44's first bug: backward through a LoRA bank on the GPU path runs four grouped_mm (the input's
    and the padded a's gradient in one, s B's, and the A branch's two) and none shaped like the frozen
    bank: its gradient would be a full bank-sized product, thrown away."""
    model = add_lora(tiny_model(family).to(torch.bfloat16), rank=4, dropout=0.0).train()
    bank = model.model.layers[0].mlp.experts.gate_up_proj
    x = torch.randn(32, model.config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    dispatch = model_module.Dispatch(torch.randint(0, 8, (32, 1)), 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = bank(x, dispatch)
    calls = []

    class GroupedMMs(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func._overloadpacket.__name__ == "_grouped_mm":
                calls.append(tuple(out.shape))
            return out
    with GroupedMMs():
        y.float().sum().backward()
    assert bank.lora_A.grad is not None and bank.lora_B.grad is not None and bank.weight.grad is None
    assert len(calls) == 4 and tuple(bank.weight.shape) not in calls, calls


@pytest.mark.parametrize("method", ["native", "tes"])
def test_an_optimizer_step_reads_back_once(tmp_path, method, monkeypatch):
    """optimizer_step: the loss terms, gradient norm, check_step's zero-update check and every diagnosed
    layer's routing statistics come back to the host in one read_back, and nothing else waits for the
    device (no .item(); .cpu() and .tolist() are no op on the CPU, so read_back is counted instead). SGD,
    as AdamW reads its CPU step counter with .item()."""
    from minimoe.runs import training
    cfg = build_config({"method": method, "lora_dropout": 0.0, "batch_size": 2, "pad_token_id": 0, "device": "cpu",
                        "layers": "all"}, "tiny")
    batches = step_batches(tmp_path, cfg)
    model = from_pretrained(tiny_checkpoint())
    training.install_method(model, cfg)
    model.train()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    reads = []
    read_back = training.read_back
    monkeypatch.setattr(training, "read_back", lambda values: reads.append(len(values)) or read_back(values))
    with HostSyncs() as syncs:
        logs = training.optimizer_step(model, batches, 4, optimizer, scheduler, cfg, 1, 1)
    assert syncs.counts == {} and len(reads) == 1, (syncs.counts, reads)
    assert len(logs["routing"]) == model.config.num_hidden_layers and logs["task"] > 0


def test_compiled_layers_recompile_a_bounded_number_of_times_whatever_the_depth(tmp_path, monkeypatch):
    """--compile over a tiny run in the GPU recipe's ops (bf16 under autocast, LoRA dropout on, TES): two
    length buckets of training steps, then validation. torch._dynamo's counters: no graph break, and at
    most 5 graphs for all 4 layers together (layer 0's input needs no gradient, the others' do; a first
    static length, then one dynamic; no_grad validation), under the 8 a code object may hold. The CPU's
    dropout-as-mask hooks broke every layer's graph here (cpu_memory: they step aside under compile)."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from minimoe.runs import training
    monkeypatch.setattr(cpu_memory, "EXPERT_BLOCK", 1)
    cfg = build_config({"method": "tes", "lora_dropout": 0.05, "batch_size": 2, "pad_token_id": 0, "device": "cpu",
                        "compile": True, "layers": "all"}, "tiny")
    tokenizer = load_tokenizer(tiny_checkpoint())
    examples = load_split("arc_challenge", "train", data_dir=tmp_path / "splits")
    steps = {}  # one step per length bucket, two buckets
    for i in range(0, len(examples), 2):
        batches = training.micro_batches(examples[i:i + 2], tokenizer, cfg, 0, 1)
        steps.setdefault(batches[0].input_ids.shape[1], batches)
        if len(steps) == 2:
            break
    model = from_pretrained(tiny_checkpoint(), dtype=torch.bfloat16)
    training.install_method(model, cfg)
    compile_layers(model.train(), backend="aot_eager")
    torch._dynamo.reset()
    counters.clear()
    settings = dict(training.loss_settings(cfg), autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    for batches in steps.values():
        counts = {"examples": 2, "tokens": sum(b.supervised_tokens for b in batches),
                  "rows": sum(b.input_ids.shape[0] for b in batches)}
        step_loss(model, batches, cfg.method, counts, world_size=1, **settings)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        forward_choices(model.eval(), next(iter(steps.values()))[0])
    assert model.config.num_hidden_layers == 4 and len(steps) == 2
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] <= 5, dict(counters["stats"])
