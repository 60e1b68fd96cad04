"""The checkpoint's tensor layouts (minimoe/loading/layouts.py): every `Converted` entry of every family's
record names a layout there, each layout's save undoes its load exactly, and an unknown name is refused
with the names there are."""
import pytest
import torch

from minimoe.core.decoder.family_record import FAMILIES, Converted
from minimoe.loading.layouts import LAYOUTS, layout_of


def test_every_converted_entry_of_every_family_names_a_layout():
    named = {(family.model_type, disk.key): disk.layout for family in FAMILIES.values()
             for disk in family.layer_keys.values() if isinstance(disk, Converted)}
    assert named, "no family stores a tensor in another layout: the check below would pass vacuously"
    assert {where: name for where, name in named.items() if name not in LAYOUTS} == {}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_saving_undoes_loading_exactly(name):
    """to_disk(from_disk(w)) == w for a stored tensor of 3 experts (a bias is [E, 2I], a matrix [E, a, 2I])."""
    layout = LAYOUTS[name]
    stored = torch.randn(3, 8) if name == "bias_interleaved" else torch.randn(3, 4, 8)
    assert torch.equal(layout.to_disk(layout.from_disk(stored)), stored)


def test_an_unknown_layout_is_refused_naming_the_key_and_the_layouts():
    with pytest.raises(ValueError, match=r"'mlp\.experts\.x'.*'rotated'.*bias_interleaved"):
        layout_of(Converted("mlp.experts.x", "rotated"))


def test_a_fused_bank_under_another_prefix_reads_as_its_per_expert_matrices(tmp_path):
    """as_our_keys (a file's other hub layout, Qwen3.5's): a bank [E, 2I, D] stored fused under
    model.language_model. reads, through WeightFile's plain reads of byte ranges, as each expert's gate rows and up
    rows under model.; other keys keep theirs; a bank whose rows do not split evenly is refused, naming its key."""
    from safetensors.torch import save_file
    from minimoe.loading.weight_file import SAFETENSORS_DTYPES, WeightFile
    from minimoe.loading.layouts import as_our_keys
    bank, disk = torch.randn(3, 8, 5).to(torch.bfloat16), "model.language_model.layers.1.mlp.experts.gate_up_proj"
    save_file({disk: bank, "lm_head.weight": torch.randn(2, 5)}, tmp_path / "m.safetensors")
    weights = WeightFile(tmp_path / "m.safetensors")
    parts = ("mlp.experts.{j}.gate_proj.weight", "mlp.experts.{j}.up_proj.weight")
    view = lambda banks: as_our_keys(weights.entries, {"model.language_model.": "model."}, banks,
                                     lambda dtype: SAFETENSORS_DTYPES[dtype].itemsize)
    entries, became = view({"mlp.experts.gate_up_proj": parts})
    assert became["lm_head.weight"] == ["lm_head.weight"] and len(became[disk]) == 6
    weights.entries = entries
    with open(tmp_path / "m.safetensors", "rb") as f:
        for j in range(3):
            for p, name in enumerate(("gate", "up")):
                out = torch.empty(4, 5, dtype=torch.bfloat16)
                weights.read_into(f"model.layers.1.mlp.experts.{j}.{name}_proj.weight", out, f)
                assert torch.equal(out, bank[j, 4 * p:4 * (p + 1)]), (j, name)
    weights = WeightFile(tmp_path / "m.safetensors")
    with pytest.raises(ValueError, match=r"gate_up_proj'.*8 rows to split evenly into 3 parts"):
        view({"mlp.experts.gate_up_proj": parts + ("mlp.experts.{j}.x.weight",)})
