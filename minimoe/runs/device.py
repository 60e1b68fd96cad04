"""Which device, dtype and autocast a run uses, one rule for train.py, evaluate.py, export.py and sweep.py
alike: `pick_device`, `pick_dtype` (with the CPU's bf16 capabilities) and `autocast_for`.
"""
from __future__ import annotations

import os
import warnings

import torch

from minimoe.loading.checkpoint import DTYPES, RUN_DTYPES


def pick_device(name: str = "auto") -> torch.device:
    """auto: CUDA when present, else the CPU; a named CUDA device must exist."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA device is available")
    return torch.device(name)


def cpu_capabilities() -> dict:
    """The processor's instruction sets as torch's cpuinfo reports them ({} where this torch cannot say)."""
    if hasattr(torch.cpu, "get_capabilities"):  # torch >= 2.9
        return dict(torch.cpu.get_capabilities())
    probes = {"avx512_bf16": "_is_avx512_bf16_supported", "amx_bf16": "_is_amx_tile_supported"}  # older torch
    return {name: getattr(torch._C._cpu, probe)() for name, probe in probes.items() if hasattr(torch._C._cpu, probe)}


def native_bf16(capabilities: dict) -> bool:
    """Whether a CPU with these capabilities (`cpu_capabilities()`) multiplies bf16 matrices natively:
    AVX512-BF16 or AMX-BF16, where oneDNN's bf16 GEMMs run at about twice the fp32 rate. Elsewhere a
    bf16 matmul is emulated through fp32 and slower than fp32 itself."""
    return bool(capabilities.get("avx512_bf16") or capabilities.get("amx_bf16"))


CPU_DTYPE_VARIABLE = "MINIMOE_CPU_DTYPE"  # what auto means on a CPU, for every process a command starts


def pick_dtype(name: str, device: torch.device, capabilities: dict | None = None) -> str:
    """auto: bfloat16 on CUDA and on a CPU with native bf16 matrix instructions (`native_bf16`;
    `capabilities` defaults to this machine's), float32 on other CPUs and devices; in training and
    evaluation alike, so that a run's end-of-run scores and a later evaluate.py of it agree. bf16 was
    refused on the CPU while it trained 2 points worse than fp32; with each LoRA delta rounded once
    into its base product (lora.py) the default run in bf16 matches fp32 over three seeds
    (docs/precision.md). $MINIMOE_CPU_DTYPE (float32 or bfloat16) sets auto's CPU choice instead: an
    environment variable reaches the processes that sweep.py and torchrun start, where a flag would have
    to be repeated. bfloat16 on a CPU without native bf16 matmuls is kept when asked for, with a
    warning: there it is slower than float32."""
    kind = torch.device(device).type
    native = kind == "cpu" and native_bf16(cpu_capabilities() if capabilities is None else capabilities)
    if name == "auto":
        forced = os.environ.get(CPU_DTYPE_VARIABLE) if kind == "cpu" else None
        if forced and forced not in RUN_DTYPES:
            raise ValueError(f"${CPU_DTYPE_VARIABLE}={forced!r}; expected {' or '.join(RUN_DTYPES)}")
        name = forced or ("bfloat16" if kind == "cuda" or native else "float32")
    if name not in DTYPES:
        raise ValueError(f"--dtype {name!r}; expected auto or one of {list(DTYPES)}")
    if name == "bfloat16" and kind == "cpu" and not native:
        warnings.warn("bfloat16 on a CPU without native bf16 matrix instructions (AVX512-BF16 or AMX): "
                      "emulated, and slower than float32", stacklevel=2)
    return name


def autocast_for(device, dtype):
    """The autocast a forward runs in, training and evaluation alike: bf16 on CUDA for bf16 weights (the fp32
    LoRA factors and heads then meet the base in bf16 matmuls); none elsewhere, where the model casts for
    itself (lora.py). `device`: a name or torch.device; `dtype`: a name (pick_dtype's) or a torch.dtype."""
    if torch.device(device).type == "cuda" and str(dtype).removeprefix("torch.") == "bfloat16":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)
