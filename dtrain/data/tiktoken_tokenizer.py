"""A Llama 3 style tiktoken `tokenizer.model`: a base64 BPE ranks file plus 256 reserved special tokens.

The file holds one `<base64 token> <rank>` pair per line. The special tokens follow the ranks (ids 128000..128255
for Llama 3's 128000-token file): `<|begin_of_text|>` is the first, `<|end_of_text|>` the second.
"""

from __future__ import annotations

import base64

from dtrain.data.tokenizer import DOWNLOAD_HINT, Tokenizer
from dtrain.errors import DataError

# Llama 3's pre-tokenizer: contractions, letter runs, digit groups of at most three, punctuation, whitespace.
LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
NUM_RESERVED_SPECIAL_TOKENS = 256


def llama3_special_tokens() -> list[str]:
    """The 256 special token names of Llama 3.1, in id order."""
    named = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|reserved_special_token_2|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
    ]
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(3, NUM_RESERVED_SPECIAL_TOKENS - len(named) + 3)]
    return named + reserved


def load_bpe_ranks(path: str) -> dict[bytes, int]:
    """Parse a tiktoken ranks file; DataError naming the file and line when it is not one."""
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise DataError(f"cannot read tiktoken file {path!r} ({exc.strerror}); {DOWNLOAD_HINT}") from exc
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as exc:  # binascii.Error is a ValueError too
            raise DataError(
                f"tiktoken file {path!r} line {number} is not '<base64 token> <rank>'; {DOWNLOAD_HINT}"
            ) from exc
    if not ranks:
        raise DataError(f"tiktoken file {path!r} holds no tokens; {DOWNLOAD_HINT}")
    return ranks


class TiktokenTokenizer(Tokenizer):
    """tiktoken BPE with Llama 3's split pattern and special tokens appended after the ranks."""

    kind = "tiktoken"

    def __init__(self, path: str):
        try:
            import tiktoken
        except ImportError as exc:
            raise DataError(f"reading {path!r} needs tiktoken: pip install 'dtrain[tiktoken]'") from exc
        ranks = load_bpe_ranks(path)
        num_base = len(ranks)
        specials = {name: num_base + i for i, name in enumerate(llama3_special_tokens())}
        try:
            self._encoding = tiktoken.Encoding(
                name=path, pat_str=LLAMA3_SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens=specials
            )
        except ValueError as exc:
            raise DataError(f"tiktoken file {path!r} is not a valid BPE ranks file ({exc}); {DOWNLOAD_HINT}") from exc
        self.path = path
        self.vocab_size = num_base + len(specials)
        self.bos_id = specials["<|begin_of_text|>"]
        self.eos_id = specials["<|end_of_text|>"]
        self._num_base = num_base

    def encode(self, text: str) -> list[int]:
        # encode_ordinary treats special-token text inside documents as plain text, never as control tokens.
        return self._encoding.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self._encoding.decode([i for i in ids if i < self._num_base])

    def __repr__(self) -> str:
        return f"TiktokenTokenizer({self.path!r}, vocab_size={self.vocab_size})"
