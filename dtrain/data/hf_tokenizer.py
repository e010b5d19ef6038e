"""A Hugging Face tokenizer folder (`tokenizer.json`, optionally `tokenizer_config.json`), loaded with `tokenizers`.

Special tokens are resolved as transformers resolves them (`PreTrainedTokenizerFast`): the tokens of
tokenizer_config.json's `added_tokens_decoder` (in id order), then its named special tokens (`bos_token`,
`eos_token`, ...; a string or an AddedToken dict), are added to the tokenizer unless it already has them as added
tokens. A token already in the vocabulary keeps its id; a new one gets the next free id, whatever id the config
declares (torchtitan's test tokenizer declares BOS = 128000 over a 2002-token vocabulary: BOS becomes 2002, as in
transformers and torchtitan). No network is touched.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from dtrain.data.tokenizer import DOWNLOAD_HINT, Tokenizer
from dtrain.errors import DataError, first_line

logger = logging.getLogger("dtrain")

# Spellings of BOS / EOS across model families, tried in order when tokenizer_config.json does not say which.
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>", "<|startoftext|>", "<|endoftext|>")
EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|endoftext|>")
# transformers' named special tokens, in the order it adds the missing ones.
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def read_tokenizer_config(tokenizer_file: str) -> tuple[str, dict[str, Any]]:
    """The path of the tokenizer_config.json beside `tokenizer_file`, and its content ({} when there is none)."""
    config_file = os.path.join(os.path.dirname(tokenizer_file), "tokenizer_config.json")
    if not os.path.isfile(config_file):
        return config_file, {}
    try:
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read {config_file!r} ({first_line(exc)}); fix it or remove it") from exc
    if not isinstance(config, dict):
        raise DataError(f"{config_file!r} must hold a JSON object, got {type(config).__name__}")
    return config_file, config


def token_content(value: Any, where: str) -> str | None:
    """The text of a special token given as a string or an AddedToken dict (`{"content": ...}`); None if unset."""
    if isinstance(value, dict):
        value = value.get("content")
    if value is None or isinstance(value, str):
        return value
    raise DataError(f"{where} must be a string or an AddedToken dict with a 'content' string, got {value!r}")


def _config_tokens(config_file: str, config: dict[str, Any]) -> list[tuple[str, dict[str, Any], int | None]]:
    """(content, AddedToken options, declared id) of each token the config defines, in transformers' order."""
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise DataError(f"{config_file!r} added_tokens_decoder must map token ids to AddedToken dicts")
    tokens = []
    for key, entry in decoder.items():
        where = f"{config_file!r} added_tokens_decoder[{key!r}]"
        if not (isinstance(key, str) and key.isdigit()) or not isinstance(entry, dict):
            raise DataError(f"{where} must map a token id to an AddedToken dict")
        content = token_content(entry, where)
        if content is None:
            raise DataError(f"{where} has no 'content'")
        tokens.append((int(key), content, entry))
    ordered = [(content, entry, declared) for declared, content, entry in sorted(tokens, key=lambda t: t[0])]
    for key in SPECIAL_TOKEN_KEYS:
        content = token_content(config.get(key), f"{config_file!r} {key}")
        if content is not None:
            ordered.append((content, {"special": True, "normalized": False}, None))
    return ordered


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` from `tokenizer.json` plus tokenizer_config.json's special tokens.

    BOS/EOS: tokenizer_config.json's `bos_token` / `eos_token` when it names them, else the first of the known
    spellings (BOS_NAMES / EOS_NAMES) the tokenizer has.
    """

    kind = "hf"

    def __init__(self, path: str):
        from tokenizers import Tokenizer as RustTokenizer

        try:
            self._tokenizer = RustTokenizer.from_file(path)
        except Exception as exc:  # the Rust side raises plain Exception for any malformed file
            raise DataError(
                f"cannot load Hugging Face tokenizer {path!r} ({first_line(exc)}); {DOWNLOAD_HINT}"
            ) from exc
        self.path = path
        config_file, config = read_tokenizer_config(path)
        self._add_config_tokens(config_file, config)
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._special_id(config_file, config, "bos_token", BOS_NAMES)
        self.eos_id = self._special_id(config_file, config, "eos_token", EOS_NAMES)

    def _add_config_tokens(self, config_file: str, config: dict[str, Any]) -> None:
        from tokenizers import AddedToken

        present = {token.content for token in self._tokenizer.get_added_tokens_decoder().values()}
        tokens = _config_tokens(config_file, config)
        new = []
        for content, options, _ in tokens:
            if content in present:
                continue
            present.add(content)
            special = bool(options.get("special", True))
            new.append(
                AddedToken(
                    content,
                    single_word=bool(options.get("single_word", False)),
                    lstrip=bool(options.get("lstrip", False)),
                    rstrip=bool(options.get("rstrip", False)),
                    normalized=bool(options.get("normalized", not special)),
                    special=special,
                )
            )
        self._tokenizer.add_tokens(new)
        moved = [
            f"{content} {declared} -> {self._tokenizer.token_to_id(content)}"
            for content, _, declared in tokens
            if declared is not None and self._tokenizer.token_to_id(content) != declared
        ]
        if moved:
            # A test tokenizer with a cut vocabulary does this on purpose; for a real model's it means the ids
            # differ from the model's embedding rows, which a user should hear about.
            logger.warning(
                "%s: tokenizer_config.json declares ids that tokenizer.json does not have; they get the next free "
                "ids, as in transformers: %s",
                self.path, ", ".join(moved[:4]) + (f" (+{len(moved) - 4} more)" if len(moved) > 4 else ""),
            )

    def _special_id(self, config_file: str, config: dict[str, Any], key: str, known_names: tuple[str, ...]) -> int:
        configured = token_content(config.get(key), f"{config_file!r} {key}")
        for name in (configured,) if configured else known_names:
            token_id = self._tokenizer.token_to_id(name)
            if token_id is not None:
                return token_id
        raise DataError(
            f"Hugging Face tokenizer {self.path!r} has no {key.split('_')[0].upper()} token "
            f"(looked for {', '.join(known_names)} and tokenizer_config.json's {key}); "
            "use a tokenizer that defines one"
        )

    def encode(self, text: str) -> list[int]:
        # encode_batch releases the GIL while it works and encode does not: the data loading thread then
        # tokenizes without stalling the training loop's thread (tens of ms per long document otherwise).
        return self._tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size})"
