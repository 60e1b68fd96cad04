"""--quantize-embedding (core/adaptation/packed_embedding.py): the table packed in NF4, rows dequantised as looked up,
against torchao's own dequantisation of the whole table."""
import pytest
import torch

pytest.importorskip("torchao")  # the quant extra (and the test extra); a plain install skips these tests

from minimoe.core.adaptation.lora import add_lora  # noqa: E402
from minimoe.core.adaptation.packed_embedding import pack_embedding, nf4_rows  # noqa: E402
from minimoe.core.adaptation.quantized import NF4Weight, dequantize_model, is_quantized  # noqa: E402
from minimoe.making.tiny import tiny_model  # noqa: E402

nf4_tensor = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_looked_up_rows_are_torchaos_dequantised_table_bit_for_bit(dtype):
    """A [1000, 192] table (3 NF4 blocks a row; 3000 blocks, so second-level scaler blocks of 8 that straddle rows):
    the rows of any ids, repeated, first and last included, in any shape, equal torchao's to_nf4(table)
    .get_original_weight() at those rows, bit for bit."""
    g = torch.Generator().manual_seed(0)
    table = torch.randn(1000, 192, generator=g).to(dtype)
    reference = nf4_tensor.to_nf4(table, 64, 8).get_original_weight()
    ids = torch.cat([torch.tensor([0, 999, 5, 5]), torch.randint(0, 1000, (60,), generator=g)]).view(4, 16)
    rows = nf4_rows(NF4Weight(table), ids)
    assert rows.shape == (4, 16, 192) and rows.dtype == dtype
    assert torch.equal(rows, reference[ids])


def test_a_packed_embedding_gives_the_logits_of_its_dequantised_table_and_trains_no_table():
    """A tiny OLMoE (untied) with LoRA: its embedding packed gives the logits of the same model with the table
    replaced by torchao's dequantisation of it, bit for bit; a LoRA step puts no gradient on the table (the packed
    table has none to hold), and dequantize_model gives back the dense table torchao's dequantisation is."""
    torch.manual_seed(0)
    model = add_lora(tiny_model("olmoe").to(torch.bfloat16), rank=4)
    table = model.model.embed_tokens.weight.detach().clone()
    reference = nf4_tensor.to_nf4(table, 64, NF4Weight(table).scalers.shape[1] // NF4Weight(table).factors.shape[1])
    ids = torch.randint(0, table.shape[0], (2, 12))
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(reference.get_original_weight())
        want = model(ids).logits
        model.model.embed_tokens.weight.copy_(table)
    pack_embedding(model)
    embedding = model.model.embed_tokens
    assert is_quantized(embedding) and embedding.weight.shape == table.shape and embedding.weight.stride() == (0, 0)
    out = model(ids).logits
    assert torch.equal(out, want)
    out.float().logsumexp(-1).sum().backward()
    assert any(p.grad is not None for n, p in model.named_parameters() if "lora" in n)
    assert not any(p.grad is not None for n, p in model.named_parameters() if "embed" in n)
    dequantize_model(model)
    assert torch.equal(model.model.embed_tokens.weight, reference.get_original_weight())


def test_a_tied_table_is_refused():
    model = tiny_model("olmoe")
    model.lm_head.weight = model.model.embed_tokens.weight
    with pytest.raises(ValueError, match="ties its embedding to its LM head"):
        pack_embedding(model)
