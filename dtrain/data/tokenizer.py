"""The tokenizer interface and the built-in byte-level tokenizer (`tokenizer_factory.py` picks one from the config).

Every tokenizer turns text into ids without special tokens (`encode`) and back (`decode`, which drops special
tokens); the packer adds `bos_id` / `eos_id` around each document itself, so that every kind behaves the same.
Loading never touches the network: Hugging Face and tiktoken files must already be on disk
(`scripts/download_hf_assets.py` fetches them).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

DOWNLOAD_HINT = (
    "run `python scripts/download_hf_assets.py --repo_id <org/model, e.g. meta-llama/Llama-3.1-8B> "
    "--assets tokenizer` or set model.hf_assets_path to a folder that holds one"
)


class Tokenizer(ABC):
    """Text <-> token ids. `vocab_size` counts every id the tokenizer can produce, special tokens included."""

    vocab_size: int
    bos_id: int
    eos_id: int
    # What model.tokenizer calls this kind; `path` is the file it was read from (None: it reads none).
    kind: str
    path: str | None = None

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Ids of `text`, with no BOS/EOS or other special tokens added."""

    @abstractmethod
    def decode(self, ids: list[int]) -> str:
        """Text of `ids`; special tokens (BOS, EOS, ...) are dropped."""


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, then BOS = 256 and EOS = 257. Needs no file, so it is the default."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257
    kind = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        # Windows cut documents anywhere, also inside a multi-byte character: replace rather than fail.
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=258)"
