"""Document sources: where the text comes from, one document at a time, in a fixed order.

A source yields `(position, document)` pairs. A document is text to tokenize, or (synthetic data only) token ids
ready to pack. Positions are increasing integers that the source defines (a file index, a row index, ...);
`documents(start)` yields exactly the documents whose position is >= start, so the packer resumes a run by seeking
to a position instead of reading everything again. Every rank reads the same source in the same order.
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Union

import numpy as np

from dtrain.data.file_readers import FILE_STRIDE, SUPPORTED_SUFFIXES, read_file_documents
from dtrain.data.missing_path import missing
from dtrain.errors import DataError

Document = Union[str, Sequence[int], np.ndarray]
# The built-in corpus keeps one file in this many out of training, for validation (see BuiltinSource).
BUILTIN_HELD_OUT_EVERY = 20
SPLITS = ("train", "validation")


class DocumentSource(ABC):
    """An ordered, re-iterable collection of documents addressed by increasing positions."""

    description: str
    # True for a source that never runs out of documents (a pass over it never ends).
    endless: bool = False

    @abstractmethod
    def documents(self, start: int = 0) -> Iterator[tuple[int, Document]]:
        """Yield `(position, document)` for every document whose position is >= `start`, in position order."""


class BuiltinSource(DocumentSource):
    """The Python standard library's own `.py` files on this machine: a corpus that needs no download.

    Files are sorted by their path inside the stdlib folder; installed packages (site-packages) are left out so
    that the corpus depends only on the Python version. A file that cannot be read or is not UTF-8 is skipped.

    The corpus is split in two, whatever the run: about one file in BUILTIN_HELD_OUT_EVERY (those whose path's
    CRC-32 is a multiple of it, so a file's side depends on its path alone) is held out for validation
    (`split="validation"`), and training (`split="train"`) reads all the others, with validation on or off.
    The position of a document is its file's index in the sorted list of its split.
    """

    def __init__(self, root: str | None = None, split: str = "train"):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        self.root = root or sysconfig.get_paths()["stdlib"]
        self.split = split
        self.files = [f for f in _python_files(self.root) if _held_out(f, self.root) == (split == "validation")]
        part = "training part" if split == "train" else f"held-out part, 1 file in ~{BUILTIN_HELD_OUT_EVERY}"
        self.description = f"builtin corpus, {part} ({len(self.files)} .py files under {self.root})"
        if not self.files:
            raise DataError(f"training.dataset = 'builtin' found no .py files under {self.root!r}; use another dataset")

    def documents(self, start: int = 0) -> Iterator[tuple[int, Document]]:
        for index in range(start, len(self.files)):
            try:
                with open(self.files[index], "rb") as f:
                    yield index, f.read().decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue


def _held_out(path: str, root: str) -> bool:
    """Whether the built-in corpus keeps the file at `path` for validation (CRC-32 of its path under `root`)."""
    relative = os.path.relpath(path, root).replace(os.sep, "/")
    return zlib.crc32(relative.encode()) % BUILTIN_HELD_OUT_EVERY == 0


def _python_files(root: str) -> list[str]:
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [s for s in subfolders if s not in ("site-packages", "dist-packages", "__pycache__")]
        found.extend(os.path.join(folder, n) for n in names if n.endswith(".py"))
    # Sort by the path relative to root, with "/" separators, so the order is the same on every rank and OS.
    return sorted(found, key=lambda p: os.path.relpath(p, root).replace(os.sep, "/"))


class SyntheticSource(DocumentSource):
    """Endless seeded random documents of token ids: random lengths in [1, 2 * seq_len], ids in [0, vocab_size).

    Document i depends only on (seed, i), so seeking is free and any rank or resumed run sees the same data.
    For tests and benchmarks: it needs no tokenizer work and no files.
    """

    endless = True

    def __init__(self, seed: int, vocab_size: int, seq_len: int):
        self.seed, self.vocab_size, self.max_length = seed, vocab_size, 2 * seq_len
        self.description = f"synthetic documents (seed {seed}, vocab {vocab_size})"

    def documents(self, start: int = 0) -> Iterator[tuple[int, Document]]:
        index = start
        while True:
            rng = np.random.default_rng((self.seed, index))
            length = int(rng.integers(1, self.max_length + 1))
            yield index, rng.integers(0, self.vocab_size, size=length, dtype=np.int64)
            index += 1


class FilesSource(DocumentSource):
    """A file, or a folder searched recursively, of .txt (one document per file), .jsonl/.json (one JSON object
    per line, text in `text_field`) and .parquet files (text in column `text_field`), read in sorted path order.

    The position of row r of the i-th file is i * FILE_STRIDE + r, so seeking skips whole files unread.
    """

    def __init__(self, path: str, text_field: str):
        self.path, self.text_field = path, text_field
        self.files = _data_files(path)
        self.description = f"training.dataset_path {path!r}"

    def documents(self, start: int = 0) -> Iterator[tuple[int, Document]]:
        for index in range(start // FILE_STRIDE, len(self.files)):
            first_row = start - index * FILE_STRIDE if index == start // FILE_STRIDE else 0
            for row, text in read_file_documents(self.files[index], self.text_field, first_row):
                yield index * FILE_STRIDE + row, text


def _data_files(path: str) -> list[str]:
    valid = ", ".join(SUPPORTED_SUFFIXES)
    if not path:
        raise DataError("training.dataset = 'files' needs training.dataset_path (a file or folder of " + valid + ")")
    if os.path.isfile(path):
        if not path.endswith(SUPPORTED_SUFFIXES):
            raise DataError(f"training.dataset_path {path!r} is not a supported file; use one of {valid}")
        return [path]
    if not os.path.isdir(path):
        raise DataError(f"training.dataset_path {missing(path)}; give a file or folder of {valid}")
    found = []
    for folder, subfolders, names in os.walk(path):
        subfolders[:] = [s for s in subfolders if not s.startswith(".")]
        found.extend(os.path.join(folder, n) for n in names if n.endswith(SUPPORTED_SUFFIXES))
    if not found:
        raise DataError(f"training.dataset_path folder {path!r} holds no data files; expected {valid} files")
    return sorted(found, key=lambda p: os.path.relpath(p, path).replace(os.sep, "/"))
