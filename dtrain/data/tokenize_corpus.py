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
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

import numpy as np

from dtrain.data.file_readers import SUPPORTED_SUFFIXES
from dtrain.data.packing import tokenized_passes
from dtrain.data.sources import BuiltinSource, Document, DocumentSource, FilesSource
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
INPUT_KINDS = ("auto", "files", "hf", "builtin")
# Files that mark a folder as a Hugging Face dataset (save_to_disk) rather than a folder of data files.
HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
# Single files that only `datasets` reads (FilesSource reads SUPPORTED_SUFFIXES).
HF_FILE_SUFFIXES = (".arrow", ".csv", ".json.gz", ".jsonl.gz")
# Position i * SOURCE_STRIDE + p of several inputs is position p of input i: room for any position of one input.
SOURCE_STRIDE = 1 << 64
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


class ConcatSource(DocumentSource):
    """Several sources read one after the other: position `i * SOURCE_STRIDE + p` is position `p` of source `i`, so
    `documents(start)` seeks inside the source it lands in and skips the ones before it unread."""

    def __init__(self, sources: Sequence[DocumentSource]):
        self.sources = list(sources)
        self.description = f"{len(self.sources)} inputs ({'; '.join(s.description for s in self.sources)})"

    def documents(self, start: int = 0) -> Iterator[tuple[int, Document]]:
        first = start // SOURCE_STRIDE
        for index in range(first, len(self.sources)):
            inner = start - index * SOURCE_STRIDE if index == first else 0
            for position, document in self.sources[index].documents(inner):
                yield index * SOURCE_STRIDE + position, document


def _input_kind(path: str, kind: str) -> str:
    """The kind of one `--input` path: `kind` itself unless it is auto."""
    if kind not in INPUT_KINDS:
        raise DataError(f"--kind {kind!r} is not one of {', '.join(INPUT_KINDS)}")
    if kind == "builtin" or (kind == "auto" and path == "builtin"):
        if path != "builtin":
            raise DataError(f"--kind builtin reads the built-in corpus: give --input builtin, not {path!r}")
        return "builtin"
    if not os.path.exists(path):
        raise DataError(
            f"--input {path!r} does not exist; give a file or folder of {', '.join(SUPPORTED_SUFFIXES)} files, a "
            "local Hugging Face dataset (a save_to_disk folder), or builtin"
        )
    if kind != "auto":
        return kind
    if os.path.isdir(path) and any(os.path.isfile(os.path.join(path, m)) for m in HF_MARKERS):
        return "hf"
    return "hf" if os.path.isfile(path) and path.endswith(HF_FILE_SUFFIXES) else "files"


def _open_one(path: str, kind: str, text_field: str) -> DocumentSource:
    if kind == "builtin":
        return BuiltinSource()
    if kind == "hf":
        from dtrain.data.hf_source import HFSource

        return HFSource(path, text_field, "hf")
    return FilesSource(path, text_field)


def open_input(
    paths: str | Sequence[str], kind: str = "auto", text_field: str = "text"
) -> tuple[DocumentSource, dict[str, Any]]:
    """The document source of `--input` and what the manifest records of it (a resumed run must match it).

    One path reads as its kind's source, with that source's positions. Several paths (all of one kind) are read one
    after the other (ConcatSource); the manifest's `input.path` is then the list of them. `builtin` stands alone.
    """
    paths = [paths] if isinstance(paths, str) else list(paths)
    if not paths:
        raise DataError("--input needs a path: a file or folder of data files, a local Hugging Face dataset or builtin")
    kinds = [_input_kind(path, kind) for path in paths]
    if len(paths) > 1 and "builtin" in kinds:
        raise DataError("--input builtin is a corpus of its own: give it alone, without other paths")
    if len(set(kinds)) > 1:
        shown = ", ".join(f"{path!r} is {k}" for path, k in zip(paths, kinds))
        raise DataError(f"--input paths must be of one kind ({shown}); tokenize each kind into its own folder")
    sources = [_open_one(path, k, text_field) for path, k in zip(paths, kinds)]
    where: str | list[str] = [os.path.abspath(path) for path in paths]
    if kinds[0] == "builtin":
        where = "builtin"
    elif len(paths) == 1:
        where = where[0]
    source = sources[0] if len(sources) == 1 else ConcatSource(sources)
    return source, {"path": where, "kind": kinds[0], "text_field": None if kinds[0] == "builtin" else text_field}


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
    if source.endless:
        raise DataError(f"{source.description} never ends: only a finite corpus can be tokenized into shards")
    if workers < 0:
        raise DataError(f"--workers must be 0 (tokenize in this process) or more, got {workers}")
    if shard_tokens is not None and shard_tokens < 1:
        raise DataError(f"--shard_tokens must be at least 1, got {shard_tokens}")
    identity = tokenizer_identity(tokenizer)
    manifest = _existing_manifest(folder, identity, source_info, shard_tokens)
    if manifest is not None and manifest["complete"]:
        return manifest
    written = manifest is not None
    if manifest is None:
        manifest = _new_manifest(identity, source_info, shard_tokens or DEFAULT_SHARD_TOKENS)
    else:
        _prepare_resume(folder, manifest)
    shard_size = manifest.setdefault("shard_tokens", shard_tokens or DEFAULT_SHARD_TOKENS)
    progress = progress or Progress(enabled=False)
    progress.start(manifest["num_documents"], manifest["num_tokens"], len(manifest["shards"]))
    dtype = np.dtype(manifest["dtype"])
    pool = TokenizerPool(source, tokenizer, workers, PREFETCH_GROUPS) if workers > 0 else None
    writer: _ShardWriter | None = None
    try:
        for position, tokens in _one_pass(source, tokenizer, manifest["input"]["next_position"], pool):
            if writer is None:
                if not written:  # the folder is made, with its manifest, only once there is something to write
                    os.makedirs(folder, exist_ok=True)
                    _write_manifest(folder, manifest)
                    written = True
                writer = _ShardWriter(folder, len(manifest["shards"]), dtype, identity["vocab_size"])
            writer.add(tokens)
            progress.update(1, len(tokens))
            if writer.num_tokens >= shard_size:
                _add_shard(folder, manifest, writer.commit(), position + 1)
                writer = None
                progress.shard()
        if writer is not None:
            _add_shard(folder, manifest, writer.commit(), position + 1)
            writer = None
            progress.shard()
        if not written:  # a source empty from the start (sources raise for that themselves; this is the backstop)
            raise DataError(f"{source.description} holds no documents: nothing to tokenize")
        manifest["complete"] = True
        _write_manifest(folder, manifest)
    except BaseException as exc:
        if writer is not None:
            writer.discard()
        if isinstance(exc, OSError):  # the sources raise DataError for what they cannot read: this is the output
            raise DataError(
                f"--output {folder!r}: cannot write {exc.filename or 'a file'!r} ({exc.strerror or first_line(exc)}); "
                "make room or choose a writable folder, then run the same command again to resume"
            ) from exc
        raise
    finally:
        if pool is not None:
            pool.close()
    progress.finish()
    return manifest


def _add_shard(folder: str, manifest: dict[str, Any], shard: dict[str, Any], next_position: int) -> None:
    """List a committed shard in the manifest, with the source position after its last document."""
    manifest["shards"].append(shard)
    manifest["num_tokens"] += shard["num_tokens"]
    manifest["num_documents"] += shard["num_documents"]
    manifest["input"]["next_position"] = int(next_position)
    _write_manifest(folder, manifest)


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
