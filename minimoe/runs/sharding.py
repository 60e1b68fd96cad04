"""--shard fsdp: the model sharded over the torchrun processes with PyTorch's FSDP2 (`fully_shard`),
for a model that one card cannot hold; DDP (training.py) stays the default where it fits.

Each decoder layer is one FSDP unit and the root (embedding, final norm, LM head) another: every
parameter, the frozen base's included, lives as a DTensor sharded on its first dimension (rank r of
W holds rows [r * ceil(n / W), ...)); a layer's whole weights exist only while it runs. LoRA, the
method heads and tuned gates train as DTensors, so AdamW's moments are sharded as they are.

Decisions:
- Building (`build_sharded`) never holds the whole base on one rank. The model is made on the meta
  device; its base weights become 1-element placeholders of their shapes, and its native gates
  (E x D a layer, their biases and DeepSeek-V3's correction bias: Dual Affinity copies them) are read
  whole. `install_method` then draws the LoRA and head initialisation from the seeded CPU generator in
  the order one process draws them, so FSDP starts from the one-process adapter bit for bit (on the
  CPU; on CUDA the one-process run draws on the device). Everything then goes back to meta, is sharded,
  and each rank reads only its own rows of every base weight from the safetensors files, and takes its
  rows of what the install added (LoRA, heads, gate copies); no base value comes from a placeholder.
- Each rank reads through the one-process loader's map of the family's record (checkpoint.entry_reads,
  restricted to the rank's rows: experts, for per-expert, Converted and MXFP4 entries), so that a family
  cannot load one way whole and another in shards (tests/runs/test_sharded_load.py holds the two equal).
- --quantize nf4: each packed module's NF4 values are one frozen uint8 parameter (core/adaptation/sharded_nf4.py),
  sharded and gathered as any weight; after sharding, each rank reads the matrices its bytes touch, one
  module at a time into one staging buffer, packs them as one process packs them and keeps its bytes
  (`pack_base_rows`). --quantize mxfp4 is refused (install.check_model_settings).
- Mixed precision: `MixedPrecisionPolicy(param_dtype=None, reduce_dtype=float32)`. The base is stored
  in the run's dtype (bf16 on CUDA), so its all-gathers move bf16; the adapters and heads stay fp32
  as in one process (a param_dtype of bf16 would cast them too), their gradients reduce in fp32, and
  the forward runs under the same bf16 autocast as one process (training.autocast).
- Checkpoints: the adapter is gathered (DTensor.full_tensor, its tensors only) and rank 0 writes
  today's adapter files, so evaluate.py and export.py read them unchanged. The optimizer state is
  gathered the same way, keyed by parameter name (torch.distributed.checkpoint.state_dict's full state
  dict), and saved in training_state.pt: plain tensors, loaded with weights_only=True; not DCP, whose
  metadata file is a pickle. Resume puts each rank's rows back from those full tensors. torchao's low-bit
  state (--optim adamw8bit / adamw4bit) is not gathered whole: torchao quantises each rank's shard in blocks
  that start at the shard, so the ranks' codes need not make the whole tensor's; each rank's state is saved as
  it stands, with its generator, and resumed at the same world size (`full_optimizer_state`).
- The step's gradient: FSDP2 averages gradients over ranks as DDP does, so core/task/step.py's
  world-size factor serves both.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from minimoe.core.adaptation.lora import lora_modules
from minimoe.core.adaptation.quantized import is_quantized, quantized_modules
from minimoe.core.adaptation.sharded_nf4 import RECORDS, NF4Records, shardable
from minimoe.core.decoder.model import MoEForCausalLM
from minimoe.loading.checkpoint import DTYPES, checkpoint_layout, model_tensor, read_entries, weight_index
from minimoe.process_memory import mapped_big_blocks
from minimoe.loading.config_json import read_config
from minimoe.runs.config import TrainConfig


class ShardingRefused(ValueError):
    """--shard fsdp where it cannot run: outside torchrun, one process, a merged LoRA, a full-model step."""


def check_sharding(cfg: TrainConfig, world_size: int):
    """Before any run folder exists: --shard fsdp needs torchrun, two processes or more, and no step
    that puts the whole model on one rank (the zero-shot score runs before LoRA, on rank 0 alone)."""
    if cfg.shard != "fsdp":
        return
    if "TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_RANK" not in os.environ:
        raise ShardingRefused("--shard fsdp: not launched by torchrun; run `torchrun --nproc_per_node N train.py "
                              "--shard fsdp ...` (N >= 2), or leave --shard out for one process")
    if world_size < 2:
        raise ShardingRefused(f"--shard fsdp: the world size is {world_size}; sharding needs 2 processes or more "
                              f"(torchrun --nproc_per_node N, N >= 2), or leave --shard out for one process")
    if cfg.zero_shot:
        raise ShardingRefused("--shard fsdp with --zero-shot: the zero-shot score runs the whole base model on rank 0; "
                              "score the base with evaluate.py instead")
    if cfg.method.name == "esft":
        raise ShardingRefused("--shard fsdp with --method esft: ESFT's LoRA form masks the expert LoRA's gradient to "
                              "the chosen experts with a hook on each parameter, which FSDP's sharded parameters "
                              "never run (every expert would train), and its full form copies the chosen rows out of "
                              "banks that each rank holds only in part; use DDP (torchrun without --shard)")


def local_rows(param) -> tuple[torch.Tensor, int]:
    """(this rank's shard of a parameter, as a plain tensor that is its storage; its first row in the
    whole parameter). FSDP2 shards dim 0 as torch.chunk does: ceil(n / W) rows a rank, the last ones short."""
    if not isinstance(param, DTensor):
        return param.data, 0
    local = param.to_local()
    rank, size = param.device_mesh.get_local_rank(), param.device_mesh.size()
    first = min(rank * math.ceil(param.shape[0] / size), param.shape[0])
    return local, first


def put_rows(model: nn.Module, values: dict[str, torch.Tensor]):
    """Each rank copies its rows of the whole tensors `values` (parameter name -> tensor) into its shards."""
    with torch.no_grad():
        for name, value in values.items():
            local, first = local_rows(model_tensor(model, name))
            local.copy_(value[first:first + len(local)])


def read_base_rows(model: MoEForCausalLM, folder: Path) -> int:
    """Each rank reads its rows of every base weight from the checkpoint's safetensors files, and no
    others (per-expert and Converted keys: the experts of its rows), through the one-process loader's
    own map of the family's record (checkpoint.entry_reads); returns the tensor bytes it read."""
    config = model.config
    files, where = weight_index(folder, config)
    targets = []  # (record entry, this rank's rows of its parameter, their first row)
    for name, disk in checkpoint_layout(config).items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and is_quantized(model.get_submodule(module)):
            continue  # packed: pack_base_rows (its bias is read here)
        local, first = local_rows(model_tensor(model, name))  # a buffer (tid2eid) whole on every rank
        if len(local):
            targets.append((disk, local, first))
    return read_entries(files, where, targets, config.num_experts, str(folder))


def pack_base_rows(model: MoEForCausalLM, folder: Path, dtype: torch.dtype, device: torch.device) -> int:
    """--quantize nf4: each rank packs the matrices its bytes of each packed weight touch (NF4Records.matrices_of:
    its experts of a bank, give or take one at each edge; the whole of an nn.Linear), read from the files one
    module after the other into one staging buffer (the largest such share: never a layer), and keeps its
    bytes; returns the tensor bytes it read."""
    config = model.config
    files, where = weight_index(folder, config)
    layout = checkpoint_layout(config)
    todo = []  # (module name, its records, this rank's bytes, their first, matrices [m0, m1), its dense shape)
    for name, module in model.named_modules():
        if is_quantized(module) and isinstance(module.packed, NF4Records):
            local, first = local_rows(getattr(module, RECORDS))
            m0, m1 = module.packed.matrices_of(first, len(local))
            bank = len(module.packed.shape) == 3  # its rows on disk are experts: read only ours; a Linear whole
            if len(local):
                todo.append((name, module.packed, local, first, m0, (m1 - m0, *module.packed.shape[-2:])
                             if bank else module.packed.shape))
    stage = torch.empty(max((math.prod(shape) for *_, shape in todo), default=0), dtype=dtype, device=device)
    read = 0
    for name, records, local, first, m0, shape in todo:
        dense = stage[:math.prod(shape)].view(shape)
        read += read_entries(files, where, [(layout[f"{name}.weight"], dense, m0 if len(shape) == 3 else None)],
                             config.num_experts, str(folder))
        with mapped_big_blocks():  # the packing's transients, unmapped when freed (as from_pretrained packs)
            records.fill_shard(local, first, dense.view(-1, *shape[-2:]), m0)
    return read


def shard(model: MoEForCausalLM, device: torch.device) -> MoEForCausalLM:
    """fully_shard on each decoder layer, then on the root; refused for a merged LoRA (its deltas are
    in the base weights, which FSDP would shard as frozen base)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    if any(m.merged for m in lora_modules(model).values()):
        raise ShardingRefused("--shard fsdp: the model's LoRA is merged into its base weights; unmerge_lora first "
                              "(a merged delta cannot train, and FSDP would shard it as frozen base)")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    # The root (embedding, final norm, LM head) stays gathered from its forward to the end of the backward
    # (FSDP2's default for a root, said here since the chunked next-token loss relies on it: it runs the
    # head after the forward, core/task/tokens.py's forward_tokens).
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    return model


def build_sharded(folder: Path, cfg: TrainConfig, install) -> tuple[MoEForCausalLM, int]:
    """The checkpoint in `folder` as an FSDP2 model on cfg.device with `install(model)` (training's
    install_method: LoRA and the method) applied, without the whole base on any rank (module
    docstring); returns it and the base-weight bytes this rank read from the files."""
    if cfg.quantize not in (None, "nf4"):  # install.check_model_settings refuses it first, before any folder
        raise ShardingRefused(f"--quantize {cfg.quantize} with --shard fsdp: the sharded load packs nf4 only")
    config = read_config(folder)
    dtype, device = DTYPES[cfg.dtype], torch.device(cfg.device)
    with torch.device("meta"):
        model = MoEForCausalLM(config)
    files, where = weight_index(folder, config)
    layout = checkpoint_layout(config)
    gates = []  # (record entry, its whole value): the native gates, read whole, since install may copy them
    for name, p in list(model.named_parameters()):
        if ".mlp.gate." in name and name in layout:
            value = torch.empty(p.shape, dtype=dtype)
            gates.append((layout[name], value, None))
        else:
            value = torch.zeros((), dtype=dtype).expand(p.shape)  # shape and dtype only: one element of storage
        set_parameter(model, name, nn.Parameter(value, requires_grad=False))
    read = read_entries(files, where, gates, config.num_experts, str(folder))
    model.tie_weights()
    packed = quantized_modules(model) if cfg.quantize is not None else []  # named before LoRA wraps them
    install(model)
    base = set(layout) | ({"lm_head.weight"} if config.tie_word_embeddings else set())
    small = {n: p.detach().to(device) for n, p in model.named_parameters() if n not in base}  # LoRA, heads, copies
    for name, p in list(model.named_parameters()):
        set_parameter(model, name, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                requires_grad=p.requires_grad))
    model.tie_weights()
    for name in packed:  # --quantize nf4: the packed base as bytes FSDP shards (core/adaptation/sharded_nf4.py)
        shardable(model.get_submodule(name))
    shard(model, device)
    model.to_empty(device=device)
    read += read_base_rows(model, folder)  # every unpacked base weight's rows, the gates' included
    if packed:
        read += pack_base_rows(model, folder, dtype, device)
    put_rows(model, small)
    return model, read


def set_parameter(model: nn.Module, name: str, param: nn.Parameter):
    module, _, leaf = name.rpartition(".")
    model.get_submodule(module)._parameters[leaf] = param


def full_optimizer_state(model, optimizer) -> dict:
    """The optimizer's state for training_state.pt (every rank calls it; a collective). AdamW's: gathered whole
    and keyed by parameter name. torchao's low-bit AdamW (`low_bit`): each rank's own state as it stands (its
    8- or 4-bit codes and block scales, whose blocks follow the rank's rows) and its torch generator (the bf16
    stochastic rounding draws there, as many numbers as its rows), gathered to rank 0 as a list by rank."""
    if low_bit(optimizer):
        mine = {"optimizer": local_state(optimizer.state_dict()), "rng": torch.get_rng_state()}
        ranks = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, ranks, dst=0)
        return {"ranks": ranks}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_rows(model, optimizer, state: dict):
    """full_optimizer_state's dict back into the sharded optimizer: each rank its rows (low-bit: its own state and
    generator, which need the world size that saved them; train.py refuses a --resume at another)."""
    if "ranks" in state:
        ranks, rank = state["ranks"], dist.get_rank()
        if len(ranks) != dist.get_world_size():
            raise ValueError(f"the low-bit optimizer state was saved by {len(ranks)} ranks, not "
                             f"{dist.get_world_size()}: resume at the world size that saved it")
        put_local_state(optimizer, ranks[rank]["optimizer"])
        torch.set_rng_state(ranks[rank]["rng"])
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def low_bit(optimizer) -> bool:
    """Whether `optimizer` is torchao's low-bit AdamW (--optim adamw8bit / adamw4bit: install.optimizer_class)."""
    return getattr(optimizer, "low_bit", False)


def local_state(state_dict: dict) -> dict:
    """An optimizer's state_dict with each DTensor state (a moment) replaced by this rank's local tensor."""
    return {**state_dict, "state": {i: {k: v.to_local() if isinstance(v, DTensor) else v for k, v in s.items()}
                                    for i, s in state_dict["state"].items()}}


def put_local_state(optimizer, local: dict):
    """`local_state`'s dict back: the groups (their rates) through load_state_dict, and each moment set
    directly, wrapped as a DTensor of its parameter's placement as torchao made it (its _new_buffer: local shapes
    differ between ranks where the rows do not divide evenly). Not through load_state_dict: it casts each state
    tensor to its parameter's dtype, which would make a bf16 parameter's moments say bf16 (install.fp32_faced)."""
    optimizer.load_state_dict({**local, "state": {}})
    params = [p for group in optimizer.param_groups for p in group["params"]]  # state_dict's numbering
    for i, entries in local["state"].items():
        p = params[i]
        optimizer.state[p] = {k: DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                                    stride=p.stride())
                              if isinstance(p, DTensor) and k != "step" else v for k, v in entries.items()}
