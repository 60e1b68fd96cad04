"""Whether torch.compile takes each family's decoder layers whole (model.compile_layers): the graph breaks of a TES
LoRA step (tests/test_gpu_path_families.py's, packed answer rows, bf16 under CPU autocast), forward and backward,
with the aot_eager backend (it traces both as inductor would, compiling no kernel).

Every family's bound is 0 (measured on all 27). The breaks there were: the packed rows' layout, read on the host
inside the first recurrent layer of a forward (ssm_common.segment_plan: 5 .item() and 2 nonzero breaks) and in
DeepSeek-V4's compressed attention (its pieces, and a mask index into its output, a nonzero in every layer); the
model now reads both once before its layers run (the mixers' `read_layout`). Kimi Linear's compiled backward
failed outright (a view of softplus's gradient, kda.py). CI runs four families (IN_CI, about 100 s), the compile
tests' Granite runs in tests/test_gpu_path.py; MINIMOE_ALL_FAMILIES=1 runs all 27 (about 10 minutes on 2 cores).
"""
import pytest
import torch

from minimoe.core.decoder.model import compile_layers
from minimoe.core.layers import cpu_memory
from minimoe.core.task.choices import make_choice_batch
from minimoe.making.tiny import FAMILY_SWITCHES, tiny_model
from tests.conftest import only_in_the_full_matrix
from tests.core.task.test_choices import CharTokenizer, examples
from tests.test_gpu_path_families import autocast, lora_step

# family -> its graph breaks at most; every family's is 0
BREAKS = {family: 0 for family in FAMILY_SWITCHES}
# with gradient checkpointing: DSA's indexer (DeepSeek-V3.2, GLM-5) leaves its top-k for later layers in
# MixerInputs.shared, a write a compiled checkpoint refuses ("HOP: Unsafe side effect"): its layers run eager
CHECKPOINTED_BREAKS = {family: 2 if "index_topk" in switches else 0 for family, switches in FAMILY_SWITCHES.items()}
# compressed attention, hyper-connections and hash routing; KDA; the short conv (the recurrent mixers' shared
# packed-rows path); Gemma 4's parallel dense MLP. Mamba-2, Gated DeltaNet and DSA's indexer: the full matrix
IN_CI = {"deepseek_v4", "kimi_linear", "lfm2_moe", "gemma4_text"}


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("family", sorted(FAMILY_SWITCHES))
def test_a_compiled_lora_step_breaks_the_layers_graphs_at_most_the_bound(family, checkpointing, monkeypatch):
    """compile_layers(aot_eager) on the family's tiny bf16 model, one TES LoRA step over packed answer rows:
    torch._dynamo's graph-break counter at most BREAKS[family] (CHECKPOINTED_BREAKS with gradient checkpointing,
    where a break inside the checkpoint leaves the layer eager). Checkpointed, CI runs DeepSeek-V4 only (its
    rope's tables were cached by a write to the mixer, which the checkpoint refused: 2 breaks)."""
    if family not in IN_CI or (checkpointing and family != "deepseek_v4"):
        only_in_the_full_matrix("one family per mixer kind in CI (module docstring)")
    import torch._dynamo
    from torch._dynamo.utils import counters
    monkeypatch.setattr(cpu_memory, "EXPERT_BLOCK", 1)  # the CPU-only row rounding of bf16 blocks counts on the host
    torch._dynamo.reset()
    counters.clear()
    model = tiny_model(family).to(torch.bfloat16)
    model.gradient_checkpointing_enable(checkpointing)
    logs, grads = lora_step(compile_layers(model, backend="aot_eager"), make_choice_batch(examples(), CharTokenizer(), 0),
                            autocast)
    breaks = dict(counters["graph_break"])
    assert sum(breaks.values()) <= (CHECKPOINTED_BREAKS if checkpointing else BREAKS)[family], breaks
    assert counters["stats"]["unique_graphs"] >= 1 and torch.isfinite(logs["task"])
