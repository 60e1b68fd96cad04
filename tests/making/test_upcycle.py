"""minimoe.making.upcycle: a dense Llama upcycled into Granite-MoE computes transformers' LlamaForCausalLM.

References: transformers' LlamaForCausalLM on the same safetensors folder or GGUF file (transformers
does its own GGUF dequantisation and q/k unpermutation), and transformers' GGUF tokenizer. The GGUF
files are written here with gguf's GGUFWriter in llama.cpp's layout (q/k rows permuted per head).
"""
import json

import numpy as np
import pytest
import torch

import minimoe
from minimoe.making.upcycle import UpcycleError, upcycle

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

TEXT = ("The quick brown fox jumps over the lazy dog 1234567890. Über Grüße, ça va? ¿Qué tal? Ελληνικά, "
        "русский текст, 日本語のテキスト, 中文文本, 한국어, עברית, العربية, हिन्दी 🙂 <|endoftext|> tabs\tand  spaces\n")
SPECIALS = ["<|endoftext|>", "<|im_start|>"]


@pytest.fixture(scope="module")
def bpe():
    """A real byte-level BPE trained on multilingual text: vocab in id order and merges."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=448, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT * 3, TEXT.lower(), TEXT.upper()], trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tok, vocab, merges


def llama(vocab_size, tie, seed=0):
    cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=1e4,
                                   max_position_embeddings=256, tie_word_embeddings=tie, bos_token_id=1,
                                   eos_token_id=0, pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # weights large enough that a misplaced row or head shows in the logits
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() == 2 else 0.1) + (1.0 if p.dim() == 1 else 0.0))
    return model


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: per head, rotate-half pairs (i, i + d/2) become neighbours."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_LEAVES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_gguf(path, model, vocab, merges, qtype, *, arch="llama", pre="gpt2", tok_model="gpt2", extra_kv=None,
               extra_tensors=None):
    from gguf import GGMLQuantizationType, GGUFWriter, TokenType
    from gguf.quants import quantize
    c = model.config
    w = GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_tokenizer_model(tok_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(vocab)
    w.add_token_merges(merges)
    w.add_token_types([TokenType.CONTROL if t in SPECIALS else TokenType.NORMAL for t in vocab])
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    for key, value in (extra_kv or {}).items():
        w.add_string(key, value)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            gname = f"blk.{i}.{GGUF_LEAVES[rest.removesuffix('.weight')]}.weight"
        else:
            gname = names[name]
        if gname in (extra_tensors or {}):  # replaced by the caller's raw tensor
            continue
        a = p.detach().numpy().astype(np.float32)
        if "q_proj" in name:
            a = permute(a, c.num_attention_heads)
        elif "k_proj" in name:
            a = permute(a, c.num_key_value_heads)
        if a.ndim == 2 and qtype != GGMLQuantizationType.F32:
            w.add_tensor(gname, quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, a)
    for gname, (array, raw_dtype) in (extra_tensors or {}).items():
        w.add_tensor(gname, array, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def ids(n=24, vocab=64):
    return torch.randint(2, vocab, (2, n), generator=torch.Generator().manual_seed(7))


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("seed,experts,top_k,tie", [(0, 4, 2, True), (1, 4, 2, False), (2, 3, 1, True), (3, 8, 3, False)])
def test_safetensors_upcycle_matches_transformers_llama(tmp_path, bpe, seed, experts, top_k, tie):
    tok, _, _ = bpe
    ref = llama(tok.get_vocab_size(), tie)
    ref.save_pretrained(tmp_path / "dense")
    tok.save(str(tmp_path / "dense" / "tokenizer.json"))
    upcycle(tmp_path / "dense", tmp_path / "moe", num_experts=experts, top_k=top_k, seed=seed)
    moe = minimoe.from_pretrained(tmp_path / "moe")
    assert moe.config.model_type == "granitemoe" and moe.config.num_experts == experts
    x = ids(vocab=tok.get_vocab_size())
    with torch.no_grad():
        assert rel(moe(x).logits, ref(x).logits) < 2e-5
    routers = [moe.get_parameter(f"model.layers.{i}.mlp.gate.weight") for i in range(2)]
    assert routers[0].std() > 0 and not torch.equal(routers[0], routers[1])  # a real (seeded) router
    assert minimoe.load_tokenizer(tmp_path / "moe").encode(TEXT) == tok.encode(TEXT).ids


@pytest.mark.parametrize("qtype,tie", [("F32", False), ("Q8_0", True), ("Q4_1", False)])
def test_gguf_upcycle_matches_transformers_llama(tmp_path, bpe, qtype, tie):
    from gguf import GGMLQuantizationType
    _, vocab, merges = bpe
    dense = llama(len(vocab), tie, seed=1)
    path = write_gguf(tmp_path / "m.gguf", dense, vocab, merges, GGMLQuantizationType[qtype])
    ref = transformers.LlamaForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    x = ids(vocab=len(vocab))
    for seed in (0, 1):
        upcycle(path, tmp_path / "moe", seed=seed)
        moe = minimoe.from_pretrained(tmp_path / "moe")
        with torch.no_grad():
            assert rel(moe(x).logits, ref(x).logits) < 2e-5, f"router seed {seed}"
    if qtype != "F32":  # the quantisation was real: the dense fp32 model differs
        with torch.no_grad():
            assert rel(dense(x).logits, ref(x).logits) > 1e-4


def test_noise_breaks_expert_symmetry_and_is_off_by_default(tmp_path, bpe):
    tok, _, _ = bpe
    llama(tok.get_vocab_size(), True).save_pretrained(tmp_path / "dense")
    tok.save(str(tmp_path / "dense" / "tokenizer.json"))
    bank = "model.layers.0.mlp.experts.gate_up_proj.weight"
    upcycle(tmp_path / "dense", tmp_path / "exact")
    w = minimoe.from_pretrained(tmp_path / "exact").get_parameter(bank)
    assert all(torch.equal(w[0], w[e]) for e in range(1, 4))
    upcycle(tmp_path / "dense", tmp_path / "noisy", noise=0.01)
    w = minimoe.from_pretrained(tmp_path / "noisy").get_parameter(bank)
    assert not torch.equal(w[0], w[1])


def test_gguf_tokenizer_matches_transformers(tmp_path, bpe):
    from gguf import GGMLQuantizationType
    _, vocab, merges = bpe
    write_gguf(tmp_path / "m.gguf", llama(len(vocab), True), vocab, merges, GGMLQuantizationType.F32)
    upcycle(tmp_path / "m.gguf", tmp_path / "moe")
    ours = minimoe.load_tokenizer(tmp_path / "moe")
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    for text in (TEXT, TEXT.lower(), "  leading spaces, <|im_start|>user\nHallo Welt!<|endoftext|>"):
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False)
    assert ours.decode(ours.encode(TEXT), skip_special_tokens=False) == TEXT
    # transformers reads the written folder's tokenizer too (lm-eval's hf model, merged exports), with our ids
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "moe")
    for text in (TEXT, "  leading spaces, <|im_start|>user\nHallo Welt!<|endoftext|>"):
        assert theirs.encode(text, add_special_tokens=False) == ours.encode(text)
    eos = json.loads((tmp_path / "moe" / "config.json").read_text())["eos_token_id"]
    assert eos is None or theirs.eos_token_id == eos


def test_gguf_smollm_pre_tokenizer_splits_digits(tmp_path, bpe):
    """llama.cpp's "smollm" pre-tokenizer puts every digit in its own word (as SmolLM2's tokenizer.json)."""
    from gguf import GGMLQuantizationType
    _, vocab, merges = bpe
    write_gguf(tmp_path / "m.gguf", llama(len(vocab), True), vocab, merges, GGMLQuantizationType.F32, pre="smollm")
    upcycle(tmp_path / "m.gguf", tmp_path / "moe")
    tok = minimoe.load_tokenizer(tmp_path / "moe")
    pieces = [tok.decode([i]) for i in tok.encode("1234567890")]
    assert pieces == list("1234567890")


def bad_folder(tmp_path, bpe, **config):
    tok, _, _ = bpe
    llama(tok.get_vocab_size(), True).save_pretrained(tmp_path / "dense")
    tok.save(str(tmp_path / "dense" / "tokenizer.json"))
    cfg = json.loads((tmp_path / "dense" / "config.json").read_text())
    cfg.update(config)
    (tmp_path / "dense" / "config.json").write_text(json.dumps(cfg))
    return tmp_path / "dense"


@pytest.mark.parametrize("config,match", [
    (dict(model_type="mistral"), "model_type is 'mistral'"),
    (dict(attention_bias=True), "attention_bias is true"),
    (dict(mlp_bias=True), "mlp_bias is true"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_scaling"),
    (dict(head_dim=8), "head_dim 8"),
])
def test_bad_safetensors_sources_raise(tmp_path, bpe, config, match):
    with pytest.raises(UpcycleError, match=match):
        upcycle(bad_folder(tmp_path, bpe, **config), tmp_path / "moe")
    assert not (tmp_path / "moe").exists()


def test_unexpected_bias_tensor_raises(tmp_path, bpe):
    from safetensors.torch import load_file, save_file
    folder = bad_folder(tmp_path, bpe)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UpcycleError, match=r"'model.layers.0.self_attn.q_proj.bias' \(a bias"):
        upcycle(folder, tmp_path / "moe")


@pytest.mark.parametrize("case,match", [
    ("unknown", r"tensor 'blk.0.extra.weight' \(not a dense Llama tensor\)"),
    ("arch", "general.architecture is 'qwen2'"),
    ("q8_1", "tensor 'blk.0.attn_v.weight' has type Q8_1, which gguf .* cannot dequantise"),
    ("bias", r"tensor 'blk.0.attn_q.bias' \(a bias\)"),
    ("rope_scaling", "llama.rope.scaling.type is 'linear'"),
    ("sentencepiece", "tokenizer.ggml.model is 'llama'"),
    ("pre", "tokenizer.ggml.pre 'qwen2' is not rebuilt"),
])
def test_bad_gguf_sources_raise(tmp_path, bpe, case, match):
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
    _, vocab, merges = bpe
    model = llama(len(vocab), True)
    kw = {}
    if case == "unknown":
        kw["extra_tensors"] = {"blk.0.extra.weight": (np.zeros((4, 64), np.float32), None)}
    elif case == "arch":
        kw["arch"] = "qwen2"
    elif case == "q8_1":
        block, size = GGML_QUANT_SIZES[Q.Q8_1]
        # attn_v [32, 64] as Q8_1 bytes: gguf reads the type, but has no dequantiser for it
        kw["extra_tensors"] = {"blk.0.attn_v.weight": (np.zeros((32, 64 // block * size), np.uint8), Q.Q8_1)}
    elif case == "bias":
        kw["extra_tensors"] = {"blk.0.attn_q.bias": (np.zeros(64, np.float32), None)}
    elif case == "rope_scaling":
        kw["extra_kv"] = {"llama.rope.scaling.type": "linear"}
    elif case == "sentencepiece":
        kw["tok_model"] = "llama"
    elif case == "pre":
        kw["pre"] = "qwen2"
    path = write_gguf(tmp_path / "m.gguf", model, vocab, merges, Q.F32, **kw)
    with pytest.raises(UpcycleError, match=match):
        upcycle(path, tmp_path / "moe")
    assert not (tmp_path / "moe").exists()


@pytest.mark.parametrize("flags", [["--shared", "8"], ["--fit-tokens", "64"], ["--router-std", "0"], ["--no-repair"]])
def test_split_flags_are_refused_in_copy_mode(tmp_path, capsys, flags):
    from minimoe.cli.upcycle_llama import main
    with pytest.raises(SystemExit) as e:  # before the source is read: nothing is written
        main([str(tmp_path / "missing.gguf"), str(tmp_path / "out"), *flags])
    assert e.value.code == 2
    assert f"{flags[0]} only apply with --mode split" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
