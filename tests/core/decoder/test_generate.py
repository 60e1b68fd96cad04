"""KV-cache generation against transformers' generate, token for token."""
import torch

import minimoe
from tests.conftest import oracle, tiny_model


transformers = oracle("transformers")  # its tests skip without the test extra


def reference(model, tmp_path):
    minimoe.save_pretrained(model, tmp_path / "m")
    return transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", attn_implementation="eager").eval()


def test_greedy_matches_transformers(family, tmp_path):
    model = tiny_model(family, std=0.3)
    ref = reference(model, tmp_path)
    ids = torch.tensor([[5, 9, 17, 33, 65, 7], [8, 4, 100, 3, 12, 90]])
    want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                        eos_token_id=None, pad_token_id=model.config.pad_token_id)
    got = minimoe.generate(model, ids, max_new_tokens=12)
    assert torch.equal(got, want)


def test_left_padded_batch_matches_transformers(tmp_path):
    """Left padding as transformers pads for generation; positions count real tokens only."""
    model = tiny_model("olmoe", std=0.3)
    ref = reference(model, tmp_path)
    pad = model.config.pad_token_id
    ids = torch.tensor([[pad, pad, 17, 33, 65, 7], [8, 4, 100, 3, 12, 90]])
    mask = (ids != pad).long()
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=pad)
    got = minimoe.generate(model, ids, attention_mask=mask, max_new_tokens=8)
    assert torch.equal(got, want)
    alone = minimoe.generate(model, ids[:1, 2:], max_new_tokens=8)
    assert torch.equal(got[0, 2:], alone[0])


def test_cached_decoding_equals_full_recompute(family):
    """Each cached step's logits equal a full forward over the whole prefix."""
    model = tiny_model(family)
    ids = torch.tensor([[5, 9, 17, 33, 65, 7, 11]])
    out = minimoe.generate(model, ids, max_new_tokens=6)
    with torch.no_grad():
        full = model(out[:, :-1]).logits.argmax(-1)
    assert torch.equal(full[0, ids.shape[1] - 1:], out[0, ids.shape[1]:])


def test_sampling_is_seeded_and_top_k_one_is_greedy():
    model = tiny_model("olmoe", std=0.3)
    ids = torch.tensor([[5, 9, 17]])
    a = minimoe.generate(model, ids, 10, temperature=1.0, generator=torch.Generator().manual_seed(3))
    b = minimoe.generate(model, ids, 10, temperature=1.0, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    one = minimoe.generate(model, ids, 10, temperature=0.7, top_k=1, generator=torch.Generator().manual_seed(4))
    assert torch.equal(one, minimoe.generate(model, ids, 10))


def test_generation_stops_at_eos():
    model = tiny_model("olmoe", std=0.3)
    ids = torch.tensor([[5, 9, 17]])
    greedy = minimoe.generate(model, ids, 10)
    eos = int(greedy[0, 5])  # pretend the third new token is the end of text
    out = minimoe.generate(model, ids, 10, eos_token_id=eos)
    assert out.shape[1] == 6 and int(out[0, -1]) == eos
