"""A run's method installed on its model, and what the run's settings may be on that model: the checks
train.py runs before it builds or loads anything (`check_install`, on a meta copy), which the memory
command and the sweep's dry run share (`check_model_settings`), and the load-balancing coefficient a
setting resolves to (`aux_coefficient`), and the optimizer class --optim names (`optimizer_class`).
"""
from __future__ import annotations

import functools
import os

import torch

from minimoe.core.adaptation.lora import add_lora, lora_modules
from minimoe.core.adaptation.packed_embedding import unpackable
from minimoe.core.adaptation.quantized import NF4_BLOCK, quantized_modules, torchao_module
from minimoe.core.decoder.family_record import FAMILIES, family_of
from minimoe.core.routing_methods.methods import set_router
from minimoe.runs.config import TrainConfig


def install_method(model, cfg: TrainConfig):
    """LoRA on the run's targets (None: the family's), then the run's routing method `cfg.method` (heads
    trainable, native gate frozen unless the method tunes it); a method without LoRA (`Method.lora`) keeps it
    frozen at its zero start."""
    method = cfg.method
    add_lora(model, rank=cfg.lora_rank, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout, targets=cfg.lora_targets,
             dtype=getattr(torch, cfg.lora_dtype))
    set_router(model, method)  # its layers, objective and lambda are the method's own
    if not method.lora:  # router-only tuning: the LoRA stays at its B = 0 start, frozen, so the model is the base's
        for m in lora_modules(model).values():
            m.requires_grad_(False)
    if method.install is not None:  # ESFT: only the chosen experts' LoRA trains
        method.install(model)


def lora_trains(model_config, cfg: TrainConfig) -> bool:
    """Whether any LoRA parameter trains in this run once its method is installed (on a meta model):
    router-only tuning and ESFT's full form keep every LoRA frozen."""
    from minimoe.core.decoder.model import MoEForCausalLM
    with torch.device("meta"):
        dry = MoEForCausalLM(model_config)
        install_method(dry, cfg)
    return any(p.requires_grad for m in lora_modules(dry).values() for p in m.parameters())


def check_install(model_config, cfg: TrainConfig, device: str):
    """install_method on a copy of the model on the meta device (no memory, no weights): a bad LoRA
    target, layer scope or method option fails here, before any run folder exists; so does an
    adapter whose fp32 weights, gradients and AdamW moments (16 bytes a parameter) exceed the
    device's memory."""
    from minimoe.core.decoder.model import MoEForCausalLM
    check_model_settings(cfg, model_config)  # --aux-coef family, --quantize
    with torch.device("meta"):
        dry = MoEForCausalLM(model_config)
        install_method(dry, cfg)
    need = 16 * sum(p.numel() for p in dry.parameters() if p.requires_grad)
    if torch.device(device).type == "cuda":
        have = torch.cuda.mem_get_info(torch.device(device))[1]
    else:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        raise ValueError(f"the trainable parameters (LoRA rank {cfg.lora_rank} on {cfg.lora_targets}, method heads) "
                         f"need {need / 2**30:.1f} GiB with their gradients and optimizer state; {device} has "
                         f"{have / 2**30:.1f} GiB in all. Lower --lora-rank or --lora-targets")


def check_model_settings(cfg: TrainConfig, model_config) -> None:
    """What a setting may be on this model: the one check that train.py (before it builds or loads the
    model), the memory command and the sweep's dry run share; a ValueError names the setting and why.
    --aux-coef family on a family without one (`aux_coefficient`); --quantize mxfp4 only where the release
    stores MXFP4 experts (Family.packed_release: gpt-oss); --quantize nf4 only where every matrix it packs
    holds whole blocks of 64 values; no --quantize mxfp4 with --shard fsdp; --quantize-embedding only with
    --quantize, untied embeddings whose rows are whole NF4 blocks, and not with --shard fsdp."""
    aux_coefficient(cfg, model_config)
    if cfg.quantize == "mxfp4" and family_of(model_config.model_type).packed_release != "mxfp4":
        released = ", ".join(f.model_type for f in FAMILIES.values() if f.packed_release == "mxfp4")
        raise ValueError(f"--quantize mxfp4 keeps released MXFP4 experts packed, as {released} stores them; this "
                         f"model is {model_config.model_type}; use --quantize nf4")
    if cfg.lora_dtype == "bfloat16" and cfg.optim == "adamw":
        raise ValueError("--lora-dtype bfloat16 with --optim adamw: torch's AdamW rounds each update to the nearest "
                         "bf16 value, where most of LoRA's early steps are lost; use --optim adamw8bit or adamw4bit "
                         "(torchao's, which round it stochastically), or --lora-dtype float32")
    if cfg.quantize == "mxfp4" and cfg.shard == "fsdp":
        raise ValueError("--quantize mxfp4 with --shard fsdp is not supported: the sharded load packs NF4 only "
                         "(core/adaptation/sharded_nf4.py); use --quantize nf4 with --shard fsdp, or --quantize "
                         "mxfp4 in one process or under --shard ddp")
    if cfg.quantize_embedding:
        check_packed_embedding(cfg, model_config)
    if cfg.quantize == "nf4":
        from minimoe.core.decoder.model import MoEForCausalLM
        with torch.device("meta"):
            dry = MoEForCausalLM(model_config)
        for name in quantized_modules(dry):
            rows, cols = dry.get_submodule(name).weight.shape[-2:]
            if rows * cols % NF4_BLOCK:
                raise ValueError(f"--quantize nf4: {name} [{rows}, {cols}] has {rows * cols} values per matrix, not "
                                 f"a multiple of NF4's block of {NF4_BLOCK}; this model cannot be packed in NF4")


def check_packed_embedding(cfg: TrainConfig, model_config) -> None:
    """--quantize-embedding (core/adaptation/packed_embedding.py): what check_model_settings refuses of it."""
    if cfg.quantize is None:
        raise ValueError("--quantize-embedding packs the embedding's table in NF4 beside a packed base; give "
                         "--quantize nf4 (or mxfp4 on gpt-oss) with it")
    if cfg.shard == "fsdp":
        raise ValueError("--quantize-embedding with --shard fsdp is not supported: the sharded load reads the "
                         "embedding dense (runs/sharding.py); drop one of them")
    if refusal := unpackable(model_config.tie_word_embeddings, model_config.hidden_size):
        raise ValueError(refusal)


def aux_coefficient(cfg: TrainConfig, model_config=None) -> float:
    """The load-balancing loss's weight: --aux-coef, or with `family` the checkpoint's router_aux_loss_coef
    (a family whose config.json carries none, DeepSeek's and GLM-4.5's in transformers 4.57, is refused: give
    a number)."""
    if cfg.aux_coef != "family":
        return cfg.aux_coef
    if model_config is None:
        raise ValueError("--aux-coef family: the coefficient is the model's; pass its config")
    family, name = family_of(model_config.model_type), model_config.model_type
    if "router_aux_loss_coef" not in family.config_fields:
        raise ValueError(f"--aux-coef family: {name}'s config.json has no router_aux_loss_coef (transformers 4.57 "
                         f"trains it without a load-balancing loss); give the coefficient as a number")
    if not family.applies_aux_loss:
        raise ValueError(f"--aux-coef family: transformers 4.57 never applies {name}'s router_aux_loss_coef (it trains "
                         f"without a load-balancing loss); give the coefficient as a number")
    return model_config.router_aux_loss_coef


def optimizer_class(name: str):
    """--optim's class: torch's AdamW, or torchao.optim's AdamW8bit / AdamW4bit (the moments in 8 or 4 bits, a
    scale per block; tensors under 4096 values keep moments in their own dtype) as `fp32_faced`; ImportError
    naming the extra without torchao. train.py has torchao's round a bf16 parameter's update stochastically
    (`optimizer_options`)."""
    if name == "adamw":
        return torch.optim.AdamW
    try:
        base = getattr(torchao_module("torchao.optim"), {"adamw8bit": "AdamW8bit", "adamw4bit": "AdamW4bit"}[name])
    except ImportError as e:
        raise ImportError(f"--optim {name} needs torchao, which is not installed: pip install -e \".[quant]\" ({e})") from None
    return fp32_faced(base)


@functools.cache  # one class a base: a run's optimizer is of optimizer_class(name)
def fp32_faced(base):
    """torchao's low-bit AdamW whose quantised moments say float32 whatever the parameter's dtype. Their dtype is
    only the one the tensor shows (the codes and scales are the same, and its update reads them in fp32); torchao
    gives a bf16 parameter's moments bf16, but its DTensor.from_local (--shard fsdp) views them back as float32
    while the DTensor still says bf16, and the update then fails (eager: lerp's sharding check; compiled: an
    unimplemented view by dtype). One process, fp32 parameters and unquantised moments are as torchao makes them."""
    def zeros(p, signed: bool, block_size: int):
        return base._subclass_zeros(p, signed, block_size).to(torch.float32)  # no copy: the same codes and scales
    return type(base.__name__, (base,), {"_subclass_zeros": staticmethod(zeros), "__doc__": fp32_faced.__doc__,
                                         "__module__": __name__, "low_bit": True})


def optimizer_options(name: str) -> dict:
    """--optim's keywords beyond the rate and decay: torchao's round a bf16 parameter's fp32 update to bf16
    stochastically (--lora-dtype bfloat16; fp32 parameters are untouched), so that a step below half a bf16
    spacing still moves the weight in expectation, where rounding to nearest would drop it. fp32 master weights
    were the other way: 4 bytes a parameter more, all that bf16 saves on the weight and its gradient."""
    return {} if name == "adamw" else {"bf16_stochastic_round": True}
