"""Tokenize a corpus once into token shards (the format of token_shards.py): what scripts/tokenize_dataset.py runs.

Documents are tokenized in worker processes (in source order, so the bytes do not depend on their number) and
streamed into shards, each renamed into place before the manifest is rewritten: an interrupted run leaves only
whole shards, and running again continues after the last one (docs/data.md, "Pre-tokenizing a corpus").
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import threading
import time
from array import array
from collections.abc import Iterator
from typing import Any, TextIO

import numpy as np

from dtrain.data.packing import tokenized_passes
from dtrain.data.sources import DocumentSource
from dtrain.data.token_shards import (
    FORMAT,
    MANIFEST_NAME,
    VERSION,
    read_manifest,
    shard_file_names,
    token_dtype,
    tokenizer_identity,
)
from dtrain.data.tokenizer import Tokenizer
from dtrain.data.workers import TokenizerPool
from dtrain.errors import DataError, first_line
from dtrain.reliability.durable import fsync_path

# A shard of this many tokens is 256 MiB in uint16: few files for a large corpus, little to redo after a crash.
DEFAULT_SHARD_TOKENS = 2**27
# Tokens converted and written at a time: the writer's memory stays small, whatever shard_tokens is.
WRITE_CHUNK_TOKENS = 1 << 20
# Groups of documents each worker keeps ready (workers.TokenizerPool's prefetch_factor).
PREFETCH_GROUPS = 4
TEMPORARY_SUFFIX = ".tmp"
# Config keys that messages of the sources and tokenizers name, and the arguments of the script that set them here.
COMMAND_LINE_NAMES = {
    "training.dataset_text_field": "--text_field",
    "training.dataset_path": "--input",
    "training.dataloader.num_workers": "--workers",
    "model.hf_assets_path": "--hf_assets_path",
    "model.tokenizer": "--tokenizer",
}
_SHARD_FILE = re.compile(r"shard_\d+\.(tokens|offsets\.npy)")


def command_line_message(message: str) -> str:
    """`message` with the config keys it names replaced by the script's arguments that set them."""
    for key, argument in COMMAND_LINE_NAMES.items():
        message = message.replace(key, argument)
    return message


class Progress:
    """Progress on stderr: on a terminal one line rewritten about once a second, elsewhere (a log) one line per
    shard; and a summary line at the end. Counts include the shards of an earlier, interrupted run."""

    def __init__(self, enabled: bool = True, stream: TextIO | None = None, interval: float = 1.0):
        self.enabled, self.stream, self.interval = enabled, stream or sys.stderr, interval
        self.documents = self.tokens = self.shards = 0
        # Set by tokenize_corpus when it has work to do (False: the folder was already complete).
        self.started = False
        self._new_documents = self._new_tokens = 0
        self._start = self._shown = time.monotonic()
        self._live = enabled and self.stream.isatty()

    def start(self, documents: int, tokens: int, shards: int) -> None:
        self.documents, self.tokens, self.shards, self.started = documents, tokens, shards, True
        self._start = self._shown = time.monotonic()

    def line(self) -> str:
        elapsed = max(time.monotonic() - self._start, 1e-9)
        return (
            f"{self.documents:,} documents, {self.tokens:,} tokens, {self._new_documents / elapsed:,.0f} docs/s, "
            f"{self._new_tokens / elapsed:,.0f} tokens/s, {self.shards} shard(s) written"
        )

    def update(self, documents: int, tokens: int) -> None:
        self.documents += documents
        self.tokens += tokens
        self._new_documents += documents
        self._new_tokens += tokens
        if self._live:
            now = time.monotonic()
            if now - self._shown >= self.interval:
                self._shown = now
                print("\r" + self.line(), end="", file=self.stream, flush=True)

    def shard(self) -> None:
        self.shards += 1
        if self.enabled and not self._live:
            print(self.line(), file=self.stream, flush=True)

    def end_line(self) -> None:
        """End the line being rewritten on the terminal, so that a message can follow (an error, Ctrl-C)."""
        if self._live and self._shown > self._start:
            print(file=self.stream, flush=True)

    def finish(self) -> None:
        if self.enabled:
            print(("\r" if self._live else "") + self.line() + f" in {time.monotonic() - self._start:.1f} s",
                  file=self.stream, flush=True)


def _write_manifest(folder: str, manifest: dict[str, Any]) -> None:
    path = os.path.join(folder, MANIFEST_NAME)
    with open(path + TEMPORARY_SUFFIX, "w") as f:
        f.write(json.dumps(manifest, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + TEMPORARY_SUFFIX, path)
    fsync_path(folder)


def _existing_manifest(
    folder: str, identity: dict[str, Any], source_info: dict[str, Any], shard_tokens: int | None
) -> dict[str, Any] | None:
    """The manifest of a folder this script wrote for the same input, tokenizer and shard size; None for a new or
    empty folder. Refuses (writing nothing) a folder that holds something else."""
    if not os.path.exists(folder):
        return None
    if not os.path.isdir(folder):
        raise DataError(f"--output {folder!r} is a file; give a new or empty folder, or one this script wrote")
    if not os.path.isfile(os.path.join(folder, MANIFEST_NAME)):
        if os.listdir(folder):
            raise DataError(
                f"--output {folder!r} is not empty and holds no {MANIFEST_NAME}; give a new or empty folder"
            )
        return None
    manifest = read_manifest(folder, "--output")
    saved_input = {key: value for key, value in manifest.get("input", {}).items() if key != "next_position"}
    wanted = {"input": source_info, "tokenizer": identity}
    if shard_tokens is not None:
        wanted["shard_tokens"] = shard_tokens
    saved = {"input": saved_input, "tokenizer": manifest.get("tokenizer"), "shard_tokens": manifest.get("shard_tokens")}
    for key, value in wanted.items():
        if saved[key] != value:
            raise DataError(
                f"--output {folder!r} holds a tokenization with another {key} ({saved[key]!r}, this run: {value!r}); "
                "give the arguments it was made with to finish it, or another --output"
            )
    return manifest


def _new_manifest(identity: dict[str, Any], source_info: dict[str, Any], shard_tokens: int) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "dtype": token_dtype(identity["vocab_size"]).name,
        "tokenizer": identity,
        "shard_tokens": shard_tokens,
        "num_tokens": 0,
        "num_documents": 0,
        "shards": [],
        "input": {**source_info, "next_position": 0},
        "complete": False,
    }


def _prepare_resume(folder: str, manifest: dict[str, Any]) -> None:
    """Check that the shards the manifest lists are whole, and remove what an interrupted run left besides them
    (temporary files, shards written after the last manifest)."""
    itemsize = np.dtype(manifest["dtype"]).itemsize
    listed = {MANIFEST_NAME}
    for shard in manifest["shards"]:
        path = os.path.join(folder, shard["tokens"])
        size = os.path.getsize(path) if os.path.isfile(path) else None
        if size != shard["num_tokens"] * itemsize or not os.path.isfile(os.path.join(folder, shard["offsets"])):
            raise DataError(
                f"--output {folder!r}: shard {shard['tokens']} is missing or not the size its manifest says; the "
                "folder is damaged: remove it and tokenize again"
            )
        listed.update((shard["tokens"], shard["offsets"]))
    for name in os.listdir(folder):
        temporary = name.startswith(("shard_", MANIFEST_NAME)) and name.endswith(TEMPORARY_SUFFIX)
        if (temporary or _SHARD_FILE.fullmatch(name)) and name not in listed:
            os.remove(os.path.join(folder, name))


class _ShardWriter:
    """One shard being written: tokens streamed to a temporary file, document ends kept; `commit` renames it into
    place, `discard` removes it."""

    def __init__(self, folder: str, index: int, dtype: np.dtype, vocab_size: int):
        self.folder, self.vocab_size = folder, vocab_size
        self.dtype = dtype.newbyteorder("<")  # the format is little-endian whatever the machine
        self.tokens_name, self.offsets_name = shard_file_names(index)
        self.num_tokens = 0
        self._ends = array("q", [0])
        self._pending: list[np.ndarray] = []
        self._pending_tokens = 0
        self._digest = hashlib.sha256()
        self._file = open(self._temporary(self.tokens_name), "wb")

    def _temporary(self, name: str) -> str:
        return os.path.join(self.folder, name + TEMPORARY_SUFFIX)

    def add(self, tokens: np.ndarray) -> None:
        """Append one document's `[BOS] tokens [EOS]`."""
        self._pending.append(tokens)
        self._pending_tokens += len(tokens)
        self.num_tokens += len(tokens)
        self._ends.append(self.num_tokens)
        if self._pending_tokens >= WRITE_CHUNK_TOKENS:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        chunk = np.concatenate(self._pending)
        self._pending, self._pending_tokens = [], 0
        low, high = int(chunk.min()), int(chunk.max())
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise DataError(
                f"the tokenizer made id {bad}, outside its vocabulary [0, {self.vocab_size}); its vocab_size is "
                "wrong: fix the tokenizer files"
            )
        data = chunk.astype(self.dtype).tobytes()
        self._digest.update(data)
        self._file.write(data)

    def commit(self) -> dict[str, Any]:
        """Write what is left, rename the shard's files into place; returns its manifest entry."""
        self._flush()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        with open(self._temporary(self.offsets_name), "wb") as f:
            np.save(f, np.array(self._ends, dtype=np.int64))
            f.flush()
            os.fsync(f.fileno())
        for name in (self.tokens_name, self.offsets_name):
            os.replace(self._temporary(name), os.path.join(self.folder, name))
        return {
            "tokens": self.tokens_name,
            "offsets": self.offsets_name,
            "num_tokens": self.num_tokens,
            "num_documents": len(self._ends) - 1,
            "sha256": self._digest.hexdigest(),
        }

    def discard(self) -> None:
        try:
            self._file.close()  # may fail flushing (a full disk): the file goes anyway
        except OSError:
            pass
        for name in (self.tokens_name, self.offsets_name):
            if os.path.exists(self._temporary(name)):
                os.remove(self._temporary(name))


def _one_pass(
    source: DocumentSource, tokenizer: Tokenizer, start: int, pool: TokenizerPool | None
) -> Iterator[tuple[int, np.ndarray]]:
    """(position, [BOS] tokens [EOS]) of every document from `start` to the end of the source, in order."""
    if pool is not None:
        stream = pool.stream(0, start, threading.Event())
    else:
        stream = tokenized_passes(source, tokenizer, 0, start)
    for epoch, position, tokens in stream:
        if epoch != 0:  # the stream goes on with the next pass: this one is done
            return
        yield position, tokens


def tokenize_corpus(
    source: DocumentSource,
    source_info: dict[str, Any],
    tokenizer: Tokenizer,
    folder: str,
    *,
    workers: int = 0,
    shard_tokens: int | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Write (or finish) the token shards of one pass over `source` in `folder`; returns the manifest.

    `source_info` is what `open_input` returns beside the source ({"path", "kind", "text_field"}). A new or empty
    folder is written from the start; an incomplete one written for the same input, tokenizer and shard size is
    continued after its last whole shard; a complete one is returned as it is. Anything else is refused before
    anything is written. `workers` > 0 tokenizes in that many processes, 0 here. `shard_tokens` None: the folder's
    own when resuming, else DEFAULT_SHARD_TOKENS. On KeyboardInterrupt the workers are stopped and the folder is
    left resumable.
    """
    _check_arguments(source, workers, shard_tokens)
    identity = tokenizer_identity(tokenizer)
    manifest = _existing_manifest(folder, identity, source_info, shard_tokens)
    if manifest is not None and manifest["complete"]:
        return manifest
    written = manifest is not None
    if manifest is None:
        manifest = _new_manifest(identity, source_info, shard_tokens or DEFAULT_SHARD_TOKENS)
    else:
        _prepare_resume(folder, manifest)
    manifest.setdefault("shard_tokens", shard_tokens or DEFAULT_SHARD_TOKENS)
    progress = progress or Progress(enabled=False)
    progress.start(manifest["num_documents"], manifest["num_tokens"], len(manifest["shards"]))
    pool = TokenizerPool(source, tokenizer, workers, PREFETCH_GROUPS) if workers > 0 else None
    try:
        written = _write_shards(_one_pass(source, tokenizer, manifest["input"]["next_position"], pool), folder,
                                manifest, written, progress)
        if not written:  # a source empty from the start (sources raise for that themselves; this is the backstop)
            raise DataError(f"{source.description} holds no documents: nothing to tokenize")
        manifest["complete"] = True
        _write_manifest(folder, manifest)
    except OSError as exc:  # the sources raise DataError for what they cannot read: this is the output
        raise DataError(
            f"--output {folder!r}: cannot write {exc.filename or 'a file'!r} ({exc.strerror or first_line(exc)}); "
            "make room or choose a writable folder, then run the same command again to resume"
        ) from exc
    finally:
        if pool is not None:
            pool.close()
    progress.finish()
    return manifest


def _check_arguments(source: DocumentSource, workers: int, shard_tokens: int | None) -> None:
    if source.endless:
        raise DataError(f"{source.description} never ends: only a finite corpus can be tokenized into shards")
    if workers < 0:
        raise DataError(f"--workers must be 0 (tokenize in this process) or more, got {workers}")
    if shard_tokens is not None and shard_tokens < 1:
        raise DataError(f"--shard_tokens must be at least 1, got {shard_tokens}")


def _write_shards(
    documents: Iterator[tuple[int, np.ndarray]], folder: str, manifest: dict[str, Any], written: bool,
    progress: Progress,
) -> bool:
    """Stream `documents` into shards of the manifest's size, committing each; whether the folder now exists. The
    folder is made, with its manifest, only once there is something to write; a shard cut short is discarded."""
    dtype, vocab_size = np.dtype(manifest["dtype"]), manifest["tokenizer"]["vocab_size"]
    writer: _ShardWriter | None = None
    try:
        for position, tokens in documents:
            if writer is None:
                if not written:
                    os.makedirs(folder, exist_ok=True)
                    _write_manifest(folder, manifest)
                    written = True
                writer = _ShardWriter(folder, len(manifest["shards"]), dtype, vocab_size)
            writer.add(tokens)
            progress.update(1, len(tokens))
            if writer.num_tokens >= manifest["shard_tokens"]:
                _add_shard(folder, manifest, writer.commit(), position + 1)
                writer = None
                progress.shard()
        if writer is not None:
            _add_shard(folder, manifest, writer.commit(), position + 1)
            writer = None
            progress.shard()
    except BaseException:
        if writer is not None:
            writer.discard()
        raise
    return written


def _add_shard(folder: str, manifest: dict[str, Any], shard: dict[str, Any], next_position: int) -> None:
    """List a committed shard in the manifest, with the source position after its last document."""
    manifest["shards"].append(shard)
    manifest["num_tokens"] += shard["num_tokens"]
    manifest["num_documents"] += shard["num_documents"]
    manifest["input"]["next_position"] = int(next_position)
    _write_manifest(folder, manifest)


