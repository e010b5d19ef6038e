"""The input of a corpus tokenization (scripts/tokenize_dataset.py's --input): one or several paths, each a file or
folder of data files, a local Hugging Face dataset or the built-in corpus, opened as one document source."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

from dtrain.data.file_readers import SUPPORTED_SUFFIXES
from dtrain.data.sources import BuiltinSource, Document, DocumentSource, FilesSource
from dtrain.errors import DataError

INPUT_KINDS = ("auto", "files", "hf", "builtin")
# Files that mark a folder as a Hugging Face dataset (save_to_disk) rather than a folder of data files.
HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
# Single files that only `datasets` reads (FilesSource reads SUPPORTED_SUFFIXES).
HF_FILE_SUFFIXES = (".arrow", ".csv", ".json.gz", ".jsonl.gz")
# Position i * SOURCE_STRIDE + p of several inputs is position p of input i: room for any position of one input.
SOURCE_STRIDE = 1 << 64


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
