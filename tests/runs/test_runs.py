"""The run rules that train.py and evaluate.py share (minimoe.runs.device, minimoe.runs.run_folder): one answer to which device, dtype,
pad id and label a run has, whichever entry point asks."""
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from minimoe.core.task.choices import pad_id
from minimoe.core.routing_methods.methods import get_method
from minimoe.runs.device import CPU_DTYPE_VARIABLE, cpu_capabilities, native_bf16, pick_device, pick_dtype
from minimoe.runs.run_folder import AdapterSource


@pytest.mark.parametrize("method, objective, tune, label", [
    ("ce", "is", False, "CE"), ("native", None, False, "CE"), ("dual", "is", False, "Dual Affinity"),
    ("tes", "is", False, "TES-IS"), ("acs", "enll", True, "ACS-ENLL + affinity tuning"),
    ("ce", "is", True, "CE + affinity tuning"), ("tes", None, False, "TES"),
])
def test_method_label_is_the_papers_row_name(method, objective, tune, label):
    assert get_method(method).configure(objective, tune).row == label


def test_an_adapter_is_labelled_by_its_run_else_by_its_router():
    """AdapterSource.router is the adapter's method record (compat.adapter_record reads older layouts)."""
    in_run = AdapterSource(None, None, {"label": "ACS-IS + affinity tuning"}, "last", 1, {"name": "acs"})
    assert in_run.label == "ACS-IS + affinity tuning"
    assert AdapterSource(None, None, {}, None, None, {"name": "tes"}).label == "TES"
    assert AdapterSource(None, None, {}, None, None, None).label == "CE"  # LoRA on native routing


def test_pad_id_falls_back_to_eos_then_zero():
    assert pad_id(SimpleNamespace(pad_token_id=3, eos_token_id=7)) == 3
    assert pad_id(SimpleNamespace(pad_token_id=None, eos_token_id=7)) == 7
    assert pad_id(SimpleNamespace(pad_token_id=None, eos_token_id=None)) == 0
    assert pad_id(SimpleNamespace(pad_token_id=0, eos_token_id=7)) == 0  # id 0 is an id, not "unset"


def test_auto_device_and_dtype(monkeypatch):
    cuda = torch.cuda.is_available()
    assert pick_device("auto").type == ("cuda" if cuda else "cpu")
    assert pick_dtype("auto", torch.device("cpu")) == "float32"
    assert pick_dtype("auto", "cuda:1") == "bfloat16"
    assert pick_dtype("bfloat16", "cpu") == "bfloat16"
    with pytest.raises(ValueError, match="--dtype 'fp8'; expected auto or one of"):
        pick_dtype("fp8", "cpu")
    if not cuda:
        with pytest.raises(ValueError, match="--device cuda:1: no CUDA device"):
            pick_device("cuda:1")
    # conftest forces CUDA away, so the lines above see the CPU branch only: both answers of torch, by hand
    for available, kind in ((True, "cuda"), (False, "cpu")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
        assert pick_device("auto") == torch.device(kind)
        assert pick_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pick_device("cuda:1") == torch.device("cuda:1")


@pytest.mark.parametrize("device,dtype,on", [("cuda:0", "bfloat16", True), ("cuda", "float32", False),
                                             ("cpu", "bfloat16", False), ("cpu", "float32", False)])
def test_training_and_evaluation_take_one_autocast_policy(device, dtype, on):
    """runs.device.autocast_for: bf16 CUDA autocast for bf16 weights on CUDA, none elsewhere. Training asks with
    the run's names (training.autocast(cfg)), evaluation with its model's torch.device and torch.dtype: one
    answer. (Without CUDA torch builds a CUDA autocast disabled, so its device and dtype are compared.)"""
    from minimoe.runs import training
    from minimoe.runs.config import TrainConfig
    from minimoe.runs.recipes import RECIPES
    from minimoe.runs.device import autocast_for
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available ... Disabling autocast"
        trained = training.autocast(TrainConfig(**RECIPES["tiny"], device=device, dtype=dtype))
        evaluated = autocast_for(torch.device(device), getattr(torch, dtype))
        for ctx in (trained, evaluated):
            if on:
                assert (ctx.device, ctx.fast_dtype) == ("cuda", torch.bfloat16)
            else:
                assert ctx.device == "cpu"
                with torch.autocast("cpu", dtype=torch.bfloat16), ctx:  # it turns an outer autocast off
                    assert not torch.is_autocast_enabled("cpu")


# torch's cpuinfo names (torch.cpu.get_capabilities) of three real processors, cut to what matters.
ZEN4 = {"avx2": True, "avx512_f": True, "avx512_bf16": True, "amx_bf16": False}  # AMD EPYC 9004
SAPPHIRE_RAPIDS = {"avx2": True, "avx512_f": True, "avx512_bf16": True, "amx_tile": True, "amx_bf16": True}
ICE_LAKE = {"avx2": True, "avx512_f": True, "avx512_bf16": False, "amx_bf16": False}  # AVX-512 without BF16
ZEN3 = {"avx2": True}


@pytest.mark.parametrize("capabilities, native", [(ZEN4, True), (SAPPHIRE_RAPIDS, True), ({"amx_bf16": True}, True),
                                                  (ICE_LAKE, False), (ZEN3, False), ({}, False)])
def test_auto_dtype_on_cpu_is_bf16_only_with_native_bf16_and_bf16_warns_only_where_emulated(capabilities, native,
                                                                                            monkeypatch):
    """AVX512-BF16 or AMX-BF16 -> bfloat16 (it trains as fp32 does since issue 33, docs/precision.md); plain AVX-512
    or AVX2 -> float32. An explicit bfloat16 is kept, and warns where bf16 is emulated (slower)."""
    monkeypatch.delenv(CPU_DTYPE_VARIABLE, raising=False)
    assert native_bf16(capabilities) is native
    assert pick_dtype("auto", "cpu", capabilities) == ("bfloat16" if native else "float32")
    assert pick_dtype("auto", "cuda", capabilities) == "bfloat16"  # CUDA's rule does not read the CPU
    assert pick_dtype("float32", "cpu", capabilities) == "float32"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert pick_dtype("bfloat16", "cpu", capabilities) == "bfloat16"
        assert pick_dtype("bfloat16", "cuda", capabilities) == "bfloat16"
    assert [str(w.message).split(":")[0] for w in caught] == ([] if native else [
        "bfloat16 on a CPU without native bf16 matrix instructions (AVX512-BF16 or AMX)"])


def test_cpu_dtype_variable_sets_what_auto_means_on_a_cpu_only(monkeypatch):
    """$MINIMOE_CPU_DTYPE overrides the processor's answer for auto on a CPU, in both directions; an
    explicit --dtype and CUDA's rule do not read it; a value other than float32/bfloat16 is refused."""
    for forced in ("float32", "bfloat16"):
        monkeypatch.setenv(CPU_DTYPE_VARIABLE, forced)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ZEN3's emulated bf16 warns
            assert pick_dtype("auto", "cpu", ZEN4) == pick_dtype("auto", "cpu", ZEN3) == forced
        assert pick_dtype("float32", "cpu", ZEN4) == "float32"
        assert pick_dtype("auto", "cuda", ZEN3) == "bfloat16"
    monkeypatch.setenv(CPU_DTYPE_VARIABLE, "fp16")
    with pytest.raises(ValueError, match=r"MINIMOE_CPU_DTYPE='fp16'; expected float32 or bfloat16"):
        pick_dtype("auto", "cpu", ZEN4)


def test_cpu_capabilities_are_torchs_cpuinfo(monkeypatch):
    """Both of torch's answers, stood in for (torch >= 2.9's get_capabilities, older torch's two probes), and
    this machine's answer against the kernel's own list of its instruction sets (/proc/cpuinfo)."""
    caps = cpu_capabilities()
    assert isinstance(caps, dict) and isinstance(native_bf16(caps), bool)
    if hasattr(torch.cpu, "get_capabilities"):
        assert caps == dict(torch.cpu.get_capabilities())
    cpuinfo = Path("/proc/cpuinfo")
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.read_text().splitlines()
                  if line.startswith("flags")), None) if cpuinfo.is_file() else None
    if flags is not None:  # Linux names them avx512_bf16 and amx_bf16 too
        assert native_bf16(caps) == bool({"avx512_bf16", "amx_bf16"} & set(flags))
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: ZEN4, raising=False)
    assert cpu_capabilities() == ZEN4
    monkeypatch.delattr(torch.cpu, "get_capabilities")
    for bf16, amx in ((True, False), (False, True), (False, False)):
        monkeypatch.setattr(torch._C._cpu, "_is_avx512_bf16_supported", lambda: bf16, raising=False)
        monkeypatch.setattr(torch._C._cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
        assert cpu_capabilities() == {"avx512_bf16": bf16, "amx_bf16": amx}
        assert native_bf16(cpu_capabilities()) is (bf16 or amx)
