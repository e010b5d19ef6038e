"""Pre-tokenized datasets: the folder format that scripts/tokenize_dataset.py writes and `training.dataset =
"tokens"` reads, memory-mapped.

The shards in order hold every document as `[BOS] tokens [EOS]`, the packer's stream for one pass over the source,
so window k of `seq_len + 1` tokens is found from the shard sizes alone; `manifest.json` (written last, atomically)
says what made them. docs/data.md ("Pre-tokenizing a corpus") lists the files and the manifest's fields.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from typing import Any

import numpy as np

from dtrain.data.tokenizer import Tokenizer
from dtrain.errors import DataError

FORMAT = "dtrain-tokens"
VERSION = 1
MANIFEST_NAME = "manifest.json"
# Shards kept memory-mapped at once by one reader (the least recently read is closed first).
MAX_OPEN_SHARDS = 64
TOKENIZE_HINT = "write it with `python scripts/tokenize_dataset.py --input ... --output DIR`"


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id below `vocab_size`."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def shard_file_names(index: int) -> tuple[str, str]:
    """The tokens and offsets file names of shard `index`."""
    return f"shard_{index:05d}.tokens", f"shard_{index:05d}.offsets.npy"


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tokenizer_identity(tokenizer: Tokenizer) -> dict[str, Any]:
    """What identifies the ids a tokenizer makes: its kind, vocabulary, BOS/EOS and the sha256 of its file."""
    path = getattr(tokenizer, "path", None)
    return {
        "kind": getattr(tokenizer, "kind", type(tokenizer).__name__),
        "vocab_size": int(tokenizer.vocab_size),
        "bos_id": int(tokenizer.bos_id),
        "eos_id": int(tokenizer.eos_id),
        "sha256": file_sha256(path) if path else None,
    }


def read_manifest(folder: str, key: str = "training.dataset_path") -> dict[str, Any]:
    """The manifest of the dataset in `folder` (named by config `key` in errors); DataError when it is not one."""
    path = os.path.join(folder, MANIFEST_NAME)
    if not folder:
        raise DataError(f"training.dataset = 'tokens' needs {key}: a folder of token shards; {TOKENIZE_HINT}")
    if not os.path.isfile(path):
        what = "does not exist" if not os.path.exists(folder) else f"has no {MANIFEST_NAME}"
        raise DataError(f"{key} {folder!r} {what}: not a pre-tokenized dataset; {TOKENIZE_HINT}")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise DataError(f"{key} {folder!r}: cannot read {MANIFEST_NAME} ({exc}); {TOKENIZE_HINT}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{key} {folder!r}: {MANIFEST_NAME} is not a {FORMAT} manifest; {TOKENIZE_HINT}")
    if manifest.get("version") != VERSION:
        raise DataError(
            f"{key} {folder!r} has format version {manifest.get('version')!r}; this dtrain reads version {VERSION}: "
            "tokenize it again"
        )
    return manifest


def check_tokenizer(manifest: dict[str, Any], tokenizer: Tokenizer, folder: str, key: str) -> None:
    """Refuse a tokenizer other than the one that made the shards (a mismatch would train on wrong ids)."""
    saved, now = manifest["tokenizer"], tokenizer_identity(tokenizer)
    differences = [name for name in ("kind", "vocab_size", "bos_id", "eos_id", "sha256") if saved.get(name) != now[name]]
    if differences:
        shown = ", ".join(f"{name} {saved.get(name)!r} vs {now[name]!r}" for name in differences)
        raise DataError(
            f"{key} {folder!r} was tokenized by another tokenizer than this run's model.tokenizer / "
            f"model.hf_assets_path ({shown}); use the tokenizer it was made with, or tokenize it again with this one"
        )


class TokenShards:
    """The token stream of a pre-tokenized dataset, memory-mapped: `read(start, count)` returns global tokens
    [start, start + count) as int64, reading only those (plus the shards' sizes, known from the manifest).

    Checks at open: the manifest is complete, the tokenizer is the one that made it, and every tokens file has the
    size the manifest gives (a truncated or missing shard is refused, naming it). Checksums are for
    `scripts/tokenize_dataset.py --verify`, which reads every byte. Each read checks its ids against the
    tokenizer's vocabulary, so a damaged or foreign shard is refused before an id reaches the embedding.
    """

    def __init__(self, folder: str, tokenizer: Tokenizer, key: str = "training.dataset_path"):
        self.folder = folder
        manifest = read_manifest(folder, key)
        if not manifest.get("complete"):
            raise DataError(
                f"{key} {folder!r} is incomplete (its tokenization was interrupted): run scripts/tokenize_dataset.py "
                "again with the same arguments to finish it"
            )
        check_tokenizer(manifest, tokenizer, folder, key)
        self.key = key
        # The tokenizer's, not the model's (which may be larger): no id at or above it can have been written by
        # the tokenizer the manifest names (the writer refuses one), so any such id is damage, even one the
        # model's padding rows would accept.
        self.vocab_size = int(tokenizer.vocab_size)
        self.dtype = np.dtype(manifest["dtype"]).newbyteorder("<")  # the format is little-endian
        self.num_tokens = int(manifest["num_tokens"])
        self.num_documents = int(manifest["num_documents"])
        self.description = (
            f"pre-tokenized dataset {folder!r} ({self.num_tokens:,} tokens, {self.num_documents:,} documents)"
        )
        self._files = [os.path.join(folder, shard["tokens"]) for shard in manifest["shards"]]
        sizes = [int(shard["num_tokens"]) for shard in manifest["shards"]]
        for path, size in zip(self._files, sizes):
            actual = os.path.getsize(path) if os.path.isfile(path) else None
            if actual != size * self.dtype.itemsize:
                found = "missing" if actual is None else f"{actual} bytes"
                raise DataError(
                    f"{key} {folder!r}: shard {os.path.basename(path)} is {found}, its manifest says "
                    f"{size * self.dtype.itemsize} bytes; the folder is damaged: tokenize it again"
                )
        # starts[i]: global index of shard i's first token; starts[-1] = num_tokens.
        self._starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self._maps: OrderedDict[int, np.ndarray] = OrderedDict()

    def _shard(self, index: int) -> np.ndarray:
        # Opened on first use, so that a dataset of thousands of shards costs nothing until a rank reads one; at
        # most MAX_OPEN_SHARDS stay mapped (each map holds a file descriptor, and random samples touch every shard).
        if index in self._maps:
            self._maps.move_to_end(index)
        else:
            self._maps[index] = np.memmap(self._files[index], dtype=self.dtype, mode="r")
            if len(self._maps) > MAX_OPEN_SHARDS:
                self._maps.popitem(last=False)
        return self._maps[index]

    def read(self, start: int, count: int) -> np.ndarray:
        """Global tokens [start, start + count) as int64 (a window may span shards)."""
        if start < 0 or start + count > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + count}) are outside [0, {self.num_tokens})")
        pieces, position, end = [], start, start + count
        shard = int(np.searchsorted(self._starts, start, side="right")) - 1
        while position < end:
            offset = position - int(self._starts[shard])
            take = min(end, int(self._starts[shard + 1])) - position
            piece = self._shard(shard)[offset : offset + take]
            self._check_ids(piece, shard, offset)
            pieces.append(piece)
            position += take
            shard += 1
        return np.concatenate(pieces).astype(np.int64) if pieces else np.empty(0, dtype=np.int64)

    def _check_ids(self, piece: np.ndarray, shard: int, offset: int) -> None:
        # One vectorised max per window: a few microseconds beside the copy (the ids are unsigned, never < 0).
        if piece.size and int(piece.max()) >= self.vocab_size:
            where = int(np.argmax(piece >= self.vocab_size))
            raise DataError(
                f"{self.key} {self.folder!r}: shard {os.path.basename(self._files[shard])} holds id "
                f"{int(piece[where])} at token {offset + where}, outside the tokenizer's vocabulary of "
                f"{self.vocab_size}; the shard is damaged or foreign: tokenize it again "
                "(scripts/tokenize_dataset.py --verify checks every shard)"
            )

    def __getstate__(self) -> dict[str, Any]:
        # Worker processes and pickling reopen the maps themselves.
        return {**self.__dict__, "_maps": OrderedDict()}
