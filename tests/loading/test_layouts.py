"""The checkpoint's tensor layouts (minimoe/loading/layouts.py): every `Converted` entry of every family's
record names a layout there, each layout's save undoes its load exactly, and an unknown name is refused
with the names there are."""
import pytest
import torch

from minimoe.core.decoder.families import FAMILIES, Converted
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
