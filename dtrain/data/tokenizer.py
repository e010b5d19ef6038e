"""The tokenizer interface, the built-in byte-level tokenizer, and `build_tokenizer`, which picks one from the config.

Every tokenizer turns text into ids without special tokens (`encode`) and back (`decode`, which drops special
tokens); the packer adds `bos_id` / `eos_id` around each document itself, so that every kind behaves the same.
Loading never touches the network: Hugging Face and tiktoken files must already be on disk
(`scripts/download_hf_assets.py` fetches them).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod

from dtrain.config.schema import Model
from dtrain.errors import DataError

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


def _resolve_file(assets_path: str, file_name: str) -> str:
    """`assets_path` itself when it is a file, else `file_name` inside that folder; DataError when missing."""
    if os.path.isfile(assets_path):
        return assets_path
    candidate = os.path.join(assets_path, file_name)
    if not os.path.isfile(candidate):
        where = "folder" if os.path.isdir(assets_path) else "path (does not exist)"
        raise DataError(f"model.hf_assets_path {where} {assets_path!r} has no {file_name}; {DOWNLOAD_HINT}")
    return candidate


def build_tokenizer(model_cfg: Model) -> Tokenizer:
    """The tokenizer `model.tokenizer` asks for, loaded from `model.hf_assets_path`.

    auto: byte-level when hf_assets_path is empty; else tokenizer.json (Hugging Face) when that folder has one,
    else tokenizer.model (tiktoken). hf_assets_path may also name the file itself.
    """
    kind, path = model_cfg.tokenizer, model_cfg.hf_assets_path
    if kind == "byte" or (kind == "auto" and not path):
        return ByteTokenizer()
    if not path:
        raise DataError(f"model.tokenizer = {kind!r} needs model.hf_assets_path; {DOWNLOAD_HINT}")
    if kind == "auto":
        if os.path.isfile(path):
            kind = "hf" if path.endswith(".json") else "tiktoken"
        elif os.path.isfile(os.path.join(path, "tokenizer.json")):
            kind = "hf"
        elif os.path.isfile(os.path.join(path, "tokenizer.model")):
            kind = "tiktoken"
        else:
            raise DataError(
                f"model.hf_assets_path {path!r} holds neither tokenizer.json nor tokenizer.model; {DOWNLOAD_HINT}"
            )
    if kind == "hf":
        from dtrain.data.hf_tokenizer import HFTokenizer

        return HFTokenizer(_resolve_file(path, "tokenizer.json"))
    if kind == "tiktoken":
        from dtrain.data.tiktoken_tokenizer import TiktokenTokenizer

        return TiktokenTokenizer(_resolve_file(path, "tokenizer.model"))
    raise DataError(f"model.tokenizer = {kind!r} is not one of auto, byte, hf, tiktoken")
