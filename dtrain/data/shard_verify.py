"""Verify a tokenized corpus (scripts/tokenize_dataset.py --verify): re-read every byte of its token shards against
the manifest, so a damaged folder is named before a run trains on it."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np

from dtrain.data.token_shards import MANIFEST_NAME, read_manifest, token_dtype
from dtrain.errors import DataError, first_line

# Bytes read at a time by verify (a multiple of every token size).
VERIFY_BLOCK_BYTES = 1 << 24


def verify(folder: str) -> str:
    """Re-read every byte of the dataset in `folder`: checksums, sizes, ids inside the vocabulary, document
    boundaries (offsets from 0 to the shard's size, BOS at every start, EOS before every end) and totals.
    Returns a one-line summary; DataError naming the first problem."""
    manifest = read_manifest(folder, "--verify")
    try:
        return _verify(folder, manifest)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise DataError(
            f"--verify {folder!r}: {MANIFEST_NAME} is malformed ({type(exc).__name__}: {first_line(exc)}); "
            "tokenize it again"
        ) from None


def _verify(folder: str, manifest: dict[str, Any]) -> str:
    if not manifest["complete"]:
        raise DataError(
            f"--verify {folder!r} is incomplete ({len(manifest['shards'])} shard(s) so far): its tokenization was "
            "interrupted; run the same tokenize command again to finish it"
        )
    tokenizer = manifest["tokenizer"]
    vocab_size, bos, eos = int(tokenizer["vocab_size"]), int(tokenizer["bos_id"]), int(tokenizer["eos_id"])
    if manifest["dtype"] != token_dtype(vocab_size).name:
        raise DataError(
            f"--verify {folder!r}: dtype {manifest['dtype']!r} is not the one for a vocabulary of {vocab_size}"
        )
    dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    total_tokens = total_documents = 0
    for shard in manifest["shards"]:
        where = f"--verify {folder!r}: shard {shard['tokens']}"
        path, size = os.path.join(folder, shard["tokens"]), int(shard["num_tokens"]) * dtype.itemsize
        if not os.path.isfile(path) or os.path.getsize(path) != size:
            found = "missing" if not os.path.isfile(path) else f"{os.path.getsize(path)} bytes"
            raise DataError(
                f"{where} is {found}, its manifest says {size} bytes; the folder is damaged: tokenize it again"
            )
        digest, highest = hashlib.sha256(), -1
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(VERIFY_BLOCK_BYTES), b""):
                digest.update(block)
                highest = max(highest, int(np.frombuffer(block, dtype=dtype).max()))
        if digest.hexdigest() != shard["sha256"]:
            raise DataError(f"{where} does not match its checksum: the file is damaged; tokenize it again")
        if highest >= vocab_size:
            raise DataError(f"{where} holds id {highest}, outside the tokenizer's vocabulary of {vocab_size}")
        offsets = _read_offsets(folder, shard, where)
        tokens = np.memmap(path, dtype=dtype, mode="r")
        if np.any(tokens[offsets[:-1]] != bos) or np.any(tokens[offsets[1:] - 1] != eos):
            raise DataError(f"{where}: a document does not start with BOS {bos} or end with EOS {eos}")
        total_tokens += int(shard["num_tokens"])
        total_documents += int(shard["num_documents"])
    if (total_tokens, total_documents) != (manifest["num_tokens"], manifest["num_documents"]):
        raise DataError(
            f"--verify {folder!r}: the shards hold {total_tokens:,} tokens and {total_documents:,} documents, "
            f"{MANIFEST_NAME} says {manifest['num_tokens']:,} and {manifest['num_documents']:,}"
        )
    return (
        f"{folder}: OK, {len(manifest['shards'])} shard(s), {total_documents:,} documents, {total_tokens:,} tokens "
        f"({manifest['dtype']}, {tokenizer['kind']} tokenizer, vocab {vocab_size})"
    )


def _read_offsets(folder: str, shard: dict[str, Any], where: str) -> np.ndarray:
    """A shard's document offsets, checked: int64[num_documents + 1] from 0 to num_tokens, each document holding at
    least its BOS and EOS."""
    path = os.path.join(folder, shard["offsets"])
    try:
        offsets = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise DataError(f"{where}: cannot read {shard['offsets']} ({first_line(exc)}); tokenize it again") from None
    if (
        offsets.dtype != np.int64
        or offsets.ndim != 1
        or len(offsets) != int(shard["num_documents"]) + 1
        or offsets[0] != 0
        or offsets[-1] != int(shard["num_tokens"])
        or np.any(np.diff(offsets) < 2)
    ):
        raise DataError(
            f"{where}: {shard['offsets']} does not describe its {shard['num_documents']} documents (int64 offsets "
            "from 0 to the shard's size, at least BOS and EOS each); tokenize it again"
        )
    return offsets
