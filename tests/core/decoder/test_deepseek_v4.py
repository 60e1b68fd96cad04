"""DeepSeek-V4's record and the rules where the paper and transformers are silent (its parity with transformers 5.23:
tests/core/decoder/test_families_parity.py, tf5): hash-routed layers are outside every method's scope and report no
routing; config.json's two ropes are read or refused by name; the generation cache holds the compressors' running
windows, each row's counted from its first real token."""
import pytest
import torch

import minimoe
from minimoe.core.routing_methods.methods import set_router
from minimoe.core.routing_methods.routing import NativeRouter, moe_blocks
from minimoe.core.token_mixers.compressed_attention import CSA, HCA
from minimoe.core.token_mixers.mixers import KVCache
from minimoe.loading.config_json import config_from_dict, config_to_dict
from tests.conftest import tiny_config, tiny_model
from tests.core.decoder.test_model import rel_err


def test_hash_layers_are_not_routers_for_the_methods():
    model = tiny_model("deepseek_v4")
    assert model.config.hash_layers == [0] and sorted(moe_blocks(model)) == [1, 2]
    set_router(model, "tes", layers="all")
    assert type(model.model.layers[0].mlp.router) is NativeRouter  # never replaced
    assert type(model.model.layers[1].mlp.router) is not NativeRouter
    with pytest.raises(ValueError, match=r"layer index 0 is out of range.*MoE layers are \[1, 2\]; dense and hash-routed"):
        set_router(model, "tes", layers=[0])
    out = model(torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0)))
    assert out.routings[0] is None and out.routings[1].prediction is not None


def test_the_hash_table_picks_the_experts():
    model = tiny_model("deepseek_v4")
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
        model.model.layers[0].mlp.gate.tid2eid.copy_(model.model.layers[0].mlp.gate.tid2eid.flip(0))
        assert not torch.allclose(model(ids).logits, before)


def test_config_json_ropes_are_read_or_refused_by_name():
    d = config_to_dict(tiny_config("deepseek_v4"))
    assert d["rope_parameters"]["compress"]["rope_theta"] == 40000.0 and "mixer_types" not in d
    assert config_from_dict(d).flat() == tiny_config("deepseek_v4").flat()
    nested = {**d["rope_parameters"], "compress": {**d["rope_parameters"]["compress"], "rope_theta": 5.0}}
    with pytest.raises(ValueError, match="rope_parameters = .* runs with"):  # disagrees with compress_rope_theta
        config_from_dict({**d, "rope_parameters": nested})
    legacy = {k: v for k, v in d.items() if k != "rope_parameters"}  # the release's: YaRN as rope_scaling
    yarn = {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64}
    config = config_from_dict({**legacy, "rope_scaling": yarn})
    assert config.mixers["compressed"].compress_rope_scaling == {"rope_type": "yarn", "factor": 16.0,
                                                                 "original_max_position_embeddings": 64,
                                                                 "attention_factor": 1.0}


def test_cached_decoding_equals_full_forwards_across_windows():
    """Prefill 7 columns, then steps of 1, 3 and 6 and single tokens up to 30, on a row and on one left-padded by 5:
    CSA's windows of 4 (its overlap and its indexer's), HCA's of 8 and the sliding window of 6 are crossed mid-step
    and at step ends, and every step's logits are the full forward's (the series, the overlap, the entries, the
    windows closed in every row all held)."""
    model = tiny_model("deepseek_v4")
    opts = model.config.mixers["compressed"]
    assert opts.compress_rates == {CSA: 4, HCA: 8} and model.config.sliding_window == 6
    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, position_ids=pos).logits
        cache = KVCache(model.config, 2, 30, model.dtype, ids.device)
        steps, t = [], 0
        for n in [7, 1, 1, 3, 1, 6] + [1] * 11:
            steps.append(model(ids[:, t:t + n], attention_mask=mask[:, :t + n], position_ids=pos[:, t:t + n],
                               cache=cache).logits)
            t += n
    assert t == 30 and cache.layers[2].states["compressor"].closed == 25 // 8
    assert cache.layers[1].states["indexer"].closed == 25 // 4
    assert rel_err(torch.cat(steps, dim=1), full, mask) <= 2e-5


def test_left_padded_greedy_generation_equals_full_forwards_per_row():
    """generate() on three rows, two left-padded (by 4 and by 9 of 11: less than one HCA window, more than two CSA
    ones), 20 new tokens: each row's tokens are those of greedy full forwards over that row alone, without a cache
    (the compressors count each row's windows from its first real token, compressed_attention.py)."""
    model = tiny_model("deepseek_v4", std=0.3)
    ids = torch.randint(3, 128, (3, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :9] = 0
    tokens = minimoe.generate(model, ids, 20, attention_mask=mask)
    with torch.no_grad():
        for r in range(3):
            seq = ids[r:r + 1, mask[r].bool()]
            for _ in range(20):
                seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            assert torch.equal(tokens[r, -20:], seq[0, -20:]), r


def test_the_release_layout_loads_as_the_one_transformers_saves(tmp_path):
    """The release's files name the tensors without transformers' model. (embed.weight, norm.weight, hc_head_fn,
    layers.N.attn.wq_a.weight, ...): they load as the same model (Family.key_prefixes)."""
    import minimoe
    from safetensors.torch import load_file, save_file
    from minimoe.loading.checkpoint import save_pretrained
    model = tiny_model("deepseek_v4")
    save_pretrained(model, tmp_path / "saved")
    tensors = load_file(tmp_path / "saved" / "model.safetensors")
    assert "model.layers.1.attn.indexer.compressor.ape" in tensors and "head.weight" in tensors  # transformers' names
    renames = {"model.embed_tokens.": "embed.", "model.norm.": "norm.", "model.hc_head.hc_": "hc_head_",
               "model.layers.": "layers."}
    release = {next((new + k[len(old):] for old, new in renames.items() if k.startswith(old)), k): v
               for k, v in tensors.items()}
    assert "hc_head_fn" in release and "embed.weight" in release
    (tmp_path / "release").mkdir()
    save_file(release, str(tmp_path / "release" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "release" / "config.json").write_text((tmp_path / "saved" / "config.json").read_text())
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(minimoe.from_pretrained(tmp_path / "release")(ids).logits, model(ids).logits)
