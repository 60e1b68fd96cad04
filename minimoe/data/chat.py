"""Chat and prompt/completion rows -> token ids and the mask of the tokens the loss falls on.

A conversation is rendered with the model's own chat template (jinja2, set up as transformers'
`apply_chat_template` sets it up: a sandboxed environment with trim_blocks and lstrip_blocks, the
loopcontrols extension, a `{% generation %}` tag, `raise_exception`, `strftime_now`, and a `tojson`
that does not escape HTML), with the tokenizer's special tokens (bos_token, eos_token, ...) as
variables, and tokenised whole without added special tokens, as transformers tokenises it.

Supervision (the loss mask), TRL's assistant-only loss: every assistant turn, all of them in a
multi-turn conversation; the other turns and the template's scaffolding are context.
- A template that marks its assistant text with `{% generation %}` says itself which characters
  are supervised (transformers' `return_assistant_tokens_mask`).
- Otherwise assistant turn i's characters are the difference between the conversation up to turn
  i - 1 rendered with `add_generation_prompt=True` and the conversation up to turn i: the turn's
  text and its end-of-turn marker (so the model learns to stop), not the role header. This needs
  each of those renderings to be a prefix of the whole conversation's; a template that renders an
  earlier turn differently once a later one follows (one that drops past reasoning, say) is refused.
A character span becomes tokens as transformers maps it: from the token holding its first character
to the token holding its last.

Prompt/completion rows: the prompt encoded with the tokenizer's special tokens, the completion
without, then the end-of-sequence token (TRL appends it too); the loss falls on the completion and
that token. The model's template is not used: the prompt is the text as given.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path

ROLES = ("system", "user", "assistant", "tool")
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True)
class TokenRow:  # one example as the loss reads it
    ids: list[int]
    supervised: list[bool]  # the tokens whose prediction counts; ids[0] is never one (nothing predicts it)
    id: str = ""  # its example's id (data/instruct.py)


class NoChatTemplate(ValueError):
    """A model without a chat template, and no --chat-template FILE."""


# ---- the template ----

def read_chat_template(model_folder, template_file=None) -> str:
    """--chat-template FILE, else the model folder's chat_template.jinja, else its tokenizer_config.json's
    `chat_template` (a string, or transformers' list of named templates: the one named "default")."""
    if template_file is not None:
        path = Path(template_file)
        if not path.is_file():
            raise FileNotFoundError(f"--chat-template {template_file}: no such file; expected a jinja2 chat template")
        return path.read_text(encoding="utf-8")
    folder = Path(model_folder)
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    config = folder / "tokenizer_config.json"
    template = json.loads(config.read_text(encoding="utf-8")).get("chat_template") if config.is_file() else None
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    if not isinstance(template, str):
        raise NoChatTemplate(f"{folder}: the model has no chat template (no chat_template.jinja, no chat_template in "
                             f"tokenizer_config.json); give one with --chat-template FILE")
    return template


def special_tokens(model_folder) -> dict[str, str]:
    """The template's special-token variables, as tokenizer_config.json names them (a string or an
    AddedToken's {"content": ...})."""
    config = Path(model_folder) / "tokenizer_config.json"
    found = json.loads(config.read_text(encoding="utf-8")) if config.is_file() else {}
    out = {}
    for key in SPECIAL_TOKENS:
        value = found.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[key] = value
    return out


@lru_cache(maxsize=8)
def compile_template(template: str):
    """The template compiled in transformers' environment (module docstring); `{% generation %}` records
    the character spans it encloses in the list bound to the render's `_spans` (`render`)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark", [jinja2.nodes.ContextReference()]), [], [],
                                          body).set_lineno(lineno)

        def _mark(self, context, caller):
            text = caller()
            blocks, spans = context.get("_blocks"), context.get("_spans")
            if spans is not None:  # the text rendered so far is every block already yielded
                start = sum(map(len, blocks))
                spans.append((start, start + len(text)))
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render(template: str, messages: list[dict], special: dict, *, add_generation_prompt: bool = False
           ) -> tuple[str, list[tuple[int, int]]]:
    """-> (the text, the character spans `{% generation %}` enclosed)."""
    blocks, spans = [], []
    for block in compile_template(template).generate(messages=messages, tools=None, documents=None,
                                                     add_generation_prompt=add_generation_prompt,
                                                     **special, _blocks=blocks, _spans=spans):
        blocks.append(block)
    return "".join(blocks), spans


def assistant_spans(template: str, messages: list[dict], special: dict, where: str) -> tuple[str, list]:
    """-> (the conversation's text, the character spans of its assistant turns) (module docstring)."""
    text, spans = render(template, messages, special)
    if GENERATION_TAG.search(template):
        return text, spans
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, _ = render(template, messages[:i], special, add_generation_prompt=True)
        through, _ = render(template, messages[:i + 1], special)
        if not (text.startswith(before) and text.startswith(through) and len(before) <= len(through)):
            raise ValueError(f"{where}: the chat template renders the conversation up to assistant turn {i} "
                             f"differently once later turns follow; its assistant tokens cannot be found by "
                             f"prefix. Give a template with {{% generation %}} tags by --chat-template FILE")
        spans.append((len(before), len(through)))
    return text, spans


def token_mask(encoding, spans: list[tuple[int, int]]) -> list[bool]:
    """Character spans -> a mask over `encoding`'s tokens (a `tokenizers` Encoding), as transformers maps
    them: from the token of the span's first character to that of its last."""
    mask = [False] * len(encoding.ids)
    for start, end in spans:
        if end <= start:
            continue
        first, last = encoding.char_to_token(start), encoding.char_to_token(end - 1)
        if first is None:
            continue
        for t in range(first, (last if last is not None else len(mask) - 1) + 1):
            mask[t] = True
    return mask


# ---- checks and encoding ----

def check_messages(messages, where: str) -> None:
    """Refuse what cannot be supervised: no list, an empty one, a turn that is no {role, content} or
    names an unknown role, no assistant turn."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: {'an empty conversation' if messages == [] else repr(messages)[:80]}; "
                         f"expected a list of {{\"role\", \"content\"}} turns")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: turn {i} is {json.dumps(m)[:80]}; expected {{\"role\": ..., \"content\": "
                             f"<text>}}")
        if m["role"] not in ROLES:
            raise ValueError(f"{where}: turn {i} has role {m['role']!r}; expected one of {list(ROLES)}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: no assistant turn; expected at least one (the loss falls on them)")


def encode_chat(tokenizer, template: str, special: dict, messages: list[dict], where: str) -> TokenRow:
    """A checked conversation -> its tokens and assistant mask. `tokenizer`: checkpoint.Tokenizer."""
    text, spans = assistant_spans(template, messages, special, where)
    encoding = tokenizer.tokenizer.encode(text, add_special_tokens=False)
    mask = token_mask(encoding, spans)
    mask[0] = False  # nothing predicts the first token
    if not any(mask):
        raise ValueError(f"{where}: the chat template leaves no assistant token to supervise")
    return TokenRow(list(encoding.ids), mask)


def encode_completion(tokenizer, prompt: str, completion: str, where: str) -> TokenRow:
    """prompt (with special tokens) + completion (without) + eos; the loss on the completion and eos."""
    head = tokenizer.encode(prompt)
    tail = tokenizer.encode(completion, add_special_tokens=False)
    if tokenizer.eos_token_id is not None:
        tail = tail + [tokenizer.eos_token_id]
    if not head or not tail:
        raise ValueError(f"{where}: {'the prompt' if not head else 'the completion'} encodes to no tokens; "
                         f"expected text in both")
    return TokenRow(head + tail, [False] * len(head) + [True] * len(tail))


def check_length(row: TokenRow, max_length: int, where: str) -> None:
    """A row longer than max_length is refused: it is never cut, since a cut would drop supervised tokens
    or the context they are predicted from, unseen."""
    if len(row.ids) > max_length:
        raise ValueError(f"{where}: {len(row.ids)} tokens, longer than --max-length {max_length}; raise "
                         f"--max-length or shorten the row (rows are never truncated)")
