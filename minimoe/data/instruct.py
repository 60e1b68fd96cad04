"""Chat and prompt/completion examples as manifest lines (userdata.py builds them, manifests.read_manifest reads them).

    {"id": "train:0", "messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]}
    {"id": "train:1", "prompt": "...", "completion": "..."}

A row of your own is chat when it has the messages column (--field-map messages=COLUMN, default
`messages`), prompt/completion when it has both of those columns (prompt=..., completion=...), and
multiple choice otherwise (`row_kind`). The text is kept as given; the model's tokenizer and chat
template turn it into tokens at run time (`encode_example`), where a row longer than --max-length is
refused, so that the same manifests serve any model.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace

from minimoe.data.chat import (TokenRow, check_length, check_messages, encode_chat, encode_completion,
                               read_chat_template, special_tokens)

TEXT_FIELDS = {"messages": "messages", "prompt": "prompt", "completion": "completion"}  # --field-map's defaults
TEXT_KEYS = ({"id", "messages"}, {"id", "prompt", "completion"})  # a text manifest line's keys, exactly


@dataclass(frozen=True)
class TextExample:
    id: str
    messages: list | None = None  # chat: [{"role", "content"}]
    prompt: str | None = None  # prompt/completion
    completion: str | None = None

    @property
    def kind(self) -> str:
        return "chat" if self.messages is not None else "completion"

    # manifests.check_disjoint's view: what is asked and what is answered
    @property
    def question(self) -> str:
        return self.prompt if self.messages is None else "\n".join(m["content"] for m in self.messages
                                                                   if m["role"] != "assistant")

    @property
    def choices(self) -> list[str]:
        return [self.completion if self.messages is None else "\n".join(m["content"] for m in self.messages
                                                                        if m["role"] == "assistant")]

    def json(self) -> str:
        record = {"id": self.id, **({"messages": self.messages} if self.messages is not None else
                                    {"prompt": self.prompt, "completion": self.completion})}
        return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def row_kind(row, fields: dict) -> str:
    """"chat", "completion" or "choice" (module docstring)."""
    if not isinstance(row, dict):
        return "choice"  # build_user_data names what is wrong with it
    if fields["messages"] in row:
        return "chat"
    return "completion" if fields["prompt"] in row and fields["completion"] in row else "choice"


def to_text_example(row: dict, fields: dict, kind: str, split: str, index: int, where: str) -> TextExample:
    ex_id = str(row[fields["id"]]) if fields["id"] in row else f"{split}:{index}"
    if kind == "chat":
        messages = row.get(fields["messages"])
        check_messages(messages, where)
        return TextExample(ex_id, messages=[{"role": m["role"], "content": m["content"]} for m in messages])
    prompt, completion = row.get(fields["prompt"]), row.get(fields["completion"])
    for name, value in (("prompt", prompt), ("completion", completion)):
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{where}: {name} is {json.dumps(value)[:60]}; expected non-empty text")
    return TextExample(ex_id, prompt=prompt, completion=completion)


def parse_text_line(d: dict, where: str) -> TextExample:
    """A manifest line with TEXT_KEYS' keys -> its checked example."""
    if set(d) not in TEXT_KEYS or not isinstance(d["id"], str) or not d["id"]:
        raise ValueError(f"{where}: got keys {sorted(d)}; expected exactly {sorted(TEXT_KEYS[0])} or "
                         f"{sorted(TEXT_KEYS[1])} with a non-empty string id")
    return to_text_example(d, {"id": "id", **TEXT_FIELDS}, "chat" if "messages" in d else "completion", "", 0, where)


@dataclass(frozen=True)
class Template:  # what a chat row needs from the model: its template and special-token strings
    text: str
    special: dict


def encode_example(ex: TextExample, tokenizer, template: Template | None, max_length: int | None,
                   where: str) -> TokenRow:
    """-> its tokens and loss mask (data/chat.py), refused when longer than max_length (None: no bound)."""
    if ex.messages is not None:
        if template is None:
            raise ValueError(f"{where}: a chat example, and no chat template was read")
        row = encode_chat(tokenizer, template.text, template.special, ex.messages, f"{where} ({ex.id})")
    else:
        row = encode_completion(tokenizer, ex.prompt, ex.completion, f"{where} ({ex.id})")
    if max_length is not None:
        check_length(row, max_length, f"{where} ({ex.id})")
    return replace(row, id=ex.id)


def read_template(model_folder, template_file=None) -> Template:
    return Template(read_chat_template(model_folder, template_file), special_tokens(model_folder))


def encode_splits(data: dict, tokenizer, model_folder, template_file, max_length: int | None, where: str) -> dict:
    """{split: [TextExample]} -> {split: [TokenRow]}, every row checked (the template is read only for chat);
    other data is returned as it is. `where`: the manifests' folder (errors name <where>/<split>.jsonl:<line>)."""
    if not any(isinstance(ex, TextExample) for examples in data.values() for ex in examples):
        return data
    chat = any(ex.messages is not None for examples in data.values() for ex in examples)
    template = read_template(model_folder, template_file) if chat else None
    return {split: [encode_example(ex, tokenizer, template, max_length, f"{where}/{split}.jsonl:{i}")
                    for i, ex in enumerate(examples, 1)] for split, examples in data.items()}
