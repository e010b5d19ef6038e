"""`build_tokenizer`: the tokenizer `model.tokenizer` asks for, read from `model.hf_assets_path`.

A module of its own so that tokenizer.py, the interface the Hugging Face and tiktoken tokenizers import, imports
none of them (no import cycle); those two load only when asked for (their packages are optional).
"""

from __future__ import annotations

import os

from dtrain.config.schema import Model
from dtrain.data.tokenizer import DOWNLOAD_HINT, ByteTokenizer, Tokenizer
from dtrain.errors import DataError


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
