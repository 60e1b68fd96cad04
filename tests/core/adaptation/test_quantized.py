"""--quantize nf4 (core/adaptation/quantized.py): the packed base against torchao's own NF4, one dequantised weight
alive at a time, packing while loading, and every method training on every family with a packed base."""
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("torchao")  # the quant extra (and the test extra); a plain install skips these tests

from minimoe.making.tiny import FAMILY_SWITCHES, tiny_model  # noqa: E402
from minimoe.core.adaptation import quantized  # noqa: E402
from minimoe.core.layers.experts import GroupedLinear  # noqa: E402
from minimoe.core.adaptation.lora import add_lora  # noqa: E402
from minimoe.core.routing_methods.routing import moe_blocks  # noqa: E402
from minimoe.loading.checkpoint import from_pretrained  # noqa: E402
from minimoe.making.tiny import tiny_checkpoint  # noqa: E402

nf4_tensor = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")


def test_a_banks_dequantised_weight_is_torchaos_bit_for_bit():
    """Each expert of a bank dequantises to torchao's to_nf4(W_e).get_original_weight(), bit for bit; and
    a packed nn.Linear computes torchao's own quantized linear (linear_nf4) on the same weight, exactly."""
    g = torch.Generator().manual_seed(0)
    bank = torch.randn(4, 32, 64, generator=g).to(torch.bfloat16)
    packed = quantized.NF4Weight(bank)
    out = packed.dequantize_into(torch.empty_like(bank))
    reference = torch.stack([nf4_tensor.to_nf4(w, 64, 32).get_original_weight() for w in bank])  # 32 blocks per expert
    assert torch.equal(out, reference)
    linear = torch.nn.Linear(64, 128, bias=False).to(torch.bfloat16)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    expected = nf4_tensor.linear_nf4(x, nf4_tensor.to_nf4(linear.weight.detach(), 64, 128))
    quantized.quantize_module(linear, quantized.NF4Weight(linear.weight.data))
    assert torch.equal(linear(x), expected)


class Dispatched(TorchDispatchMode):
    """The ops dispatched while active (views included), by name."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func._overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_a_bank_dequantises_in_the_same_few_ops_per_chunk_whatever_its_experts(monkeypatch):
    """Dequantising a bank dispatches the same ops for 4 experts as for 16 while one chunk holds them (one vectorised
    lookup over the chunk, not one set of kernels per expert), and few of them. With chunks of 4 experts
    (DEQUANTIZE_CHUNK_BYTES), 16 experts are 4 chunks of those same ops, and the bank is the whole-bank one's bit for bit."""
    banks = {experts: quantized.NF4Weight(torch.randn(experts, 32, 64, dtype=torch.bfloat16)) for experts in (4, 16)}

    def dequantize(packed):
        out = torch.empty(packed.shape, dtype=torch.bfloat16)
        with Dispatched() as dispatched:
            packed.dequantize_into(out)
        return out, dispatched.ops
    whole = {experts: dequantize(packed) for experts, packed in banks.items()}
    assert whole[4][1] == whole[16][1], whole
    assert sum(op not in ("view", "slice", "unsqueeze") for op in whole[16][1]) <= 6, whole[16][1]  # kernels
    monkeypatch.setattr(quantized, "DEQUANTIZE_CHUNK_BYTES", 4 * quantized.nf4_temporary_bytes(32 * 64, torch.bfloat16))
    out, ops = dequantize(banks[16])
    view, *chunk = whole[4][1]  # the bank viewed as matrices, then one chunk's ops
    assert ops == [view] + 4 * chunk, ops
    assert torch.equal(out, whole[16][0])


def test_the_dequantisation_compiles_as_one_graph_and_stays_exact():
    """torch.compile(fullgraph=True) traces nf4_dequantize whole (a graph break raises), and the compiled
    function's output is the eager one's bit for bit (aot_eager: the traced graph run as aten ops)."""
    packed = quantized.NF4Weight(torch.randn(3, 32, 128, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16))
    parts = (packed.codes, packed.scalers, packed.factors, packed.means, packed.pairs)
    torch._dynamo.reset()
    compiled = torch.compile(quantized.nf4_dequantize, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(*parts), quantized.nf4_dequantize(*parts))


@pytest.mark.parametrize("family", list(FAMILY_SWITCHES))
def test_packed_logits_err_as_the_librarys_own_dequantisation(family):
    """Every family's logits with the base packed, against the dense model's: the relative error is the one
    of the dense model whose packed weights are replaced by torchao's own dequantisation (the same
    numbers in the same code: equal to rounding), and the router gates, embeddings, head, norms and biases
    are left dense. The measured errors are docs/quantization.md's."""
    dense = tiny_model(family)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    names = quantized.quantized_modules(dense)
    assert names and not any(n.endswith((".gate", "embed_tokens", "lm_head")) for n in names)
    from minimoe.core.routing_methods.methods import set_router
    with_heads = tiny_model(family)
    set_router(with_heads, "dual", layers="all")  # a method's heads (here Dual Affinity's) train: never packed
    assert quantized.quantized_modules(with_heads) == names
    library = tiny_model(family)
    with torch.no_grad():
        for name in names:
            w = library.get_submodule(name).weight
            w.copy_(quantized.NF4Weight(w).dequantize_into(torch.empty_like(w)))
        ours = quantized.quantize_model(tiny_model(family), "nf4")
        y, y_ours, y_lib = (m(ids).logits for m in (dense, ours, library))
    assert not any(n.endswith(".weight") and n.rpartition(".")[0] in names for n, _ in ours.named_parameters())
    err, err_lib = ((a - y).norm() / y.norm() for a in (y_ours, y_lib))
    print(f"{family}: logits relative error {err:.4f}, with torchao's dequantisation {err_lib:.4f}")
    assert 0 < err < 1 and err <= err_lib * (1 + 1e-5), (family, err.item(), err_lib.item())


class LiveDequantised(TorchDispatchMode):
    """The most tensors of at least `numel` elements (a dequantised bank) alive at once, by storage."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.live, self.peak = numel, {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._overloadpacket.__name__ in ("empty", "empty_like", "empty_strided") and out.numel() >= self.numel:
            key = out.untyped_storage().data_ptr()
            self.live[key] = weakref.ref(out)
            self.live = {k: r for k, r in self.live.items() if r() is not None}
            self.peak = max(self.peak, len(self.live))
        return out


@pytest.mark.parametrize("autocast", [False, True])
def test_a_lora_step_holds_one_dequantised_bank_at_a_time(autocast):
    """A LoRA step (forward and backward, gradient checkpointing off) on a packed base: no more than one
    bank-sized dequantised buffer is alive at once; autograd keeps the packed weight, not its dequantisation.
    CPU fp32 (per-block addmm) and bf16 autocast (the GPU recipe's one grouped_mm over [x | a])."""
    model = quantized.quantize_model(tiny_model("olmoe", intermediate_size=64), "nf4")
    add_lora(model, rank=4, dropout=0.0, targets=["q", "v", "experts"]).train()
    banks = [m for m in model.modules() if isinstance(m, GroupedLinear)]
    assert len(banks) == 4 and all(quantized.is_quantized(b) for b in banks)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    with LiveDequantised(min(b.weight.numel() for b in banks)) as live, \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(ids).logits.float().logsumexp(-1).mean().backward()
    assert live.peak == 1, live.peak
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_A" in n)


def dense_twin(packed: nn.Module, family: str, **overrides) -> nn.Module:
    """The tiny model of `family` (tiny_model's `overrides`) holding the packed model's dequantised weights, dense."""
    dense = tiny_model(family, **overrides)
    with torch.no_grad():
        for name in quantized.quantized_modules(packed):
            packed.get_submodule(name).packed.dequantize_into(dense.get_submodule(name).weight)
    return dense


@pytest.mark.parametrize("autocast", [False, True])
def test_packed_lora_matches_the_dense_lora_on_the_dequantised_weights(autocast):
    """The LoRA delta joins the packed base as it joins a dense one: a LoRA model on the packed base and one
    on a dense base holding the dequantised weights give the same loss and LoRA gradients, on the CPU path
    and under bf16 autocast (the GPU path: one grouped_mm over [x | a] against [W | s B], whose s B tail the
    backward's rebuilt buffer gets back)."""
    packed = quantized.quantize_model(tiny_model("olmoe"), "nf4")
    dense = dense_twin(packed, "olmoe")
    for m in (packed, dense):
        torch.manual_seed(1)
        add_lora(m, rank=3, dropout=0.0, targets=["q", "v", "experts"]).train()
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.1)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for m in (packed, dense):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = m(ids).logits.float().logsumexp(-1).mean()
        loss.backward()
        grads.append((loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.requires_grad}))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-6, atol=0)
    for n, g in grads[1][1].items():
        torch.testing.assert_close(grads[0][1][n], g, rtol=1e-5, atol=1e-7, msg=n)
    if autocast:
        return
    from minimoe.core.adaptation.lora import merge_lora
    with pytest.raises(ValueError, match="dequantize_model"):
        merge_lora(packed)
    quantized.dequantize_model(packed)  # then merging works as on a dense base, with the same weights
    merge_lora(packed)
    merge_lora(dense)
    with torch.no_grad():
        torch.testing.assert_close(packed(ids).logits, dense(ids).logits, rtol=0, atol=0)


def test_loading_packs_each_tensor_as_read_and_equals_packing_after_load():
    """from_pretrained(quantize="nf4") holds the same packed values as packing the loaded model, with no
    parameter left for a packed weight; the packed bytes are ~4.1 bits a value (values, scales, means)."""
    read = from_pretrained(tiny_checkpoint(), quantize="nf4")
    after = quantized.quantize_model(from_pretrained(tiny_checkpoint()), "nf4")
    for name in quantized.quantized_modules(after):
        a, b = read.get_submodule(name).packed, after.get_submodule(name).packed
        for part, t in a.tensors().items():
            assert torch.equal(t, b.tensors()[part]), (name, part)
    values = sum(m.weight.numel() for m in read.modules() if quantized.is_quantized(m))
    assert 4.0 < quantized.packed_bytes(read) * 8 / values < 4.6
    assert not [n for n in read.state_dict() if n.rpartition(".")[0] in quantized.quantized_modules(read)
                and n.endswith(".weight")]


def test_a_missing_library_names_the_extra(monkeypatch):
    """Without torchao, --quantize stops naming the extra to install."""
    monkeypatch.setitem(__import__("sys").modules, "torchao", None)
    with pytest.raises(ImportError, match=r'pip install -e "\.\[quant\]"'):
        quantized.require("nf4")
    with pytest.raises(ImportError, match="quant"):
        from_pretrained(tiny_checkpoint(), quantize="nf4")


# Every method on OLMoE, every other family under one method (in turn): 30 cases, not 100 (the CI budget).
FAMILY_METHOD = [("olmoe", m) for m in ("ce", "tes", "acs", "dual")] + [
    (f, ("ce", "tes", "acs", "dual")[i % 4]) for i, f in enumerate(
        ["granitemoe", "qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "deepseek_v2", "deepseek_v3", "granitemoeshared",
         "flex_olmo", "glm4_moe", "llama4_text", "granitemoehybrid", "qwen3_next", "qwen3_5_moe",
         "minimax_m2", "glm4_moe_lite", "mistral4", "kimi_linear", "lfm2_moe", "nemotron_h", "deepseek_v32",
         "glm_moe_dsa", "gemma4_text", "granitemoe_swa", "mimo_v2_flash", "deepseek_v4"])]


@pytest.mark.parametrize("family,method", FAMILY_METHOD)
def test_methods_train_on_every_family_with_a_packed_base(tmp_path, family, method):
    """install_method on a packed tiny model: the first optimizer step's gradients (LoRA, the method's
    heads) equal those of the same model dense on the dequantised weights, so backward runs through every
    packed layer; then further steps on the batch lower the task loss."""
    from tests.test_gpu_path import step_batches
    from minimoe.runs import training
    from minimoe.runs.config import build_config
    cfg = build_config({"method": method, "lora_dropout": 0.0, "batch_size": 2, "pad_token_id": 0, "device": "cpu",
                        "layers": "all", "quantize": "nf4"}, "tiny")
    packed = quantized.quantize_model(tiny_model(family, vocab_size=2048), "nf4")
    batches = step_batches(tmp_path, cfg)
    runs = []
    for model in (packed, dense_twin(packed, family, vocab_size=2048)):
        torch.manual_seed(0)
        training.install_method(model, cfg)
        model.train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        grads = {}
        optimizer.register_step_pre_hook(lambda opt, args, kwargs, m=model: grads.update(
            {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None} if not grads else {}))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        step = lambda s: training.optimizer_step(model, batches, 4, optimizer, scheduler, cfg, s, 1)
        runs.append((grads, [step(s)["task"] for s in range(1, 5 if model is packed else 2)]))
    (got, losses), (want, _) = runs
    assert got.keys() == want.keys() and any("lora_A" in n for n in got)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6, msg=name)
    assert losses[-1] < losses[0], losses


def test_gpt_oss_mxfp4_kept_packed_gives_the_dequantised_on_load_logits(tmp_path):
    """--quantize mxfp4: gpt-oss's released expert blocks and scales kept as loaded (no dense bank is
    built), dequantised per bank at each forward: logits bit for bit those of dequantising on load, in fp32
    and bf16; the packed bytes are the blocks' and scales' own; a LoRA step trains through them."""
    pytest.importorskip("transformers")
    from tests.tiny_families import mxfp4_reference_model
    mxfp4_reference_model(tmp_path)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    for dtype in ("float32", "bfloat16"):
        dense = from_pretrained(tmp_path, dtype=dtype)
        kept = from_pretrained(tmp_path, dtype=dtype, quantize="mxfp4")
        banks = [m for m in kept.modules() if quantized.is_quantized(m)]
        assert len(banks) == 2 * kept.config.num_hidden_layers and all(isinstance(m, GroupedLinear) for m in banks)
        assert quantized.packed_bytes(kept) == sum(m.weight.numel() // 32 * 17 for m in banks)  # 16 bytes + 1 scale
        with torch.no_grad():
            assert torch.equal(kept(ids).logits, dense(ids).logits), dtype
    add_lora(kept, rank=4, dropout=0.0).train()
    kept(ids).logits.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None for n, p in kept.named_parameters() if "lora_A" in n)


def test_mxfp4_is_refused_for_a_checkpoint_without_mxfp4_experts():
    with pytest.raises(ValueError, match="stores none; use --quantize nf4"):
        from_pretrained(tiny_checkpoint(), quantize="mxfp4")


def test_gradient_checkpointing_over_a_packed_base_gives_the_same_gradients():
    """--gradient-checkpointing recomputes each layer in backward (torch.utils.checkpoint, its own
    saved-tensor hooks) around the packed modules' hooks: the loss and LoRA gradients are unchanged."""
    results = []
    for checkpointing in (False, True):
        model = quantized.quantize_model(tiny_model("qwen3_moe"), "nf4")
        torch.manual_seed(1)
        add_lora(model, rank=4, dropout=0.0).train()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.1)
        model.gradient_checkpointing_enable(checkpointing)
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
        loss = model(ids).logits.logsumexp(-1).mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0)
    for n, g in results[0][1].items():
        torch.testing.assert_close(results[1][1][n], g, rtol=1e-6, atol=1e-8, msg=n)


def test_to_moves_the_packed_weight_and_casts_only_what_it_dequantises_to():
    """model.to(dtype): a packed module's placeholder takes the dtype (its dequantisation's), the packed values
    stay NF4 (uint8 codes, scales in the packing dtype: only devices reach them);
    the logits are the fp32 packed model's within bf16's rounding."""
    model = quantized.quantize_model(tiny_model("olmoe"), "nf4")
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        y32 = model(ids).logits
        model.to("cpu").to(torch.bfloat16)
        y16 = model(ids).logits
    for m in model.modules():
        if quantized.is_quantized(m):
            assert m.weight.dtype == torch.bfloat16 and 0 in m.weight.stride()
            assert m.packed.codes.dtype == torch.uint8 and m.packed.factors.dtype == torch.float32
    assert (y16.float() - y32).norm() / y32.norm() < 0.05


class GateFinder(TorchFunctionMode):
    """Which modules act as gates in a forward, found from the data flow, not from names: a module whose
    weight goes into an F.linear (its own forward, or F.linear on `module.weight` as the MoE block's router
    does) of output width `widths` (the expert count, or 1: a per-token scalar gate), when that output (or
    a same-shaped cast, scaling or view of it) reaches a softmax, sigmoid or top-K."""

    CONSUMERS = {"softmax", "log_softmax", "sigmoid", "topk"}

    def __init__(self, model: nn.Module, widths):
        super().__init__()
        self.owner = {id(m.weight): name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        self.widths, self.tainted, self.keep, self.gates = set(widths), {}, [], set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        if func is F.linear and id(inputs[1]) in self.owner and out.shape[-1] in self.widths:
            self.mark(out, self.owner[id(inputs[1])])
        for a in inputs:
            if id(a) not in self.tainted:
                continue
            name = self.tainted[id(a)]
            if getattr(func, "__name__", "") in self.CONSUMERS:
                self.gates.add(name)
            elif isinstance(out, torch.Tensor) and out.shape == a.shape:
                self.mark(out, name)
        return out

    def mark(self, t, name):
        self.tainted[id(t)] = name
        self.keep.append(t)  # alive for the forward, so that no id is reused


def gate_like(model) -> set:
    finder = GateFinder(model, {model.config.num_experts, 1})
    ids = torch.randint(3, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), finder:
        model(ids)
    return finder.gates


@pytest.mark.parametrize("family", list(FAMILY_SWITCHES))
def test_every_gate_like_module_stays_dense_under_nf4(family):
    """docs/quantization.md's promise: a 4-bit base keeps the router gates dense (routing decisions must not
    flip because of the base's storage), the shared-expert gate of Qwen2-MoE and Qwen3-Next among them.
    The gates are found from the forward's data flow (`GateFinder`), so a gate under a new name is caught:
    one per MoE layer at least, plus the shared-expert gate where the family has one."""
    model = tiny_model(family)
    gates = gate_like(model)
    blocks = moe_blocks(model)
    assert {f"model.layers.{i}.mlp.gate" for i in blocks} <= gates  # the finder sees the routers' gates
    if model.config.shared_expert_gate:
        assert {f"model.layers.{i}.mlp.shared_expert_gate" for i in blocks} <= gates
    quantized.quantize_model(model, "nf4")
    assert quantized.quantized_modules(model)  # the base is packed, but no gate of it
    packed = sorted(n for n in gates if quantized.is_quantized(model.get_submodule(n)))
    assert not packed, f"{family}: gate-like modules packed to 4 bits: {packed}"


def test_importing_torchao_prints_no_failed_to_load_lines():
    """A CPU machine cannot load torchao's CUDA extensions, and torchao's import logs "Failed to load ..." for
    each: quantized.require imports it without those lines (a fresh process: torchao imports once)."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", "from minimoe.core.adaptation.quantized import require; require('nf4')"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Failed to load" not in done.stderr + done.stdout


def holds_a_weight(t, weight) -> bool:
    """Whether t, or its transpose, holds `weight` [..., out, in] in its first `in` columns (a LoRA bank's [W | s B])."""
    for view in (t, t.mT) if t.dim() >= 2 else (t,):
        if view.shape[:-1] == weight.shape[:-1] and view.shape[-1] >= weight.shape[-1] and view.dtype == weight.dtype \
                and torch.equal(view[..., :weight.shape[-1]], weight):
            return True
    return False


def test_a_packed_model_compiles_without_graph_breaks_and_saves_no_dequantised_weight(monkeypatch):
    """--compile through packed layers: compile_layers(fullgraph=True) traces every decoder layer of a packed tiny
    granitemoe with LoRA (q, k, v and both banks; o_proj packed without LoRA) as one graph, which the eager
    path's saved-tensor hooks broke 27 times. The compiled step's logits and LoRA gradients are eager's bit for
    bit, and nothing the compiled forward saves for backward holds a dequantised weight: the dequantisation is
    recomputed in backward, as in eager. bf16 autocast, as the GPU recipe (aot_eager: the traced graphs run as aten ops)."""
    from minimoe.core.decoder.model import compile_layers
    from minimoe.core.layers import cpu_memory
    monkeypatch.setattr(cpu_memory, "EXPERT_BLOCK", 1)  # the CPU's row rounding counts on the host

    def build():
        model = quantized.quantize_model(tiny_model("granitemoe", num_hidden_layers=2).to(torch.bfloat16), "nf4")
        torch.manual_seed(1)
        return add_lora(model, rank=4, dropout=0.0).train()
    eager, compiled = build(), compile_layers(build(), backend="aot_eager", fullgraph=True)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    results, saved = [], []
    for model in (eager, compiled):
        saved.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16), \
                torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            logits = model(ids).logits
        logits.float().logsumexp(-1).mean().backward()
        results.append((logits, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    packed = {n: m for n, m in compiled.named_modules() if quantized.is_quantized(m)}
    assert any(isinstance(m, GroupedLinear) and hasattr(m, "k") for m in packed.values())  # LoRA banks among them
    assert any(isinstance(m, nn.Linear) for m in packed.values())  # and a packed linear without LoRA (o_proj)
    for name, m in packed.items():
        weight = m.packed.dequantize_into(torch.empty(m.weight.shape, dtype=torch.bfloat16))
        assert not any(holds_a_weight(t, weight) for t in saved if t.is_floating_point()), name
    (logits, grads), (logits_c, grads_c) = results
    assert torch.equal(logits, logits_c)
    assert grads.keys() == grads_c.keys() and any("experts.gate_up_proj.lora_A" in n for n in grads)
    for name in grads:
        assert torch.equal(grads_c[name], grads[name]), name
