"""Chat rendering against transformers' apply_chat_template (the reference), the assistant mask against its
return_assistant_tokens_mask (generation tags) or a direct computation, and the row checks."""
import json

import pytest

from minimoe.data.benchmarks import train_tokenizer
from minimoe.data.chat import (NoChatTemplate, assistant_spans, check_length, check_messages, encode_chat,
                               encode_completion, read_chat_template, render, special_tokens)

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Qwen2.5's shape: a default system prompt when the conversation has none
SYSTEM_DEFAULT = ("{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + "
                  "'<|im_end|>\n' }}{%- else %}{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
                  "{%- endif %}{%- for message in messages %}{%- if message.role != 'system' %}"
                  "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}{%- endif %}"
                  "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
# written over several lines, as real templates are: trim_blocks and lstrip_blocks decide its whitespace
GENERATION = ("{{ bos_token }}{% for message in messages %}\n  {% if message['role'] == 'assistant' %}\n"
              "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
              "{{ '\n' }}{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
              "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TEMPLATES = {"chatml": CHATML, "system_default": SYSTEM_DEFAULT, "generation": GENERATION}
SPECIAL = {"bos_token": "<|bos|>", "eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"},
     {"role": "assistant", "content": "Red, or {{ not jinja }} <b>html</b>."}],
]


class Tok:  # checkpoint.Tokenizer's surface
    def __init__(self, tokenizer, eos):
        self.tokenizer, self.eos_token_id = tokenizer, eos

    def encode(self, text, add_special_tokens=True):
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


@pytest.fixture(scope="module")
def tokenizers():
    texts = [m["content"] for c in CONVERSATIONS for m in c] * 20 + ["system user assistant helpful"] * 20
    tok = train_tokenizer(texts, vocab_size=300, special_tokens=("<|endoftext|>", "<|pad|>", "<|bos|>",
                                                                 "<|im_start|>", "<|im_end|>"))
    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL)
    return Tok(tok, tok.token_to_id("<|endoftext|>")), hf


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_rendering_equals_transformers(tokenizers, name, conversation):
    ours, hf = tokenizers
    messages, template = CONVERSATIONS[conversation], TEMPLATES[name]
    for prompt in (False, True):
        text, _ = render(template, messages, SPECIAL, add_generation_prompt=prompt)
        assert text == hf.apply_chat_template(messages, chat_template=template, tokenize=False,
                                              add_generation_prompt=prompt)
    row = encode_chat(ours, template, SPECIAL, messages, "t")
    assert row.ids == hf.apply_chat_template(messages, chat_template=template, tokenize=True)


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_generation_mask_equals_transformers(tokenizers, conversation):
    ours, hf = tokenizers
    messages = CONVERSATIONS[conversation]
    row = encode_chat(ours, GENERATION, SPECIAL, messages, "t")
    out = hf.apply_chat_template(messages, chat_template=GENERATION, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True)
    assert row.supervised == [bool(m) for m in out["assistant_masks"]] and any(row.supervised)


@pytest.mark.parametrize("name", ["chatml", "system_default"])
def test_mask_without_generation_tags_is_each_assistant_turn(tokenizers, name):
    """Direct computation: the supervised tokens decode to every assistant turn's content and end marker, in order."""
    ours, _ = tokenizers
    messages = CONVERSATIONS[1]
    row = encode_chat(ours, TEMPLATES[name], SPECIAL, messages, "t")
    supervised = ours.tokenizer.decode([i for i, m in zip(row.ids, row.supervised) if m], skip_special_tokens=False)
    assert supervised == "".join(m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant")
    text, spans = assistant_spans(TEMPLATES[name], messages, SPECIAL, "t")
    assert [text[a:b] for a, b in spans] == ["Blue.<|im_end|>\n", "Red, or {{ not jinja }} <b>html</b>.<|im_end|>\n"]


def test_a_template_that_rewrites_past_turns_is_refused(tokenizers):
    ours, _ = tokenizers
    drops_past = ("{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}{{ 'A: (past)\n' }}"
                  "{% else %}{{ m.role + ': ' + m.content + '\n' }}{% endif %}{% endfor %}"
                  "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    with pytest.raises(ValueError, match="differently once later turns follow"):
        encode_chat(ours, drops_past, SPECIAL, CONVERSATIONS[1], "t")


@pytest.mark.parametrize("messages, match", [
    ([], "an empty conversation"),
    ("hello", "expected a list"),
    ([{"role": "user", "content": "hi"}], "no assistant turn"),
    ([{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}], "role 'robot'"),
    ([{"role": "user"}, {"role": "assistant", "content": "x"}], "turn 0"),
])
def test_bad_conversations_are_named(messages, match):
    with pytest.raises(ValueError, match=f"chat.jsonl:3: .*{match}"):
        check_messages(messages, "chat.jsonl:3")


def test_completion_row_and_length(tokenizers):
    ours, _ = tokenizers
    row = encode_completion(ours, "What is 2+2?", " 4.", "f:1")
    n = len(ours.encode("What is 2+2?"))
    assert row.ids[:n] == ours.encode("What is 2+2?") and row.ids[-1] == ours.eos_token_id
    assert row.supervised == [False] * n + [True] * (len(row.ids) - n)
    check_length(row, len(row.ids), "f:1")
    with pytest.raises(ValueError, match=f"f:1: {len(row.ids)} tokens, longer than --max-length"):
        check_length(row, len(row.ids) - 1, "f:1")


def test_template_sources(tmp_path):
    with pytest.raises(NoChatTemplate, match="no chat template.*--chat-template FILE"):
        read_chat_template(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML,
                                                                "eos_token": {"content": "<|endoftext|>"}}))
    assert read_chat_template(tmp_path) == CHATML and special_tokens(tmp_path) == {"eos_token": "<|endoftext|>"}
    (tmp_path / "chat_template.jinja").write_text(GENERATION)
    assert read_chat_template(tmp_path) == GENERATION
    (tmp_path / "mine.jinja").write_text(SYSTEM_DEFAULT)
    assert read_chat_template(tmp_path, tmp_path / "mine.jinja") == SYSTEM_DEFAULT
    with pytest.raises(FileNotFoundError, match="--chat-template"):
        read_chat_template(tmp_path, tmp_path / "missing.jinja")


def test_chat_and_completion_rows_become_checked_manifests(tmp_path):
    """--field-map names the messages column; a manifest line keeps the conversation as given and reads back
    as the same example; a completion row among chat rows is refused with its line."""
    from minimoe.data.manifests import read_manifest
    from minimoe.data.userdata import build_user_data, data_kind
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    rows = [{"turns": [{**conv[0], "content": f"hi {i}"}, conv[1]], "extra": 1} for i in range(12)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    folder = build_user_data(str(path), tmp_path / "splits", field_map="messages=turns")
    assert json.loads((folder / "splits.json").read_text())["kind"] == "chat"
    assert data_kind(str(folder)) == "manifests"
    examples = [ex for s in ("train", "val", "test") for ex in read_manifest(folder / f"{s}.jsonl")]
    assert sorted(ex.messages[0]["content"] for ex in examples) == sorted(f"hi {i}" for i in range(12))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:3] + [{"prompt": "a", "completion": "b"}]))
    with pytest.raises(ValueError, match=r"chat.jsonl:4: a completion row among chat rows"):
        build_user_data(str(path), tmp_path / "splits", field_map="messages=turns")
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "completion": " c"}) + "\n" for i in range(12)))
    folder = build_user_data(str(path), tmp_path / "splits")
    assert read_manifest(folder / "test.jsonl")[0].kind == "completion"
