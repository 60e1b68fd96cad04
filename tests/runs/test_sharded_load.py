"""The sharded load (runs/sharding.py `build_sharded`) against the one-process loader (`from_pretrained`), for
every family, at 2 and at 3 ranks, at odd widths: each rank's rows, put back together in rank order, are the
one-process model's weights bit for bit, and each rank reads its rows alone.

Cheap by design: no processes are started. Each rank is built in turn in this process under torch's fake
process group (its collectives do nothing), which is all the build needs: fully_shard gives each rank the
rows FSDP2 gives it, and the real reading code (checkpoint.entry_reads, sharding.local_rows) puts the
checkpoint's rows there. Odd widths (a vocabulary of 131, 7 experts, odd MLP widths; 4 sink heads over 3
ranks: one rank holds none) make a rank's first row differ between ceil(n / W) rows a rank, FSDP2's, and
floor(n / W).
"""
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from minimoe.core.adaptation.quantized import is_quantized
from minimoe.core.adaptation.sharded_nf4 import NF4Records, records_of
from minimoe.core.decoder.family_record import FAMILIES
from minimoe.core.decoder.model import MoEForCausalLM
from minimoe.loading.checkpoint import checkpoint_layout, from_pretrained, save_pretrained
from minimoe.runs import memory
from minimoe.runs.config import build_config
from minimoe.runs.sharding import build_sharded, local_rows
from minimoe.runs.training import install_method
from tests.conftest import tiny_model

# Widths whose first dimension does not split evenly over 2 or 3 ranks (the family's other switches: conftest).
ODD = dict(vocab_size=131, num_experts=7)
ODD_FAMILY = {"qwen3_moe": dict(dense_intermediate_size=49), "qwen2_moe": dict(shared_expert_intermediate_size=41),
              "deepseek_v2": dict(dense_intermediate_size=97, n_group=1, topk_group=1),
              "deepseek_v3": dict(dense_intermediate_size=97, n_group=1, topk_group=1),
              "glm4_moe": dict(dense_intermediate_size=97, n_group=1, topk_group=1),
              "glm4_moe_lite": dict(dense_intermediate_size=97, n_group=1, topk_group=1),
              "mistral4": dict(dense_intermediate_size=97, n_group=1, topk_group=1),
              "llama4_text": dict(dense_intermediate_size=49),
              "granitemoeshared": dict(shared_expert_intermediate_size=41),
              "granitemoehybrid": dict(shared_expert_intermediate_size=41),
              "qwen3_next": dict(shared_expert_intermediate_size=41),
              "lfm2_moe": dict(dense_intermediate_size=49),
              "nemotron_h": dict(dense_intermediate_size=49, shared_expert_intermediate_size=41, n_group=1, topk_group=1),
              # DSA: the indexer's wq_b and weights_proj rows uneven too (5 heads)
              "deepseek_v32": dict(dense_intermediate_size=97, n_group=1, topk_group=1, index_n_heads=5),
              "glm_moe_dsa": dict(dense_intermediate_size=97, index_n_heads=5),
              "mimo_v2_flash": dict(dense_intermediate_size=97, n_group=1, topk_group=1)}
CASES = [*FAMILIES, "gpt_oss-mxfp4"]  # gpt-oss's experts as the official checkpoint stores them, too


def with_biases(model):
    """Every bias (init_weights zeroes them) and DeepSeek-V3's selection-only correction bias drawn at
    random, so that a value left at a placeholder's zeros by the sharded load shows."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return model


def checkpoint(case: str, folder):
    """Tiny `case` at odd widths, saved in its family's layout (save_pretrained writes what transformers
    writes: tests/loading); -mxfp4: the experts then replaced by MXFP4 blocks and scales of random bits."""
    family = case.removesuffix("-mxfp4")
    save_pretrained(with_biases(tiny_model(family, **ODD, **ODD_FAMILY.get(family, {}))), folder)
    if case.endswith("-mxfp4"):
        g = torch.Generator().manual_seed(0)
        tensors = load_file(folder / "model.safetensors")
        for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            E, inner, out = tensors.pop(key).shape  # on disk x @ W: [E, in, out]; MXFP4 holds [E, out, in] in 32s
            tensors[key + "_blocks"] = torch.randint(0, 256, (E, out, inner // 32, 16), dtype=torch.uint8, generator=g)
            tensors[key + "_scales"] = torch.randint(118, 128, (E, out, inner // 32), dtype=torch.uint8, generator=g)
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "mxfp4"}
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def settings(folder, quantize=None):
    """Dual Affinity: its copy of each native gate (the bias too, gpt-oss) is made from the gate read whole."""
    return build_config({"model": str(folder), "method": "dual", "dtype": "float32", "device": "cpu",
                         "quantize": quantize}, "tiny")


def build_rank(folder, rank: int, world_size: int, quantize=None, samples=None) -> tuple[dict, int]:
    """Rank `rank` of `world_size` built sharded: ({parameter: this rank's rows}, the bytes it read). Its FSDP
    units are the root and each decoder layer whole, whatever its mixer (attention, Mamba-2, DeltaNet).
    samples: a dict that takes {packed module: this rank's share of its digest sample} (--quantize nf4)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.testing._internal.distributed.fake_pg import FakeStore
    cfg = settings(folder, quantize)
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        torch.manual_seed(cfg.seed)  # as train.py seeds every rank before the build
        model, read = build_sharded(folder, cfg, lambda m: install_method(m, cfg))
        units = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
        assert units == ["", *(f"model.layers.{i}" for i in range(len(model.model.layers)))], units
        if samples is not None:
            samples.update({n: m.packed.sampled.clone() for n, m in model.named_modules() if is_quantized(m)})
        return {name: local_rows(p)[0].clone() for name, p in model.named_parameters()}, read
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", CASES)
def test_the_sharded_model_gathered_equals_the_one_process_model(case, world_size, tmp_path):
    """Every parameter, base and installed (LoRA, the Dual Affinity copy), each rank's rows concatenated in
    rank order, equals from_pretrained's with install_method under the same seed, bit for bit; the ranks'
    reads add up to every tensor byte of the files once, plus the native gates, which each rank reads whole
    (install copies them), and rank 0's is the memory estimate's weights per GPU (runs/memory.py)."""
    folder = checkpoint(case, tmp_path / case)
    cfg = settings(folder)
    reference = from_pretrained(folder, dtype="float32")
    torch.manual_seed(cfg.seed)
    install_method(reference, cfg)
    ranks = [build_rank(folder, r, world_size) for r in range(world_size)]
    for name, want in reference.named_parameters():
        got = torch.cat([rows[name] for rows, _ in ranks])
        assert torch.equal(got, want.detach()), name

    layout = checkpoint_layout(reference.config)
    gate_keys, buffer_keys = set(), set()
    buffers = {n for n, _ in reference.named_buffers()}
    for name, disk in layout.items():
        if name in buffers:  # DeepSeek-V4's tid2eid: not sharded, every rank reads it whole
            buffer_keys.add(disk)
        elif ".mlp.gate." in name:
            gate_keys.add(disk)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        sizes = {key: f.get_slice(key).get_shape() for key in f.keys()}
        nbytes = {key: f.get_tensor(key).nbytes for key in f.keys()}
    total, gates = sum(nbytes.values()), sum(nbytes[k] for k in gate_keys)
    assert gates > 0 and sizes
    reads = [read for _, read in ranks]
    whole = sum(nbytes[k] for k in buffer_keys)
    assert sum(reads) == total + world_size * gates + (world_size - 1) * whole
    assert max(reads) < 0.75 * total
    if not case.endswith("-mxfp4"):  # the estimate sizes the dense weights it will hold
        with torch.device("meta"):
            meta = MoEForCausalLM(reference.config)
        assert memory.shard_bytes(list(meta.parameters()), world_size) + gates + whole == reads[0]


# --quantize nf4: packed expert banks and attention (OLMoE); MLA's projections, a dense layer and shared experts
# (DeepSeek-V3); DeltaNet's fused projections (Qwen3-Next); experts stored in MXFP4, packed in NF4 (gpt-oss); MLA
# packed beside a DSA indexer left dense (DeepSeek-V3.2); KDA's projections among MLA layers (Kimi-Linear).
PACKED = ["olmoe", "deepseek_v3", "qwen3_next", "gpt_oss-mxfp4", "deepseek_v32", "kimi_linear"]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", PACKED)
def test_the_packed_sharded_model_gathered_equals_the_one_process_packed_model(case, world_size, tmp_path,
                                                                               monkeypatch):
    """--quantize nf4 --shard fsdp: each packed weight's bytes (core/adaptation/sharded_nf4.py), the ranks'
    concatenated in rank order, are the records of from_pretrained(quantize="nf4")'s NF4Weight bit for bit, and
    every other parameter equals its; the ranks' digest samples add up to the one-process packed weight's
    (an adapter's base digest); no rank holds more than ceil(1 / N) of a module's bytes. While it packs, a rank
    holds the dense values of one module's matrices that its bytes touch (a bank: its experts, one more at an
    edge at most; an nn.Linear whole), and no more: never a dense layer."""
    folder = checkpoint(case, tmp_path / case)
    reference = from_pretrained(folder, dtype="float32", quantize="nf4")
    torch.manual_seed(settings(folder).seed)
    install_method(reference, settings(folder, "nf4"))
    held, fill = [], NF4Records.fill_shard

    def packing(records, local, first, dense, m0):  # what the rank holds dense while it packs
        held.append((records.shape, len(dense), dense.numel(), dense.untyped_storage().nbytes()))
        return fill(records, local, first, dense, m0)
    monkeypatch.setattr(NF4Records, "fill_shard", packing)
    samples = [{} for _ in range(world_size)]
    ranks = [build_rank(folder, r, world_size, "nf4", samples[r]) for r in range(world_size)]
    packed = {name: m for name, m in reference.named_modules() if is_quantized(m)}
    assert packed and set(samples[0]) == set(packed)
    for name, module in packed.items():
        records = records_of(module.packed).flatten()
        shares = [rows[f"{name}.weight_nf4"] for rows, _ in ranks]
        assert torch.equal(torch.cat(shares), records), name
        assert max(len(s) for s in shares) == -(-len(records) // world_size)
        assert torch.equal(sum(s[name] for s in samples).to(torch.bfloat16), module.packed.sample), name
    for name, want in reference.named_parameters():
        assert torch.equal(torch.cat([rows[name] for rows, _ in ranks]), want.detach()), name
    layer = max(sum(m.weight.numel() for n, m in packed.items() if n.startswith(f"model.layers.{i}."))
                for i in range(reference.config.num_hidden_layers))
    for shape, matrices, values, _ in held:
        assert matrices <= (-(-shape[0] // world_size) + 1 if len(shape) == 3 else 1)
        assert values < layer
    # one staging buffer for the build, the size of the largest share (float32): not one allocation per module
    assert {stage for *_, stage in held} == {4 * max(values for _, _, values, _ in held)}
    # the memory command's packed weights per GPU: rank 0's bytes of the base, packed and not
    with torch.device("meta"):
        meta = MoEForCausalLM(reference.config)
    base = [n for n in dict(meta.named_parameters()) if n.removesuffix(".weight") not in packed] + \
        [f"{n}.weight_nf4" for n in packed]
    assert memory.packed_shard_bytes(meta, torch.float32, world_size)[0] == sum(ranks[0][0][n].nbytes for n in base)
    assert {stage for *_, stage in held} == {4 * max(values for _, _, values, _ in held)}
