"""--quantize nf4 on the 2026 families' checkpoints (`--model tiny:<family>`, each in its family's layout of the hub
keys: fused, renamed and latent expert banks, MLA with and without the DSA indexer, the recurrent mixers'
projections): packing while loading equals packing after a dense load, the packed logits err from the dense base's
as much as torchao's own dequantisation in place and no more (test_quantized's rule), and the dequantised model
(export.py --merged's base) computes what the packed one does; a DSA indexer, and DeepSeek-V4's CSA indexer, stay
dense. Every method training on each of them with a packed base: test_quantized.py's
test_methods_train_on_every_family_with_a_packed_base."""
import pytest
import torch

pytest.importorskip("torchao")  # the quant extra (and the test extra)

from minimoe.core.adaptation import quantized  # noqa: E402
from minimoe.loading.checkpoint import from_pretrained  # noqa: E402
from minimoe.making.tiny import tiny_checkpoint, tiny_model  # noqa: E402
from tests.conftest import TRANSFORMERS_5_ONLY  # noqa: E402

DSA = ["deepseek_v32", "glm_moe_dsa"]


@pytest.mark.parametrize("family", sorted(TRANSFORMERS_5_ONLY))
def test_a_2026_checkpoint_packs_as_read_and_errs_as_nf4_alone(family):
    folder = tiny_checkpoint(family)
    read = from_pretrained(folder, dtype="float32", quantize="nf4")
    dense, after, library = (from_pretrained(folder, dtype="float32") for _ in range(3))
    names = quantized.quantized_modules(dense)
    assert names and {n for n, m in read.named_modules() if quantized.is_quantized(m)} == set(names)
    quantized.quantize_model(after, "nf4")
    for name in names:  # through the family's record: its fused and converted keys packed as read
        a, b = read.get_submodule(name).packed, after.get_submodule(name).packed
        for part, t in a.tensors().items():
            assert torch.equal(t, b.tensors()[part]), (name, part)
    with torch.no_grad():
        for name in names:  # the same values, dense (NF4Weight equals torchao's get_original_weight: test_quantized)
            w = library.get_submodule(name).weight
            w.copy_(quantized.NF4Weight(w).dequantize_into(torch.empty_like(w)))
        ids = torch.randint(3, dense.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        y, y_read, y_lib = (m.eval()(ids).logits for m in (dense, read, library))
        err, err_lib = ((a - y).norm() / y.norm() for a in (y_read, y_lib))
        assert 0 < err < 1 and err <= err_lib * (1 + 1e-5), (family, err.item(), err_lib.item())
        torch.testing.assert_close(quantized.dequantize_model(read)(ids).logits, y_read, rtol=0, atol=0)


@pytest.mark.parametrize("family", [*DSA, "deepseek_v4"])
def test_a_dsa_indexer_stays_dense_under_nf4(family):
    """Its top-k picks each query's keys, as a gate picks experts, and 4-bit storage flips those picks
    (docs/quantization.md: measured): the indexer's projections are left as loaded, the attention's around it
    packed. DeepSeek-V4's CSA indexer (its compressor's) too, on the same measure."""
    model = quantized.quantize_model(tiny_model(family), "nf4")
    indexers = [n for n, _ in model.named_modules() if n.endswith(".indexer")]
    assert indexers
    for name in indexers:
        attention = name[:name.index(".self_attn.") + len(".self_attn")]
        assert not [n for n, m in model.get_submodule(name).named_modules() if quantized.is_quantized(m)], name
        assert quantized.is_quantized(model.get_submodule(f"{attention}.q_b_proj")), attention
