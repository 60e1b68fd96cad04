"""What fits where (minimoe/runs/memory.py): its weight figures held to the real safetensors files of a
saved tiny model, the per-GPU split, and the verdict."""
import json
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minimoe.loading.checkpoint import save_pretrained
from minimoe.cli import memory_estimate
from minimoe.runs import memory
from tests.conftest import tiny_model


def tensor_bytes(path) -> int:
    """A safetensors file's tensor bytes, from its size: the file less its 8-byte length and its header."""
    with open(path, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
    return path.stat().st_size - 8 - header


@pytest.mark.parametrize("family", ["granitemoe", "olmoe", "granitemoeshared", "flex_olmo", "glm4_moe", "llama4_text",
                                    "gemma4_text"])
def test_weight_figures_are_the_safetensors_sizes(tmp_path, family):
    save_pretrained(tiny_model(family), tmp_path / "m", max_shard_bytes=200_000)  # several shards and an index
    files = sorted((tmp_path / "m").glob("*.safetensors"))
    assert len(files) > 1
    on_disk = sum(tensor_bytes(f) for f in files)  # float32
    assert memory.stored_weights(tmp_path / "m") == on_disk
    import torch
    assert memory.stored_weights(tmp_path / "m", torch.bfloat16) == on_disk // 2
    one = memory_estimate.main([str(tmp_path / "m"), "--gpus", "1", "--dtype", "float32"])
    assert one.weights == on_disk  # one GPU holds it all
    ddp = memory_estimate.main([str(tmp_path / "m"), "--gpus", "4", "--shard", "ddp", "--dtype", "float32"])
    assert ddp.weights == on_disk and ddp.lora == one.lora  # DDP: every rank the whole model
    fsdp = memory_estimate.main([str(tmp_path / "m"), "--gpus", "4", "--shard", "fsdp", "--dtype", "float32"])
    assert on_disk / 4 <= fsdp.weights - 2 * layer_bytes(tmp_path / "m") < on_disk / 4 * 1.1  # rows, + 2 layers
    assert fsdp.lora * 4 == pytest.approx(one.lora, abs=4)
    # the first rank's rows of each tensor (ceil(n / 4)) and each tensor's step: a little over a quarter
    assert one.optimizer / 4 <= fsdp.optimizer <= one.optimizer / 4 * 1.002


def layer_bytes(folder) -> int:
    """The largest decoder layer's bytes, from the files' headers (FSDP gathers one, prefetches the next)."""
    from minimoe.loading.weight_file import WeightFile
    sizes = {}
    for file in folder.glob("*.safetensors"):
        for key, entry in WeightFile(file).entries.items():
            if key.startswith("model.layers."):
                layer = int(key.split(".")[2])
                sizes[layer] = sizes.get(layer, 0) + entry["data_offsets"][1] - entry["data_offsets"][0]
    return max(sizes.values())


def test_the_verdict_and_the_table(tmp_path, capsys):
    save_pretrained(tiny_model("olmoe"), tmp_path / "m")
    assert memory_estimate.main([str(tmp_path / "m"), "--gpus", "2", "--gpu-memory", "16"]).fits
    small = memory_estimate.main([str(tmp_path / "m"), "--gpus", "2", "--gpu-memory", "0.001"])
    assert not small.fits and small.total > 0.9 * 0.001 * 2**30
    out = capsys.readouterr().out
    assert "does not fit" in out and "AdamW state" in out and "activations (estimate)" in out
    checkpointed = memory_estimate.main([str(tmp_path / "m"), "--gpus", "2", "--gradient-checkpointing"])
    assert checkpointed.activations < small.activations  # one vector a layer kept, not the whole set


def test_lora_figures_count_the_trainable_parameters(tmp_path):
    """8 bytes a trainable parameter for weights + gradients, 8 for AdamW's moments (and a step a tensor): the same count as the
    optimizer train.py makes (LoRA rank 8 on the family's targets, TES's error head)."""
    import torch
    from minimoe.runs.config import build_config
    from minimoe.runs.training import install_method
    save_pretrained(tiny_model("olmoe"), tmp_path / "m")
    cfg = build_config({"model": str(tmp_path / "m"), "method": "tes", "lora_rank": 8}, "olmoe")
    model = tiny_model("olmoe")
    install_method(model, cfg)
    trainable = [p for p in model.parameters() if p.requires_grad]
    estimate = memory_estimate.main([str(tmp_path / "m"), "--gpus", "1", "--method", "tes", "--lora-rank", "8",
                            "--recipe", "olmoe"])
    assert estimate.lora == estimate.optimizer - 4 * len(trainable) == 8 * sum(p.numel() for p in trainable)  # + steps
    assert json.dumps(vars(estimate))  # plain numbers


@pytest.mark.parametrize("family", ["gpt_oss", "granitemoe", "olmoe", "qwen3_moe"])
def test_the_recipe_is_the_familys_own(tmp_path, family):
    """Without --recipe the estimate takes the family record's recipe, as train.py does, and LoRA on the
    family's own targets whatever the recipe: gpt-oss trains Granite's targets (no o_proj), OLMoE O too."""
    from minimoe.core.decoder.family_record import family_of
    from minimoe.core.adaptation.lora import add_lora
    save_pretrained(tiny_model(family), tmp_path / "m")
    recipe = family_of(family).recipe
    ours = memory_estimate.main([str(tmp_path / "m"), "--gpus", "1", "--dtype", "float32"])
    named = memory_estimate.main([str(tmp_path / "m"), "--gpus", "1", "--dtype", "float32", "--recipe", recipe])
    other = memory_estimate.main([str(tmp_path / "m"), "--gpus", "1", "--dtype", "float32",
                         "--recipe", "olmoe" if recipe == "granite" else "granite"])
    model = add_lora(tiny_model(family), rank=8)  # its family's targets, counted directly
    assert ours.lora == named.lora == other.lora == 8 * sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("family,fmt", [("olmoe", "nf4"), ("deepseek_v2", "nf4"), ("gpt_oss", "mxfp4")])
def test_quantized_weight_figures_are_the_real_packed_sizes(tmp_path, family, fmt):
    """--quantize: the weight figure is what a model loaded with that quantize holds (its remaining
    parameters, its packed tensors' bytes) plus the largest packed matrix dequantised in the run's dtype.
    mxfp4: a tiny gpt-oss whose experts are stored in MXFP4, as the release stores them."""
    pytest.importorskip("torchao" if fmt == "nf4" else "transformers")
    import torch
    from minimoe.core.adaptation.quantized import is_quantized, packed_bytes
    from minimoe.loading.checkpoint import from_pretrained
    if fmt == "mxfp4":
        from tests.tiny_families import mxfp4_reference_model
        (tmp_path / "m").mkdir()
        mxfp4_reference_model(tmp_path / "m")
    else:
        save_pretrained(tiny_model(family), tmp_path / "m")
    for dtype in ("float32", "bfloat16"):
        model = from_pretrained(tmp_path / "m", dtype=dtype, quantize=fmt)
        largest = max(m.weight.numel() for m in model.modules() if is_quantized(m)) * getattr(torch, dtype).itemsize
        held = sum(p.numel() * p.element_size() for p in model.parameters()) + packed_bytes(model) + largest
        assert memory_estimate.main([str(tmp_path / "m"), "--dtype", dtype, "--quantize", fmt]).weights == held


@pytest.mark.parametrize("fmt", ["nf4", "mxfp4"])
def test_a_packed_embeddings_weight_figure_is_the_real_packed_size(tmp_path, fmt):
    """--quantize-embedding: the weight figure is what the loaded model holds once pack_embedding packs its table
    (the table at NF4's real size beside the packed base), plus the largest packed layer matrix dequantised (never
    the table: it is read by rows); the table saves its dense bytes less its packed ones."""
    pytest.importorskip("torchao")
    pytest.importorskip("transformers")
    from minimoe.core.adaptation.packed_embedding import pack_embedding
    from minimoe.core.adaptation.quantized import packed_bytes, quantized_modules
    from minimoe.loading.checkpoint import from_pretrained
    from tests.tiny_families import mxfp4_reference_model
    (tmp_path / "m").mkdir()
    mxfp4_reference_model(tmp_path / "m")  # gpt-oss: untied embedding and head, as the release
    model = pack_embedding(from_pretrained(tmp_path / "m", dtype="bfloat16", quantize=fmt))
    largest = max(model.get_submodule(n).weight.numel() for n in quantized_modules(model)) * 2
    held = sum(p.numel() * p.element_size() for p in model.parameters()) + packed_bytes(model) + largest
    flags = [str(tmp_path / "m"), "--dtype", "bfloat16", "--quantize", fmt]
    packed, dense = (memory_estimate.main(flags + extra).weights for extra in (["--quantize-embedding"], []))
    table = model.model.embed_tokens
    assert packed == held and dense - packed == table.weight.numel() * 2 - table.packed.nbytes > 0


def test_the_sharded_quantized_figure_is_a_ranks_share_two_gathered_layers_and_one_module(tmp_path):
    """--quantize nf4 --shard fsdp: the weights per GPU are the rank's bytes of the base (packed_shard_bytes, which
    tests/runs/test_sharded_load.py holds to what a sharded rank holds), plus the largest decoder layer as FSDP
    gathers it (its packed modules' whole records and its other parameters, counted here on a loaded packed
    model), twice, plus the largest packed module dequantised; under a quarter of the one-GPU packed figure at 8."""
    pytest.importorskip("torchao")
    import torch
    from minimoe.core.adaptation.quantized import is_quantized
    from minimoe.core.adaptation.sharded_nf4 import records_of
    from minimoe.core.decoder.model import MoEForCausalLM
    from minimoe.loading.checkpoint import from_pretrained
    save_pretrained(tiny_model("olmoe"), tmp_path / "m")
    model = from_pretrained(tmp_path / "m", dtype="float32", quantize="nf4")
    with torch.device("meta"):
        meta = MoEForCausalLM(model.config)
    layers = [sum(sum(p.nbytes for p in m.parameters(recurse=False)) + (records_of(m.packed).nbytes if is_quantized(m)
                                                                         else 0) for m in layer.modules())
              for layer in model.model.layers]
    largest = max(m.weight.numel() * 4 for m in model.modules() if is_quantized(m))
    for gpus in (2, 8):
        share = memory.packed_shard_bytes(meta, torch.float32, gpus)[0]
        flags = [str(tmp_path / "m"), "--dtype", "float32", "--quantize", "nf4", "--shard", "fsdp", "--gpus", str(gpus)]
        assert memory_estimate.main(flags).weights == share + 2 * max(layers) + largest
    one = memory_estimate.main([str(tmp_path / "m"), "--dtype", "float32", "--quantize", "nf4"]).weights
    assert share < one / 4


@pytest.mark.plain
def test_a_hub_id_not_cached_offline_is_one_line_that_says_what_to_do(tmp_path):
    """Issue 47: offline, an uncached hub id was a 29-line traceback here where train.py said it in one line;
    now both say it in one line, naming the two ways out (a local folder, HF_HUB_OFFLINE=0)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "MINIMOE_WEIGHTS")}
    env.update(HF_HOME=str(tmp_path / "empty"), HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "minimoe.runs.memory", "org/not-cached", "--gpus", "4"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stdout == "", (done.returncode, done.stderr)
    assert done.stderr.splitlines() == [
        "python -m minimoe.runs.memory: error: org/not-cached@main: not in the local cache (the Hugging Face default) "
        "and HF_HUB_OFFLINE=1 forbids downloads; pass a local checkpoint folder (config.json and *.safetensors) in its "
        "place, or use HF_HUB_OFFLINE=0 to download it"]


@pytest.mark.parametrize("family,flags,message", [
    ("olmoe", ["--quantize", "mxfp4"], "this model is olmoe; use --quantize nf4"),
    ("gpt_oss", ["--quantize", "mxfp4", "--gpus", "2", "--shard", "fsdp"], "--quantize mxfp4 with --shard fsdp"),
    ("olmoe", ["--gpu-memory", "-5"], "--gpu-memory -5: expected"),
    ("mixtral", ["--quantize", "nf4"], "not a multiple of NF4's block of 64"),  # [2 x 36, 60]: 4320 values
    ("olmoe", ["--quantize-embedding"], "give --quantize nf4"),
    ("olmoe", ["--quantize", "nf4", "--quantize-embedding", "--gpus", "2", "--shard", "fsdp"],
     "--quantize-embedding with --shard fsdp"),
    ("granitemoe", ["--quantize", "nf4", "--quantize-embedding"], "ties its embedding to its LM head"),
])
def test_what_train_py_refuses_is_not_sized(tmp_path, capsys, family, flags, message):
    """The memory command checks its settings with train.py's own check (install.check_model_settings):
    MXFP4 on a family not released in it, NF4 where a matrix holds no whole blocks of 64, MXFP4 under FSDP;
    and a GPU of no memory."""
    widths = {"hidden_size": 60, "intermediate_size": 36, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16} \
        if family == "mixtral" else {}
    save_pretrained(tiny_model(family, **widths), tmp_path / "m")
    with pytest.raises(SystemExit):
        memory_estimate.main([str(tmp_path / "m"), *flags])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("name", ["tiny", "tiny:qwen3_next", "tiny:qwen3_5_moe", "tiny:lfm2_moe"])
def test_the_memory_command_takes_a_tiny_model_as_train_py_does(name):
    """`python -m minimoe.runs.memory tiny:<family>` sizes the tiny model train.py would run, under its
    recipe, not the hub's repo-id error."""
    estimate = memory_estimate.main([name, "--gpus", "1", "--dtype", "float32"])
    assert estimate.weights > 0 and estimate.total > estimate.weights


# Qwen3.5-35B-A3B's config.json in its released form (the vision-language model's, the text model's fields under
# text_config): its text fields are Qwen3_5MoeTextConfig's defaults, which transformers documents as that checkpoint's.
QWEN3_5_35B = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
               "tie_word_embeddings": False, "vision_config": {"depth": 27, "hidden_size": 1152},
               "text_config": {"model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048,
                               "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
                               "head_dim": 256, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                               "num_experts": 256, "num_experts_per_tok": 8, "linear_num_key_heads": 16,
                               "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                               "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "dtype": "bfloat16",
                               "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                                                   "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                                                   "mrope_interleaved": True}}}


def test_the_memory_command_sizes_qwen3_5_at_its_released_size(tmp_path):
    """The released config.json alone (no weights, no hub): the text model's 34.7B parameters (the 35B of its
    name; the vision tower, not loaded, is the rest) in bf16, which one 80 GiB GPU cannot train and two under
    FSDP can."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_5_35B))
    one = memory_estimate.main([str(tmp_path), "--gpus", "1"])
    assert 34e9 < one.weights / 2 < 35e9 and not one.fits
    assert memory_estimate.main([str(tmp_path), "--gpus", "2", "--shard", "fsdp"]).fits


# LiquidAI/LFM2-8B-A1B's config.json as released (its model card: 8.3B parameters, 1.5B active), in its own names.
LFM2_8B = {"model_type": "lfm2_moe", "vocab_size": 65536, "hidden_size": 2048, "intermediate_size": 7168,
           "moe_intermediate_size": 1792, "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 8,
           "max_position_embeddings": 128000, "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3,
           "rope_theta": 1e6, "num_dense_layers": 2, "num_experts": 32, "num_experts_per_tok": 4, "norm_topk_prob": True,
           "use_expert_bias": True, "routed_scaling_factor": 1.0, "eos_token_id": 7, "tie_word_embeddings": True,
           "layer_types": ["full_attention" if i in (2, 6, 10, 14, 18, 21) else "conv" for i in range(24)]}


def test_lfm2_moe_is_sized_at_its_released_sizes(tmp_path):
    """config.json alone: the memory command sizes the model it describes, its bf16 weights 2 bytes for each of the
    parameters counted here from the architecture (8.34e9: the card's 8.3B), the short conv layers included."""
    D, V, E, I, hd = 2048, 65536, 32, 1792, 64
    per_layer = [2 * D + ((3 * D * D + 3 * D + D * D) if kind == "conv" else (2 * D * D + 2 * D * 8 * hd + 2 * hd))
                 + (3 * D * 7168 if i < 2 else E * D + E + E * 3 * D * I) for i, kind in enumerate(LFM2_8B["layer_types"])]
    params = V * D + sum(per_layer) + D  # the embedding (the head is tied to it), the layers, the final norm
    assert round(params / 1e8) == 83
    (tmp_path / "config.json").write_text(json.dumps(LFM2_8B))
    estimate = memory_estimate.main([str(tmp_path), "--gpus", "1", "--dtype", "bfloat16"])
    assert estimate.weights == 2 * params and estimate.lora > 0
# NVIDIA-Nemotron-3-Nano-30B-A3B's config.json (its widths and layer pattern as released; the optional fields left
# to NemotronHConfig's defaults): 23 Mamba-2, 23 MoE and 6 attention blocks.
NEMOTRON_3_NANO = dict(
    architectures=["NemotronHForCausalLM"], model_type="nemotron_h", vocab_size=131072, hidden_size=2688,
    num_hidden_layers=52, hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    num_attention_heads=32, head_dim=128, num_key_value_heads=2, mamba_num_heads=64, mamba_head_dim=64,
    ssm_state_size=128, n_groups=8, conv_kernel=4, chunk_size=128, n_routed_experts=128, num_experts_per_tok=6,
    moe_intermediate_size=1856, moe_shared_expert_intermediate_size=3712, intermediate_size=1856, n_group=1,
    topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, layer_norm_epsilon=1e-5, mlp_hidden_act="relu2",
    mamba_hidden_act="silu", use_bias=False, use_conv_bias=True, tie_word_embeddings=False, n_shared_experts=1,
    max_position_embeddings=262144, time_step_min=0.001, torch_dtype="bfloat16")


def test_the_memory_command_sizes_nemotron_3_nano_from_its_config_json(tmp_path):
    """config.json alone: the parameters its config makes, 31.6B as the model card gives them (31.58B), in bf16."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(NEMOTRON_3_NANO))
    e = memory_estimate.main([str(tmp_path / "m"), "--gpus", "1", "--gpu-memory", "80"])
    assert 31.5e9 < e.weights / 2 < 31.7e9
    assert not e.fits  # a LoRA run of the whole bf16 model is more than one 80 GB card
    assert memory_estimate.main([str(tmp_path / "m"), "--gpus", "4", "--gpu-memory", "80"]).fits  # FSDP over 4


def test_a_dsa_indexers_scores_are_sized_at_deepseek_v32s_released_width(tmp_path):
    """DeepSeek-V3.2's config.json at its released size (the family's defaults: 61 layers, 7168 wide, 256 experts,
    the indexer's 64 heads): the weights from the parameters its config makes, and the indexer's fp32 scores
    [rows, T, 64, T] (one layer's, freed before the next) on top of the activations of a model without it."""
    from minimoe.cli.memory_estimate import main
    released = {"model_type": "deepseek_v32", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
                "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
                "n_routed_experts": 256, "num_experts_per_tok": 8}
    (tmp_path / "v32").mkdir()
    (tmp_path / "v32" / "config.json").write_text(json.dumps(released))
    flags = ["--gpus", "1", "--batch-size", "8", "--max-length", "1024"]
    with_indexer = main([str(tmp_path / "v32"), *flags])
    assert 660e9 < with_indexer.weights / 2 < 690e9  # bf16: DeepSeek-V3.2's 671B parameters (its MTP layer not loaded)
    (tmp_path / "v32" / "config.json").write_text(json.dumps({**released, "index_topk": None}))
    without = main([str(tmp_path / "v32"), *flags])
    assert with_indexer.activations - without.activations == 8 * 1024 * 64 * 1024 * 4


def state_bytes(value) -> int:
    """A tensor's bytes; a tensor subclass's (torchao's low-bit optimizer state) its inner tensors' (codes, scales,
    code table)."""
    if type(value) is not torch.Tensor and hasattr(value, "__tensor_flatten__"):
        return sum(state_bytes(getattr(value, name)) for name in value.__tensor_flatten__()[0])
    return value.numel() * value.element_size()


@pytest.mark.parametrize("optim, lora_dtype", [("adamw", "float32"), ("adamw8bit", "float32"), ("adamw4bit", "float32"),
                                               ("adamw8bit", "bfloat16")])
def test_lora_and_optimizer_figures_are_the_bytes_a_step_holds(tmp_path, monkeypatch, optim, lora_dtype):
    """After one step of train.py's optimizer (--optim) on the tiny OLMoE with TES: the lora figure is the trainable
    tensors' bytes and their gradients', the optimizer figure the bytes of every tensor in the optimizer's state
    (torchao's: their codes, block scales and code tables; moments in the parameter's dtype for the small tensors);
    with --lora-dtype bfloat16, the LoRA, its gradients and those small moments in bf16, the heads in fp32."""
    from minimoe.runs.config import build_config
    from minimoe.runs.training import install_method, make_optimizer
    if optim != "adamw":
        pytest.importorskip("torchao")
        monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)  # its update, eagerly (test_optimizers.py)
    save_pretrained(tiny_model("olmoe"), tmp_path / "m")
    cfg = build_config({"model": str(tmp_path / "m"), "method": "tes", "optim": optim, "lora_dtype": lora_dtype}, "olmoe")
    install_method(model := tiny_model("olmoe"), cfg)
    optimizer = make_optimizer(model, cfg)
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    trainable = [p for g in optimizer.param_groups for p in g["params"]]
    estimate = memory_estimate.main([str(tmp_path / "m"), "--method", "tes", "--recipe", "olmoe", "--optim", optim,
                                     "--lora-dtype", lora_dtype])
    assert {p.dtype for p in trainable} == {torch.float32, getattr(torch, lora_dtype)}
    assert estimate.lora == sum(state_bytes(p) + state_bytes(p.grad) for p in trainable)
    held = sum(state_bytes(v) for s in optimizer.state.values() for v in s.values())
    assert estimate.optimizer == held
    if optim != "adamw" and lora_dtype == "float32":  # the expert banks' LoRA in low bits: a quarter or an eighth of AdamW's
        assert held < memory.optimizer_bytes(trainable, "adamw") * (0.5 if optim == "adamw8bit" else 0.4)


class HeldStorages(TorchDispatchMode):
    """The most bytes alive at once in the storages that ops allocate while active (a storage lives while a tensor
    on it does; views and in-place results are not new); `keep(t)`: which new tensors count (default all)."""

    def __init__(self, keep=lambda t: True):
        super().__init__()
        self.keep, self.storages, self.peak = keep, {}, 0  # data_ptr -> (bytes, weak references to tensors on it)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                ptr = t.untyped_storage().data_ptr()
                if ptr not in inputs:  # a new storage (an old one's address may be reused)
                    self.storages.pop(ptr, None)
                    if self.keep(t):
                        self.storages[ptr] = (t.untyped_storage().nbytes(), [])
                if ptr in self.storages:
                    self.storages[ptr][1].append(weakref.ref(t))
        self.peak = max(self.peak, sum(n for n, refs in self.storages.values() if any(r() is not None for r in refs)))
        return out


def test_the_dequantising_figure_is_what_nf4_dequantize_into_holds_at_once(tmp_path, monkeypatch):
    """--quantize nf4: beside the dequantised weight (in the weights figure), the most bytes that dequantising the
    largest packed matrix holds at once in tensors it allocates (one chunk's int32 codes, lookup result and scales),
    tracked op by op as it runs: the figure is that peak, whole banks (the tiny model's fit one chunk) and in chunks."""
    pytest.importorskip("torchao")
    from minimoe.core.adaptation import quantized
    from minimoe.loading.checkpoint import from_pretrained

    save_pretrained(tiny_model("olmoe"), tmp_path / "m")
    model = from_pretrained(tmp_path / "m", dtype="bfloat16", quantize="nf4")
    largest = max((m for m in model.modules() if quantized.is_quantized(m)), key=lambda m: m.weight.numel())
    matrix = quantized.nf4_temporary_bytes(largest.weight.shape[-2] * largest.weight.shape[-1], torch.bfloat16)
    for chunk in (None, 3):  # whole banks; then chunks of 3 experts
        if chunk:
            monkeypatch.setattr(quantized, "DEQUANTIZE_CHUNK_BYTES", chunk * matrix)
        out = torch.empty(largest.weight.shape, dtype=torch.bfloat16)
        with HeldStorages() as held:
            largest.packed.dequantize_into(out)
        figure = memory_estimate.main([str(tmp_path / "m"), "--dtype", "bfloat16", "--quantize", "nf4"]).dequantising
        assert figure == held.peak == (chunk or largest.weight.shape[0]) * matrix, (chunk, figure, held.peak)


@pytest.mark.parametrize("chunk", [None, 64])
@pytest.mark.parametrize("data", memory.DATA_KINDS)
def test_the_logits_figure_is_a_real_steps_peak_over_the_vocabulary(tmp_path, data, chunk):
    """The logits figure for --data choice (8 examples of 4 candidates, 26 answer tokens an example: 208 positions)
    and chat (8 rows, every position supervised: 1,272, past the chunked loss's CHUNK) is the most bytes held at once
    in [positions, vocab] tensors during a real training step (step_loss, bf16, LoRA), within the head weight's
    transposed view; at the default chunk, and at --loss-chunk 64 (both kinds past it: 64 positions at a time)."""
    from minimoe.core.adaptation.lora import add_lora
    from minimoe.core.task.choices import pack_choices
    from minimoe.core.task.step import step_loss
    from minimoe.core.task.tokens import make_token_batch
    from minimoe.data.chat import TokenRow
    from minimoe.runs.config import build_config
    save_pretrained(model := tiny_model("olmoe"), tmp_path / "m")
    model = add_lora(model.to(torch.bfloat16), rank=4)
    V, g = model.config.vocab_size, torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(3, V, (n,), generator=g).tolist()  # noqa: E731
    if data == "choice":
        batch = pack_choices([(ids(40), [ids(n) for n in (5, 7, 6, 8)]) for _ in range(8)], 0)
        flags = ["--answer-tokens", "26"]
    else:
        batch = make_token_batch([TokenRow(ids(160), [False] + [True] * 159) for _ in range(8)], 0)
        flags = []
    counts = {"examples": 8, "tokens": batch.supervised_tokens, "rows": batch.input_ids.shape[0]}
    with HeldStorages(lambda t: t.dim() == 2 and t.shape[-1] == V) as held:
        step_loss(model, [batch], build_config({"model": str(tmp_path / "m"), "method": "ce"}, "tiny").method, counts, 1,
                  loss_chunk=chunk)
    if chunk:
        flags += ["--loss-chunk", str(chunk)]
    figure = memory_estimate.main([str(tmp_path / "m"), "--batch-size", "8", "--max-length", "160", "--data", data,
                                   *flags]).logits
    assert (figure == (chunk or 0) * V * 12) == bool(chunk)  # at --loss-chunk 64, its chunks alone
    assert figure <= held.peak <= figure + model.lm_head.weight.numel() * 2, (figure, held.peak)


# config.json with only the required fields: the rest are the family's defaults, which transformers 5.23 documents as
# these checkpoints' (Mistral4Config: mistralai/Mistral-Small-4-119B-2603; KimiLinearConfig: Kimi-Linear-48B-A3B).
RELEASED_BY_DEFAULTS = {
    "mistral4": ({"model_type": "mistral4", "vocab_size": 131072, "hidden_size": 4096, "intermediate_size": 12288,
                  "moe_intermediate_size": 2048, "num_hidden_layers": 36, "num_attention_heads": 32,
                  "n_routed_experts": 128, "num_experts_per_tok": 4}, 118.9e9, 119.1e9),  # "119B"
    # 48.4B in the layers and 0.75B in the untied embedding and head: the card's "48B" counts without them
    "kimi_linear": ({"model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216,
                     "moe_intermediate_size": 1024, "num_hidden_layers": 27, "num_attention_heads": 32,
                     "num_experts": 256, "num_experts_per_token": 8}, 49.0e9, 49.3e9),
}


@pytest.mark.parametrize("family", RELEASED_BY_DEFAULTS)
def test_the_memory_command_sizes_mistral4_and_kimi_linear_at_their_released_size(family, tmp_path):
    """config.json alone: Mistral Small 4's 119B and Kimi Linear's 48B (the KDA layers' convs and gates, the MLA
    layers without rope) in bf16, neither on one 80 GB card."""
    config, low, high = RELEASED_BY_DEFAULTS[family]
    (tmp_path / "config.json").write_text(json.dumps(config))
    e = memory_estimate.main([str(tmp_path), "--gpus", "1", "--gpu-memory", "80"])
    assert low < e.weights / 2 < high and not e.fits


def test_mistral_small_4s_release_config_sizes_its_text_model(tmp_path):
    """The release's config.json (Mistral3ForConditionalGeneration's: the text model under text_config, a vision
    config beside it) sizes the text model alone: the flat config.json's figure."""
    text = RELEASED_BY_DEFAULTS["mistral4"][0]
    for name, config in (("flat", text), ("release", {"model_type": "mistral3", "text_config": text,
                                                      "vision_config": {"model_type": "pixtral"}})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    flat, release = (memory_estimate.main([str(tmp_path / name), "--gpus", "1", "--gpu-memory", "80"]).weights
                     for name in ("flat", "release"))
    assert release == flat


def test_the_memory_command_sizes_mimo_v2_flash_at_its_released_size(tmp_path):
    """config.json with its layer count alone: MiMo-V2-Flash at MiMoV2FlashConfig's defaults, which transformers 5.23
    documents as XiaomiMiMo/MiMo-V2-Flash's (48 layers, 256 experts of 2048, the sliding layers' 8 KV heads, values 128
    wide beside keys 192). transformers 5.23's model of that config on the meta device holds 308,778,768,832
    parameters and 47 x 256 selection-bias entries: 308,778,780,864 values, the card's "309B"."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mimo_v2_flash", "num_hidden_layers": 48}))
    e = memory_estimate.main([str(tmp_path), "--gpus", "1", "--gpu-memory", "80"])
    assert e.weights == 2 * 308_778_780_864 and not e.fits


# DeepseekV4Config's defaults, which transformers 5.23 documents as deepseek-ai/DeepSeek-V4-Flash-Base's: 43 layers,
# hidden 4096, 64 query heads of 512 over one key/value head, q rank 1024, 256 experts of 2048 (top-6) and a shared
# one, 4 residual streams, the output in 8 groups of rank 1024, the indexer's 64 heads of 128, vocabulary 129280, the
# layers' schedule its default (two HCA layers, then CSA and HCA alternating), the first 3 hash-routed
V4_FLASH = {"model_type": "deepseek_v4", "num_hidden_layers": 43}


def test_the_memory_command_sizes_deepseek_v4_flash_at_its_released_size(tmp_path):
    """config.json with its layer count alone (V4_FLASH). transformers 5.23's DeepseekV4ForCausalLM of that config on the
    meta device holds 284,325,869,015 parameters and 40 x 256 selection-bias entries: 284,325,879,255 values, the
    V4-Flash card's "284B" (test_deepseek_v4_flash_figure_is_transformers_own_count computes it there). The hash
    layers' tid2eid tables (3 x 129280 x 6 integers, 18.6 MB) are buffers, not in the weights figure."""
    (tmp_path / "config.json").write_text(json.dumps(V4_FLASH))
    e = memory_estimate.main([str(tmp_path), "--gpus", "1", "--gpu-memory", "80"])
    assert e.weights == 2 * 284_325_879_255 and not e.fits


@pytest.mark.tf5
def test_deepseek_v4_flash_figure_is_transformers_own_count(tmp_path):
    """The figure above, against transformers 5.23's own model of the same config.json on the meta device (its
    parameters and its float buffers, the correction biases; not its rope tables, nor tid2eid)."""
    import transformers
    config = transformers.AutoConfig.for_model(**V4_FLASH)
    with torch.device("meta"):
        ref = transformers.AutoModelForCausalLM.from_config(config)
    counted = sum(p.numel() for p in ref.parameters()) + sum(
        b.numel() for n, b in ref.named_buffers() if n.endswith("e_score_correction_bias"))
    assert counted == 284_325_879_255
    (tmp_path / "config.json").write_text(json.dumps(V4_FLASH))
    assert memory_estimate.main([str(tmp_path), "--gpus", "1", "--gpu-memory", "80"]).weights == 2 * counted


def test_the_mxfp4_dequantising_figure_is_what_decoding_a_chunk_holds_at_once(tmp_path, monkeypatch):
    """--quantize mxfp4 decodes a bank a chunk of experts at a time, as nf4 (`dequantize_in_chunks`): the figure
    beside the dequantised weight is the most bytes alive at once in what decoding the largest bank allocates (one
    chunk's int32 codes and decoded values), tracked op by op, whole banks (the tiny model's fit one chunk) and in
    chunks of one expert."""
    pytest.importorskip("transformers")
    from minimoe.core.adaptation import quantized
    from minimoe.loading.checkpoint import from_pretrained
    from minimoe.loading.mxfp4 import mxfp4_temporary_bytes
    from tests.tiny_families import mxfp4_reference_model
    mxfp4_reference_model(tmp_path)
    model = from_pretrained(tmp_path, dtype="bfloat16", quantize="mxfp4")
    largest = max((m for m in model.modules() if quantized.is_quantized(m)), key=lambda m: m.weight.numel())
    matrix = mxfp4_temporary_bytes(largest.weight.shape[-2] * largest.weight.shape[-1], torch.bfloat16)
    for chunk in (None, 1):
        if chunk:
            monkeypatch.setattr(quantized, "DEQUANTIZE_CHUNK_BYTES", chunk * matrix)
        out = torch.empty(largest.weight.shape, dtype=torch.bfloat16)
        with HeldStorages() as held:
            largest.packed.dequantize_into(out)
        figure = memory_estimate.main([str(tmp_path), "--dtype", "bfloat16", "--quantize", "mxfp4"]).dequantising
        assert figure == held.peak == (chunk or largest.weight.shape[0]) * matrix, (chunk, figure, held.peak)
