"""Hugging Face `datasets` read from a local path only: a `save_to_disk` folder, or data files streamed from disk.

This never reaches the network. A dataset on the Hub is fetched once with `scripts/download_hf_assets.py` (c4)
or `datasets` itself, saved locally, and pointed to with training.dataset_path. The position of a document is
its row index in the split read ("train", or "validation" for c4_validation); resuming skips rows without
tokenizing them.

torchtitan's three C4 names read one local copy of allenai/c4 (English), ./assets/datasets/c4 unless
training.dataset_path says otherwise: `c4` its train split, `c4_validation` its validation split, and `c4_test` the
first C4_TEST_DOCUMENTS documents of its train split (torchtitan ships those as tests/assets/c4_test; pointing
training.dataset_path at that folder reads it the same way).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from dtrain.data.missing_path import missing
from dtrain.data.sources import Document, DocumentSource
from dtrain.errors import DataError, first_line

C4_DEFAULT_PATH = "./assets/datasets/c4"
# torchtitan's c4_test is the first 2K documents of C4's train split (pytorch/torchtitan#512).
C4_TEST_DOCUMENTS = 2000
# The split each C4 name reads, and how many of its first documents (None: all of them).
C4_KINDS = {"c4": ("train", None), "c4_test": ("train", C4_TEST_DOCUMENTS), "c4_validation": ("validation", None)}
# Builders of `datasets` for single data files, by suffix.
FILE_BUILDERS = {
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".csv": "csv",
    ".txt": "text",
    ".json": "json",
    ".jsonl": "json",
    ".json.gz": "json",
    ".jsonl.gz": "json",
}


def _import_datasets(kind: str) -> Any:
    try:
        import datasets
    except ImportError as exc:
        raise DataError(f"training.dataset = {kind!r} needs the datasets package: pip install 'dtrain[hf]'") from exc
    return datasets


def c4_download_hint(kind: str, path: str) -> str:
    """The command that fetches what C4 name `kind` reads into `path`."""
    split_flag = " --split validation" if C4_KINDS[kind][0] == "validation" else ""
    return f"run `python scripts/download_hf_assets.py --dataset c4{split_flag} --num_shards 1 --local_dir {path}`"


class HFSource(DocumentSource):
    """Documents from the `text_field` column of a local Hugging Face dataset's train split (`kind` "hf"), or of
    the split and first documents that C4 name `kind` reads (C4_KINDS)."""

    def __init__(self, path: str, text_field: str, kind: str = "hf"):
        self.path, self.text_field, self.kind = path, text_field, kind
        self.split, self.max_documents = C4_KINDS.get(kind, ("train", None))
        if kind == "hf":
            self.description = f"Hugging Face dataset {path!r}"
        else:
            first = f"first {self.max_documents} documents of " if self.max_documents else ""
            self.description = f"{kind} ({first}C4's {self.split} split at {path!r})"
        if not path:
            raise DataError(
                "training.dataset = 'hf' needs training.dataset_path: a local save_to_disk folder, or data files"
            )
        if not os.path.exists(path):
            if kind in C4_KINDS:
                fetch = c4_download_hint(kind, path)
            else:
                fetch = "save one with datasets' save_to_disk, or fetch c4 with scripts/download_hf_assets.py"
            raise DataError(
                f"training.dataset_path {missing(path)}; datasets are read from local paths only: "
                f"{fetch}, or set training.dataset_path"
            )
        self._datasets = _import_datasets(kind)
        # load_from_disk datasets are memory-mapped and indexable: open them once. Streamed files reopen per epoch.
        self._saved = self._load_saved() if _is_saved_dataset(path) else None
        if self._saved is not None:
            self._check_columns(self._saved.column_names)

    def _load_saved(self) -> Any:
        try:
            loaded = self._datasets.load_from_disk(self.path)
        except Exception as exc:  # datasets raises FileNotFoundError, ValueError, ... for a damaged folder
            raise DataError(f"cannot load Hugging Face dataset {self.path!r} ({first_line(exc)})") from exc
        if isinstance(loaded, self._datasets.DatasetDict):
            if self.split not in loaded:
                raise DataError(
                    f"Hugging Face dataset {self.path!r} has no {self.split!r} split (splits: {', '.join(loaded)})"
                    + self._fetch_suffix()
                )
            loaded = loaded[self.split]
        return loaded

    def _check_columns(self, columns: list[str] | None) -> None:
        if columns is not None and self.text_field not in columns:
            raise DataError(
                f"Hugging Face dataset {self.path!r} has no column {self.text_field!r} "
                f"(columns: {', '.join(columns)}); set training.dataset_text_field"
            )

    def _stream(self) -> Any:
        """An IterableDataset over the local data files, read lazily from disk."""
        if os.path.isfile(self.path):
            builder = next((b for s, b in FILE_BUILDERS.items() if self.path.endswith(s)), None)
            if builder is None:
                raise DataError(
                    f"training.dataset_path {self.path!r} is not a data file datasets can read "
                    f"({', '.join(FILE_BUILDERS)})"
                )
            args, kwargs = (builder,), {"data_files": self.path}
        else:
            args, kwargs = (self.path,), {}
        try:
            return self._datasets.load_dataset(*args, split=self.split, streaming=True, **kwargs)
        except Exception as exc:  # no data files, unknown split, unreadable files, ...
            raise DataError(
                f"cannot load Hugging Face dataset {self.path!r} ({first_line(exc)})" + self._fetch_suffix()
            ) from exc

    def _fetch_suffix(self) -> str:
        """For a C4 name, how to fetch the split it reads (a folder may hold the train shards only)."""
        return f"; {c4_download_hint(self.kind, self.path)}" if self.kind in C4_KINDS else ""

    def documents(self, start: int = 0) -> Iterator[tuple[int, Document]]:
        limit = self.max_documents
        if limit is not None and start >= limit:
            return
        if self._saved is not None:
            if start >= len(self._saved):  # Dataset.skip rejects a start past the end
                return
            rows = self._saved.select_columns([self.text_field]).skip(start).iter(batch_size=256)
            texts = (text for batch in rows for text in batch[self.text_field])
        else:
            texts = self._stream_texts(start)
        for position, text in enumerate(texts, start=start):
            if limit is not None and position >= limit:
                return
            if text is not None:
                yield position, text

    def _stream_texts(self, start: int) -> Iterator[str | None]:
        stream = self._stream()
        self._check_columns(stream.column_names)
        for example in stream.skip(start):
            if self.text_field not in example:
                self._check_columns(list(example))
            yield example[self.text_field]


def _is_saved_dataset(path: str) -> bool:
    """Whether `path` is a folder written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk`."""
    return os.path.isfile(os.path.join(path, "dataset_dict.json")) or os.path.isfile(os.path.join(path, "state.json"))
