"""The checkpoint's tokenizer: tokenizer.json through `tokenizers`, with the special ids its config.json holds."""
from __future__ import annotations

from minimoe.core.decoder.model_config import MoEConfig
from minimoe.loading.config_json import read_config
from minimoe.loading.hub import resolve_checkpoint


class Tokenizer:
    """The checkpoint's tokenizer.json (via `tokenizers`) with the special ids from its config."""

    def __init__(self, tokenizer, config: MoEConfig):
        self.tokenizer = tokenizer
        self.eos_token_id, self.pad_token_id, self.bos_token_id = config.eos_token_id, config.pad_token_id, config.bos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __len__(self):
        return self.tokenizer.get_vocab_size()


def load_tokenizer(name_or_path, *, cache_dir=None, revision=None) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer
    folder = resolve_checkpoint(name_or_path, cache_dir, revision)
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no tokenizer.json")
    try:
        tokenizer = HFTokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for unreadable JSON
        raise ValueError(f"{path}: not a readable tokenizer ({e}); the file is truncated or corrupt") from None
    return Tokenizer(tokenizer, read_config(folder))
