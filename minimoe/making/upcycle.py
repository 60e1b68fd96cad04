"""Sparse upcycling: a dense Llama-family model -> a Granite-MoE checkpoint that computes the same logits.

    python -m minimoe.making.upcycle HuggingFaceTB/SmolLM2-135M-Instruct weights/smollm2-moe --experts 4 --top-k 2
    python -m minimoe.making.upcycle SmolLM2-135M-Instruct.Q4_1.gguf weights/smollm2-135m-moe
    python -m minimoe.making.upcycle SmolLM2-135M-Instruct.Q4_1.gguf weights/smollm2-split --mode split   # 16 experts, top-8

Sources: a folder (or hub id) in the `LlamaForCausalLM` safetensors layout, or a llama.cpp `.gguf` file.

--mode split divides the neurons among the experts instead and fits a router, so that the choice of
experts matters (minimoe/making/split.py); what follows describes the default copy mode, which split mode
also uses for everything but the MLPs.

Why the result is exact: every expert is a copy of the dense MLP (gate rows then up rows into
`input_linear[e]`, down into `output_linear[e]`), and Granite renormalises the top-K weights to sum
to 1, so sum_k w_k * MLP(x) = MLP(x) whatever the router picks. Granite's multipliers are set to 1
and `attention_multiplier` to 1/sqrt(head_dim), which is Llama's forward. The router starts as
N(0, initializer_range) from `seed`; `noise` > 0 adds N(0, noise * std(W)) to each expert's copy to
break the symmetry between experts, and then the equality holds only approximately.

GGUF: the config comes from the `llama.*` metadata; tensors are dequantised to fp32 with
`gguf.quants.dequantize` (every type it implements); llama.cpp stores q_proj/k_proj with the rows of
each head interleaved (its converter's `permute`), which `unpermute` undoes. The tokenizer is rebuilt
from `tokenizer.ggml.{tokens,merges,token_type}` as a byte-level `tokenizers` BPE: control tokens
(type 3) become special tokens, as transformers' GGUF converter does; the pre-tokenizer follows
`tokenizer.ggml.pre` (llama.cpp's "smollm" splits digits one by one before the GPT-2 regex, as
SmolLM2's own tokenizer.json does; transformers ignores that key and does not).

Anything that cannot be upcycled exactly raises `UpcycleError` naming it: another architecture,
biases, rope scaling or partial rotary, a GGUF tensor type gguf cannot dequantise, an unknown tensor,
a SentencePiece or unknown BPE pre-tokenizer.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from minimoe.atomic import atomic_directory, check_replaceable
from minimoe.core.decoder.model import MoEConfig, MoEForCausalLM
from minimoe.loading.checkpoint import checkpoint_layout, write_checkpoint

GGUF_NAMES = {  # llama.cpp tensor name (per layer after "blk.N.") -> transformers' Llama name
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GGUF_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                     "output.weight": "lm_head.weight"}
BPE_PRE_TOKENIZERS = ("default", "gpt2", "smollm")  # llama.cpp pre-tokenizer names we rebuild exactly
TOKEN_TYPE_CONTROL = 3  # llama.cpp's token_type for special (control) tokens


class UpcycleError(ValueError):
    """The source cannot be upcycled exactly; the message names what and what was expected."""


# ----------------------------------------------------------------------------- dense sources

def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head it stores the rotate-half pairs (i, i + d/2) side by side."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _field(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_tokenizer(reader, path: str):
    """tokenizer.ggml.* -> a byte-level `tokenizers` BPE with the same ids llama.cpp gives."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise UpcycleError(f"{path}: tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2') is rebuilt")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre not in BPE_PRE_TOKENIZERS:
        raise UpcycleError(f"{path}: tokenizer.ggml.pre {pre!r} is not rebuilt; expected one of {BPE_PRE_TOKENIZERS}")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=True)
    tokenizer.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                               if pre == "smollm" else byte_level)
    tokenizer.decoder = decoders.ByteLevel()
    types = _field(reader, "tokenizer.ggml.token_type", [])
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                  for i, t in enumerate(types) if t == TOKEN_TYPE_CONTROL])
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    if _field(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(single=f"{tokens[bos]} $A", special_tokens=[(tokens[bos], bos)])
    return tokenizer


def read_gguf(path) -> tuple[dict, dict[str, torch.Tensor], object]:
    """A llama.cpp file -> (Llama config dict, fp32 tensors under transformers' Llama names, tokenizer)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    path = str(path)
    reader = GGUFReader(path)
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise UpcycleError(f"{path}: general.architecture is {arch!r}; expected 'llama' (a dense Llama-family model)")
    if reader.fields.get("llama.expert_count") is not None:
        raise UpcycleError(f"{path}: llama.expert_count is set; this is already a MoE, expected a dense model")
    scaling = _field(reader, "llama.rope.scaling.type", "none")
    if scaling != "none":
        raise UpcycleError(f"{path}: llama.rope.scaling.type is {scaling!r}; rope scaling is not supported, expected none")
    heads, kv = _field(reader, "llama.attention.head_count"), _field(reader, "llama.attention.head_count_kv")
    kv = heads if kv is None else kv
    hidden = _field(reader, "llama.embedding_length")
    head_dim = hidden // heads
    for key in ("llama.rope.dimension_count", "llama.attention.key_length", "llama.attention.value_length"):
        if _field(reader, key, head_dim) != head_dim:
            raise UpcycleError(f"{path}: {key} is {_field(reader, key)}; expected head_dim {head_dim} (full rotary, "
                               f"hidden/heads)")
    tensors = {}
    for t in reader.tensors:
        if t.name.startswith("blk."):
            _, layer, leaf = t.name.split(".", 2)
            name = GGUF_NAMES.get(leaf) and f"model.layers.{layer}.{GGUF_NAMES[leaf]}"
        else:
            name = GGUF_GLOBAL_NAMES.get(t.name)
        if name is None:
            what = "a bias" if t.name.endswith(".bias") else "rope frequency factors (rope scaling)" \
                if t.name.startswith("rope_freqs") else "not a dense Llama tensor"
            raise UpcycleError(f"{path}: tensor {t.name!r} ({what}); expected only {sorted(GGUF_NAMES)} per block "
                               f"and {sorted(GGUF_GLOBAL_NAMES)}")
        try:
            values = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise UpcycleError(f"{path}: tensor {t.name!r} has type {t.tensor_type.name}, which gguf "
                               f"{_gguf_version()} cannot dequantise ({e})") from e
        w = torch.from_numpy(np.array(values, dtype=np.float32).reshape(tuple(reversed(t.shape.tolist()))))
        if leaf_is(name, "q_proj"):
            w = unpermute(w, heads)
        elif leaf_is(name, "k_proj"):
            w = unpermute(w, kv)
        tensors[name] = w
    config = {
        "vocab_size": tensors["model.embed_tokens.weight"].shape[0], "hidden_size": hidden,
        "intermediate_size": _field(reader, "llama.feed_forward_length"),
        "num_hidden_layers": _field(reader, "llama.block_count"), "num_attention_heads": heads,
        "num_key_value_heads": kv, "rms_norm_eps": _field(reader, "llama.attention.layer_norm_rms_epsilon"),
        "rope_theta": _field(reader, "llama.rope.freq_base", 10000.0),
        "max_position_embeddings": _field(reader, "llama.context_length"),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "chat_template": _field(reader, "tokenizer.chat_template"),  # the model's own (an instruct model's), or None
    }
    return config, tensors, gguf_tokenizer(reader, path)


def leaf_is(name: str, proj: str) -> bool:
    return name.endswith(f"self_attn.{proj}.weight")


def _gguf_version() -> str:
    from importlib.metadata import version
    return version("gguf")


def read_llama_folder(source) -> tuple[dict, dict[str, torch.Tensor], object]:
    """A LlamaForCausalLM safetensors folder or hub id -> (config.json dict, tensors, tokenizer)."""
    from safetensors.torch import load_file
    from tokenizers import Tokenizer
    from minimoe.loading.hub import resolve_checkpoint
    folder = resolve_checkpoint(source)
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no config.json; expected a LlamaForCausalLM safetensors folder")
    config = json.loads(path.read_text())
    if config.get("model_type") != "llama":
        raise UpcycleError(f"{path}: model_type is {config.get('model_type')!r}; expected 'llama' (LlamaForCausalLM)")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise UpcycleError(f"{path}: {key} is true; biases are not supported, expected false")
    if config.get("rope_scaling") is not None:
        raise UpcycleError(f"{path}: rope_scaling is {config['rope_scaling']}; not supported, expected null")
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    if config.get("head_dim", head_dim) != head_dim:
        raise UpcycleError(f"{path}: head_dim {config['head_dim']} differs from hidden_size/num_attention_heads {head_dim}")
    if config.get("hidden_act", "silu") != "silu":
        raise UpcycleError(f"{path}: hidden_act {config['hidden_act']!r}; expected 'silu'")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    tensors = {k: v for f in files for k, v in load_file(str(f)).items()}
    if not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{folder}: no tokenizer.json")
    return config, tensors, Tokenizer.from_file(str(folder / "tokenizer.json"))


# ----------------------------------------------------------------------------- upcycling

def moe_config(llama: dict, num_experts: int, top_k: int, dtype: torch.dtype) -> MoEConfig:
    head_dim = llama["hidden_size"] // llama["num_attention_heads"]
    return MoEConfig(
        model_type="granitemoe", vocab_size=llama["vocab_size"], hidden_size=llama["hidden_size"],
        intermediate_size=llama["intermediate_size"], num_hidden_layers=llama["num_hidden_layers"],
        num_attention_heads=llama["num_attention_heads"],
        num_key_value_heads=llama.get("num_key_value_heads") or llama["num_attention_heads"],
        num_experts=num_experts, num_experts_per_tok=top_k, rms_norm_eps=llama.get("rms_norm_eps", 1e-6),
        rope_theta=llama.get("rope_theta", 10000.0), max_position_embeddings=llama.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(llama.get("tie_word_embeddings", False)),
        embedding_multiplier=1.0, residual_multiplier=1.0, logits_scaling=1.0, attention_multiplier=head_dim ** -0.5,
        bos_token_id=llama.get("bos_token_id"), eos_token_id=llama.get("eos_token_id"),
        pad_token_id=llama.get("pad_token_id"), initializer_range=llama.get("initializer_range", 0.02),
        torch_dtype=str(dtype).removeprefix("torch."))


def upcycle_tensors(config: MoEConfig, dense: dict[str, torch.Tensor], *, seed: int, noise: float,
                    dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Dense Llama tensors -> our parameter names: E copies of each MLP, a seeded router."""
    g = torch.Generator().manual_seed(seed)
    E, D = config.num_experts, config.hidden_size
    expected = {n for n in checkpoint_layout(config)}
    ours = {}

    def take(name):
        if name not in dense:
            raise UpcycleError(f"the source has no tensor {name!r}; expected a dense LlamaForCausalLM")
        return dense.pop(name).float()

    for name in expected:
        if ".mlp." in name:
            continue
        if name == "lm_head.weight" or "layers." not in name:
            ours[name] = take(name)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                  *(f"self_attn.{x}_proj.weight" for x in "qkvo")):
            ours[p + n] = take(p + n)
        gate_up = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])  # [2I, D]
        down = take(p + "mlp.down_proj.weight")  # [D, I]
        banks = [gate_up.expand(E, *gate_up.shape).clone(), down.expand(E, *down.shape).clone()]
        if noise > 0:
            for bank in banks:
                bank += torch.randn(bank.shape, generator=g) * (noise * bank[0].std())
        ours[p + "mlp.experts.gate_up_proj.weight"], ours[p + "mlp.experts.down_proj.weight"] = banks
        ours[p + "mlp.gate.weight"] = torch.randn(E, D, generator=g) * config.initializer_range
    if config.tie_word_embeddings:
        dense.pop("lm_head.weight", None)  # some tied exports still carry the (equal) head
    if dense:
        extra = sorted(dense)
        what = "a bias" if extra[0].endswith(".bias") else "not a dense Llama tensor"
        raise UpcycleError(f"unexpected tensor {extra[0]!r} ({what}; {len(extra)} in all)")
    return {k: v.to(dtype) for k, v in ours.items()}


def upcycle(source, out_dir, *, num_experts: int = 4, top_k: int = 2, seed: int = 0, noise: float = 0.0,
            dtype: torch.dtype | None = None, mode: str = "copy", split: dict | None = None) -> Path:
    """Write a Granite-MoE checkpoint (config.json, model.safetensors, tokenizer.json) into `out_dir`, atomically.

    mode "copy": E copies of each MLP (exact). mode "split": the neurons divided among E experts with a
    fitted router (minimoe/making/split.py); `split` holds SplitSettings fields beyond experts, top-k and seed,
    and the folder also gets split.json. dtype None keeps the source's: fp32 for GGUF (dequantised), the
    config's torch_dtype for safetensors.
    """
    if mode not in ("copy", "split"):
        raise UpcycleError(f"mode {mode!r}; expected 'copy' or 'split'")
    if not 1 <= top_k <= num_experts:
        raise UpcycleError(f"top_k {top_k} must be in [1, num_experts={num_experts}]")
    if noise < 0 or (noise and mode == "split"):
        raise UpcycleError(f"noise {noise} must be >= 0, and 0 in split mode (its experts differ already)")
    if split and mode != "split":
        raise UpcycleError(f"split settings {sorted(split)} given with mode {mode!r}; expected mode 'split'")
    check_replaceable(out_dir, "model")  # before the work: never over an export, a run or foreign files
    try:
        if str(source).endswith(".gguf"):
            if not Path(source).is_file():
                raise FileNotFoundError(f"{source}: no such GGUF file")
            llama, dense, tokenizer = read_gguf(source)
            dtype = dtype or torch.float32
        else:
            llama, dense, tokenizer = read_llama_folder(source)
            dtype = dtype or getattr(torch, llama.get("torch_dtype") or "float32")
    except (UpcycleError, FileNotFoundError):
        raise
    except (OSError, ValueError, KeyError, IndexError) as e:  # a corrupt file, as the reader library reports it
        raise UpcycleError(f"{source}: cannot be read ({type(e).__name__}: {e})") from e
    record = None
    if mode == "copy":
        config = moe_config(llama, num_experts, top_k, dtype)
        model = assemble(config, upcycle_tensors(config, dense, seed=seed, noise=noise, dtype=dtype))
    else:  # split in fp32 from the one-expert copy (the dense model), then cast
        from minimoe.making import split as splitting
        settings = splitting.SplitSettings(num_experts=num_experts, top_k=top_k, seed=seed, **(split or {}))
        splitting.check_settings(settings, llama["intermediate_size"])
        t0 = time.perf_counter()
        config = moe_config(llama, 1, 1, torch.float32)
        one = assemble(config, upcycle_tensors(config, dense, seed=seed, noise=0.0, dtype=torch.float32))
        docs = [d for d in splitting.prose_documents() if not splitting.held_out(d[0])]
        ids = splitting.token_rows(tokenizer, docs, settings.fit_tokens, settings.seq_len, settings.seed,
                                   llama.get("eos_token_id"))
        model, stats = splitting.split_model(one, ids, settings)
        model = model.to(dtype)
        model.config.torch_dtype = str(dtype).removeprefix("torch.")
        record = splitting.record(settings, stats, time.perf_counter() - t0)
    out_dir = Path(out_dir)
    with atomic_directory(out_dir, "model") as tmp:
        write_checkpoint(model, tmp)
        tokenizer.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tokenizer, llama), indent=1) + "\n")
        if record is not None:
            (tmp / "split.json").write_text(json.dumps(record, indent=1) + "\n")
    return out_dir


def tokenizer_config(tokenizer, llama: dict) -> dict:
    """transformers' AutoTokenizer reads tokenizer.json only through a tokenizer_config.json naming the fast
    class: without one it looks for GPT-2's vocab.json for a Granite folder and fails (lm-eval's hf model,
    a merged export served by transformers). minimoe itself reads tokenizer.json alone."""
    names = {key: tokenizer.id_to_token(llama[f"{key}_id"]) for key in ("bos_token", "eos_token", "pad_token")
             if llama.get(f"{key}_id") is not None}
    # the GGUF's chat template, where it has one: chat --data renders with it (minimoe/data/chat.py)
    template = {"chat_template": llama["chat_template"]} if llama.get("chat_template") else {}
    return {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False, **names, **template}


def assemble(config: MoEConfig, tensors: dict[str, torch.Tensor]) -> MoEForCausalLM:
    """Our parameter names -> a model holding exactly those tensors (no random init)."""
    with torch.device("meta"):
        model = MoEForCausalLM(config)
    for name, value in tensors.items():
        module, _, leaf = name.rpartition(".")
        if model.get_parameter(name).shape != value.shape:
            raise UpcycleError(f"tensor for {name!r} has shape {tuple(value.shape)}; the config implies "
                               f"{tuple(model.get_parameter(name).shape)}")
        model.get_submodule(module)._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    model.tie_weights()
    return model


if __name__ == "__main__":  # python -m minimoe.making.upcycle runs its command, minimoe/cli/upcycle_llama.py
    import runpy
    runpy.run_module("minimoe.cli.upcycle_llama", run_name="__main__")
