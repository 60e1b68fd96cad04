"""Checkpoint I/O: sharded files, the hub path through an offline cache, export round trip, bad input."""
import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import minimoe
from minimoe.loading.checkpoint import checkpoint_tensors, save_pretrained
from minimoe.loading.weight_file import WeightFile
from minimoe.loading.hub import HUB_FILES, resolve_checkpoint
from tests.conftest import oracle, tiny_model

transformers = oracle("transformers")  # its tests skip without the test extra

IDS = torch.tensor([[5, 9, 17, 33, 65, 7, 11, 13]])


def assert_same_params(a, b):
    sa, sb = dict(a.named_parameters()), dict(b.named_parameters())
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_export_round_trip_through_transformers(family, tmp_path):
    """save_pretrained writes the official layout: transformers loads it and gives our logits."""
    ours = tiny_model(family)
    save_pretrained(ours, tmp_path / "out")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    with torch.no_grad():
        want, got = ref(IDS).logits, ours(IDS).logits
    assert ((got - want).abs().max() / want.abs().max()).item() <= 2e-5
    assert_same_params(ours, minimoe.from_pretrained(tmp_path / "out"))


def test_official_key_names_on_disk(tmp_path):
    """Granite keeps its fused banks and tied head; OLMoE is written per expert, as the releases are."""
    save_pretrained(tiny_model("granitemoe"), tmp_path / "g")
    keys = load_file(tmp_path / "g" / "model.safetensors").keys()
    assert "model.layers.0.block_sparse_moe.input_linear.weight" in keys
    assert "model.layers.0.block_sparse_moe.router.layer.weight" in keys
    assert "lm_head.weight" not in keys
    save_pretrained(tiny_model("olmoe"), tmp_path / "o")
    tensors = load_file(tmp_path / "o" / "model.safetensors")
    assert tensors["model.layers.1.mlp.experts.7.gate_proj.weight"].shape == (32, 64)
    assert tensors["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (64, 32)
    assert "lm_head.weight" in tensors


def test_sharded_checkpoint_loads(family, tmp_path):
    """A checkpoint split over several files with model.safetensors.index.json loads identically."""
    model = tiny_model(family)
    save_pretrained(model, tmp_path / "sharded", max_shard_bytes=64 * 1024)
    files = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(files) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert_same_params(model, minimoe.from_pretrained(tmp_path / "sharded"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "sharded")  # the official reader agrees
    assert ref.config.model_type == family


def test_dtype_conversion_on_load(tmp_path):
    """dtype=None keeps the checkpoint's dtype; an explicit dtype converts every tensor."""
    save_pretrained(tiny_model("olmoe"), tmp_path / "m")
    assert minimoe.from_pretrained(tmp_path / "m").dtype == torch.float32
    model = minimoe.from_pretrained(tmp_path / "m", dtype=torch.bfloat16)
    want = tiny_model("olmoe").to(torch.bfloat16)
    assert_same_params(model, want)  # the same rounding as a plain .to(bfloat16)


def test_loaded_parameters_own_their_memory(family, tmp_path):
    """No parameter is a view into a mapped file or a larger buffer: the peak stays one checkpoint."""
    save_pretrained(tiny_model(family), tmp_path / "m", max_shard_bytes=64 * 1024)
    model = minimoe.from_pretrained(tmp_path / "m")
    storages = set()
    for name, p in model.named_parameters():
        storage = p.untyped_storage()
        assert storage.nbytes() == p.numel() * p.element_size() and p.data_ptr() == storage.data_ptr(), name
        storages.add(storage.data_ptr())
    assert len(storages) == len(list(model.parameters()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_weight_file_reads_what_safe_open_reads(family, dtype, tmp_path):
    """Our reader (`WeightFile`) against the reference, safetensors' own `safe_open`: every key of a
    sharded checkpoint, bit for bit in the disk dtype, and converted to fp32 into a strided tensor."""
    save_pretrained(tiny_model(family).to(dtype), tmp_path / "m", max_shard_bytes=64 * 1024)
    files = sorted((tmp_path / "m").glob("*.safetensors"))
    assert len(files) > 1
    seen = 0
    for path in files:
        ours = WeightFile(path)
        with safe_open(str(path), framework="pt") as ref, open(path, "rb") as f:
            assert sorted(ours.keys()) == sorted(ref.keys())
            for key in ref.keys():
                want = ref.get_tensor(key)
                got = torch.empty(want.shape, dtype=want.dtype)
                ours.read_into(key, got, f)
                assert want.dtype == dtype and torch.equal(got, want), key
                dims = list(range(want.dim()))[::-1]  # reversed strides: not contiguous from 2-D on
                strided = torch.empty(want.shape[::-1], dtype=torch.float32).permute(dims)
                ours.read_into(key, strided, f)
                assert torch.equal(strided, want.float()), key
                seen += 1
    assert seen == len(checkpoint_tensors(tiny_model(family)))


def test_tensors_advised_onto_huge_pages_load_the_saved_values(tmp_path, monkeypatch):
    """Parameters of 4 MB and more are advised onto 2 MB pages before the file is read into them
    (here the two 5 MB fp32 embedding tables; in bf16 they are 2.6 MB and left alone). Either way
    the values are the saved ones."""
    import minimoe.loading.checkpoint
    advised = []
    advise = minimoe.loading.checkpoint.advise_huge_pages
    monkeypatch.setattr(minimoe.loading.checkpoint, "advise_huge_pages", lambda t: advised.append(t.nbytes) or advise(t))
    model = tiny_model("olmoe", vocab_size=20_000)
    save_pretrained(model, tmp_path / "m")
    for dtype in (torch.float32, torch.bfloat16):
        advised.clear()
        loaded = minimoe.from_pretrained(tmp_path / "m", dtype=dtype)
        assert_same_params(loaded, model.to(dtype))
        assert sum(n >= 4 * 2**20 for n in advised) == (2 if dtype == torch.float32 else 0)
        assert len(advised) == len(list(loaded.parameters()))


def populate_hub_cache(cache, repo_id, source, commit="0123456789abcdef0123456789abcdef01234567"):
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<commit>/files}."""
    root = cache / f"models--{repo_id.replace('/', '--')}"
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    for f in source.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    return snap


@pytest.fixture
def offline(monkeypatch):
    import huggingface_hub.constants as hub_constants
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)


@pytest.mark.plain
def test_hub_id_through_offline_cache(tmp_path, offline):
    """A hub repo id resolves to an already-populated cache with HF_HUB_OFFLINE=1 (no network)."""
    model = tiny_model("olmoe")
    save_pretrained(model, tmp_path / "src")
    snap = populate_hub_cache(tmp_path / "cache", "allenai/OLMoE-tiny", tmp_path / "src")
    assert resolve_checkpoint("allenai/OLMoE-tiny", cache_dir=tmp_path / "cache") == snap
    assert_same_params(model, minimoe.from_pretrained("allenai/OLMoE-tiny", cache_dir=tmp_path / "cache"))


@pytest.mark.plain
def test_hub_id_not_cached_offline_says_so_and_what_to_do(tmp_path, offline):
    with pytest.raises(FileNotFoundError, match=r"not in the local cache .* HF_HUB_OFFLINE=1 forbids downloads; pass a "
                       r"local checkpoint folder .* in its place, or use HF_HUB_OFFLINE=0 to download it"):
        minimoe.from_pretrained("allenai/not-downloaded", cache_dir=tmp_path / "empty")


def test_hub_download_asks_only_for_checkpoint_files():
    """Only config, safetensors, index and tokenizer files are fetched, never *.bin or *.pt."""
    assert "*.safetensors" in HUB_FILES and "config.json" in HUB_FILES and "tokenizer.json" in HUB_FILES
    assert not any(p.endswith((".bin", ".pt", ".pth", "*")) and p != "*.safetensors" for p in HUB_FILES)


# ----------------------------------------------------------------------------- bad input

@pytest.fixture
def saved(tmp_path):
    save_pretrained(tiny_model("olmoe"), tmp_path / "m")
    return tmp_path / "m"


def rewrite(path, change):
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_key_is_named(saved):
    rewrite(saved, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(KeyError, match="experts.3.up_proj"):
        minimoe.from_pretrained(saved)


def test_unexpected_key_is_named(saved):
    rewrite(saved, lambda t: t.__setitem__("model.layers.0.mlp.shared_expert.weight", torch.zeros(2)))
    with pytest.raises(KeyError, match="shared_expert"):
        minimoe.from_pretrained(saved)


def test_shape_mismatch_is_named(saved):
    rewrite(saved, lambda t: t.__setitem__("model.layers.0.self_attn.q_proj.weight", torch.zeros(64, 32)))
    with pytest.raises(ValueError, match=r"q_proj.weight.*\(64, 32\).*expected \(64, 64\)"):
        minimoe.from_pretrained(saved)


def test_granite_checkpoint_read_as_olmoe_is_refused(tmp_path):
    """A wrong-family checkpoint: the config says olmoe, the tensors are Granite's."""
    save_pretrained(tiny_model("granitemoe"), tmp_path / "g")
    cfg = json.loads((tmp_path / "g" / "config.json").read_text())
    cfg.update(model_type="olmoe", num_experts=cfg.pop("num_local_experts"))
    (tmp_path / "g" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(KeyError, match="block_sparse_moe"):
        minimoe.from_pretrained(tmp_path / "g")


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(model_type="llama"), "unknown model_type 'llama'"),
    (lambda c: c.pop("hidden_size"), r"missing field\(s\) \['hidden_size'\]"),
    (lambda c: c.update(num_experts_per_tok=99), "num_experts_per_tok"),
])
def test_bad_config_is_named(saved, change, message):
    cfg = json.loads((saved / "config.json").read_text())
    change(cfg)
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        minimoe.from_pretrained(saved)


def test_missing_config_and_weights_are_named(saved):
    (saved / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        minimoe.from_pretrained(saved)
    (saved / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        minimoe.from_pretrained(saved)


def test_truncated_file_is_named(saved):
    f = saved / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors.*truncated"):
        minimoe.from_pretrained(saved)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json"])
def test_truncated_json_is_named(saved, name):
    (saved / name).write_text('{"model_type": "olmoe", "vocab_si')
    with pytest.raises(ValueError, match=f"{saved / name}: not .*truncated or corrupt"):
        (minimoe.from_pretrained if name == "config.json" else minimoe.load_tokenizer)(saved)


def test_corrupt_header_is_named(saved):
    f = saved / "model.safetensors"
    f.write_bytes(b"\xff" * 8 + f.read_bytes()[8:])
    with pytest.raises(ValueError, match="model.safetensors.*not a readable safetensors file"):
        minimoe.from_pretrained(saved)


def test_index_naming_the_wrong_shard_is_named(tmp_path):
    save_pretrained(tiny_model("olmoe"), tmp_path / "s", max_shard_bytes=64 * 1024)
    index_path = tmp_path / "s" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    holder = index["weight_map"]["model.norm.weight"]
    index["weight_map"]["model.norm.weight"] = next(f for f in sorted(set(index["weight_map"].values())) if f != holder)
    index_path.write_text(json.dumps(index))
    with pytest.raises(KeyError, match="model.norm.weight.*does not hold it"):
        minimoe.from_pretrained(tmp_path / "s")


def test_missing_shard_is_named(tmp_path):
    save_pretrained(tiny_model("olmoe"), tmp_path / "s", max_shard_bytes=64 * 1024)
    victim = sorted((tmp_path / "s").glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        minimoe.from_pretrained(tmp_path / "s")


def test_nonexistent_folder_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such checkpoint folder"):
        minimoe.from_pretrained(tmp_path / "nowhere")


def test_save_is_atomic(tmp_path, monkeypatch):
    """A save that fails half-way leaves the previous checkpoint in place and no partial folder."""
    import minimoe.loading.checkpoint as ck
    model = tiny_model("olmoe")
    save_pretrained(model, tmp_path / "m")
    before = (tmp_path / "m" / "model.safetensors").read_bytes()

    def broken(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(ck, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(tiny_model("olmoe", seed=5), tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["m"]


@pytest.mark.plain
def test_load_tokenizer_reads_tokenizer_json_and_special_ids(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["Question: what is an expert?\nAnswer: a small network"] * 10,
                            trainers.BpeTrainer(vocab_size=100, special_tokens=["<unk>", "<pad>", "<eos>"]))
    save_pretrained(tiny_model("olmoe"), tmp_path / "m")
    tok.save(str(tmp_path / "m" / "tokenizer.json"))
    loaded = minimoe.load_tokenizer(tmp_path / "m")
    assert (loaded.pad_token_id, loaded.eos_token_id) == (1, 2)
    ids = loaded.encode("Question: what is an expert?")
    assert ids == tok.encode("Question: what is an expert?").ids
    assert loaded.decode(ids) == "Question: what is an expert?"


def test_atomic_file_replaces_whole_or_not_at_all(tmp_path):
    from minimoe.atomic import atomic_file
    target = tmp_path / "selection.json"
    target.write_text("old")
    with pytest.raises(RuntimeError, match="crash"):
        with atomic_file(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("crash")
    assert target.read_text() == "old" and sorted(os.listdir(tmp_path)) == ["selection.json"]
    with atomic_file(target) as tmp:
        tmp.write_text("new")
        assert target.read_text() == "old"  # nothing visible until the block succeeds
    assert target.read_text() == "new" and sorted(os.listdir(tmp_path)) == ["selection.json"]


def test_atomic_directory_has_the_mode_of_a_folder_the_user_makes(tmp_path):
    """Not tempfile's private 0700: run folders, checkpoints and evaluations are shared on clusters."""
    from minimoe.atomic import atomic_directory
    (tmp_path / "plain").mkdir()
    with atomic_directory(tmp_path / "ours", "evaluation") as tmp:
        (tmp / "a").write_text("1")
    assert (tmp_path / "ours").stat().st_mode == (tmp_path / "plain").stat().st_mode


def test_atomic_directory_replaces_only_its_own_folders(tmp_path):
    """A folder replaces one it wrote with the same kind (or an empty one); anything else is refused, untouched."""
    from minimoe.atomic import atomic_directory
    target = tmp_path / "out"
    target.mkdir()  # empty: nothing to lose
    with atomic_directory(target, "evaluation") as tmp:
        (tmp / "a").write_text("1")
    with atomic_directory(target, "evaluation") as tmp:
        (tmp / "a").write_text("2")
    assert (target / "a").read_text() == "2"
    with pytest.raises(FileExistsError, match=f"{target}: exists and holds minimoe's 'evaluation' output, not 'ad"):
        with atomic_directory(target, "adapter") as tmp:
            (tmp / "a").write_text("3")
    foreign = tmp_path / "run"
    foreign.mkdir()
    (foreign / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match=f"{foreign}: exists and was not written by minimoe"):
        with atomic_directory(foreign, "evaluation"):
            raise AssertionError("refused before the block runs")
    assert (target / "a").read_text() == "2" and [p.name for p in foreign.iterdir()] == ["config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"]
    from minimoe.loading.checkpoint import save_pretrained
    save_pretrained(tiny_model("olmoe"), tmp_path / "m")
    save_pretrained(tiny_model("olmoe", seed=5), tmp_path / "m")  # a checkpoint over one we wrote: fine


def test_full_disk_in_safetensors_names_the_folder(tmp_path, monkeypatch):
    """safetensors reports ENOSPC as SafetensorError: it comes out as an OSError naming the target folder."""
    import minimoe.loading.checkpoint as ck
    from safetensors import SafetensorError

    def full(*a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(ck, "save_file", full)
    with pytest.raises(OSError, match=f"{tmp_path / 'm'}: could not write it.*No space left"):
        ck.save_pretrained(tiny_model("olmoe"), tmp_path / "m")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("family, missing, unexpected, misshaped", [
    ("qwen3_moe", "model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.gate.weight",
     "model.layers.0.self_attn.q_norm.weight"),
    ("qwen2_moe", "model.layers.0.mlp.shared_expert_gate.weight", "model.layers.0.self_attn.o_proj.bias",
     "model.layers.1.mlp.shared_expert.down_proj.weight"),
    ("mixtral", "model.layers.1.block_sparse_moe.experts.5.w3.weight", "model.layers.0.mlp.gate.weight",
     "model.layers.0.block_sparse_moe.gate.weight"),
    ("granitemoeshared", "model.layers.1.shared_mlp.output_linear.weight", "model.layers.0.shared_mlp.gate_proj.weight",
     "model.layers.0.shared_mlp.input_linear.weight"),
    ("flex_olmo", "model.layers.1.post_feedforward_layernorm.weight", "model.layers.0.input_layernorm.weight",
     "model.layers.0.self_attn.k_norm.weight"),
    ("glm4_moe", "model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.0.self_attn.o_proj.bias",
     "model.layers.1.mlp.shared_experts.up_proj.weight"),
    ("llama4_text", "model.layers.1.feed_forward.experts.gate_up_proj", "model.layers.0.feed_forward.router.weight",
     "model.layers.1.feed_forward.experts.down_proj"),
])
def test_each_new_family_loads_by_hub_id_and_its_bad_keys_are_named(family, missing, unexpected, misshaped,
                                                                       tmp_path, offline):
    """A transformers-saved checkpoint of the family through the hub path gives transformers' logits; a
    missing, an unexpected (a dense layer's router, a bias the family lacks) and a mis-shaped key are named."""
    from tests.core.decoder.test_model import FP32_TOL, batch, reference_model, rel_err, tiny
    ref = reference_model(tiny(family), path := tmp_path / "ref")
    populate_hub_cache(tmp_path / "cache", f"org/{family}-tiny", path)
    ours = minimoe.from_pretrained(f"org/{family}-tiny", cache_dir=tmp_path / "cache")
    ids, mask = batch(ours)
    with torch.no_grad():
        assert rel_err(ours(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits, mask) <= FP32_TOL
    for change, error, match in [(lambda t: t.pop(missing), KeyError, f"missing key '{missing}'"),
                                 (lambda t: t.__setitem__(unexpected, torch.zeros(2)), KeyError,
                                  f"unexpected key '{unexpected}'"),
                                 (lambda t: t.__setitem__(misshaped, torch.zeros(3)), ValueError,
                                  f"'{misshaped}' has shape \\(3,\\); expected")]:
        folder = tmp_path / "bad"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(path, folder)
        rewrite(folder, change)
        with pytest.raises(error, match=match):
            minimoe.from_pretrained(folder)
