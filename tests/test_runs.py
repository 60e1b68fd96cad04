"""The run rules that train.py and evaluate.py share (minimoe.runs): one answer to which device, dtype,
pad id and label a run has, whichever entry point asks."""
from types import SimpleNamespace

import pytest
import torch

from minimoe.runs import AdapterSource, method_label, pad_id, pick_device, pick_dtype


@pytest.mark.parametrize("method, objective, tune, label", [
    ("ce", "is", False, "CE"), ("native", None, False, "CE"), ("dual", "is", False, "Dual Affinity"),
    ("tes", "is", False, "TES-IS"), ("acs", "enll", True, "ACS-ENLL + affinity tuning"),
    ("ce", "is", True, "CE + affinity tuning"), ("tes", None, False, "TES"),
])
def test_method_label_is_the_papers_row_name(method, objective, tune, label):
    assert method_label(method, objective, tune) == label


def test_an_adapter_is_labelled_by_its_run_else_by_its_router():
    in_run = AdapterSource(None, None, {"label": "ACS-IS + affinity tuning"}, "last", 1, {"method": "acs"})
    assert in_run.label == "ACS-IS + affinity tuning"
    assert AdapterSource(None, None, {}, None, None, {"method": "tes"}).label == "TES"
    assert AdapterSource(None, None, {}, None, None, None).label == "CE"  # LoRA on native routing


def test_pad_id_falls_back_to_eos_then_zero():
    assert pad_id(SimpleNamespace(pad_token_id=3, eos_token_id=7)) == 3
    assert pad_id(SimpleNamespace(pad_token_id=None, eos_token_id=7)) == 7
    assert pad_id(SimpleNamespace(pad_token_id=None, eos_token_id=None)) == 0
    assert pad_id(SimpleNamespace(pad_token_id=0, eos_token_id=7)) == 0  # id 0 is an id, not "unset"


def test_auto_device_and_dtype():
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
