"""A Hugging Face `tokenizer.json`, loaded with the `tokenizers` package (no network)."""

from __future__ import annotations

import json
import os

from dtrain.data.tokenizer import DOWNLOAD_HINT, Tokenizer
from dtrain.errors import DataError

# Spellings of BOS / EOS across model families, tried in order when tokenizer_config.json does not say which.
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>", "<|startoftext|>", "<|endoftext|>")
EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|endoftext|>")


def _configured_special(tokenizer_file: str, key: str) -> str | None:
    """`bos_token` / `eos_token` from a tokenizer_config.json beside the file, if there is one that names it."""
    config_file = os.path.join(os.path.dirname(tokenizer_file), "tokenizer_config.json")
    try:
        with open(config_file, encoding="utf-8") as f:
            value = json.load(f).get(key)
    except (OSError, ValueError):
        return None
    # Older configs wrap the token in an AddedToken dict.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` from `tokenizer.json`; BOS/EOS come from tokenizer_config.json or known names."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer as RustTokenizer

        try:
            self._tokenizer = RustTokenizer.from_file(path)
        except Exception as exc:  # the Rust side raises plain Exception for any malformed file
            first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise DataError(f"cannot load Hugging Face tokenizer {path!r} ({first_line}); {DOWNLOAD_HINT}") from exc
        self.path = path
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._special_id("bos_token", BOS_NAMES)
        self.eos_id = self._special_id("eos_token", EOS_NAMES)

    def _special_id(self, config_key: str, known_names: tuple[str, ...]) -> int:
        configured = _configured_special(self.path, config_key)
        for name in (configured,) + known_names if configured else known_names:
            token_id = self._tokenizer.token_to_id(name)
            if token_id is not None:
                return token_id
        raise DataError(
            f"Hugging Face tokenizer {self.path!r} has no {config_key.split('_')[0].upper()} token "
            f"(looked for {', '.join(known_names)} and tokenizer_config.json's {config_key}); "
            "use a tokenizer that defines one"
        )

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size})"
