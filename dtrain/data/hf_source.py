"""Hugging Face `datasets` read from a local path only: a `save_to_disk` folder, or data files streamed from disk.

This never reaches the network. A dataset on the Hub is fetched once with `scripts/download_hf_assets.py` (c4)
or `datasets` itself, saved locally, and pointed to with training.dataset_path. The position of a document is
its row index in the "train" split; resuming skips rows without tokenizing them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from dtrain.data.sources import Document, DocumentSource
from dtrain.errors import DataError

C4_DEFAULT_PATH = "./assets/datasets/c4"
SPLIT = "train"
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


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError as exc:
        raise DataError("training.dataset = 'hf' / 'c4' needs the datasets package: pip install 'dtrain[hf]'") from exc
    return datasets


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class HFSource(DocumentSource):
    """Documents from the `text_field` column of a local Hugging Face dataset's train split."""

    def __init__(self, path: str, text_field: str, kind: str = "hf"):
        self.path, self.text_field = path, text_field
        self.description = f"Hugging Face dataset {path!r}"
        if not path:
            raise DataError(
                "training.dataset = 'hf' needs training.dataset_path: a local save_to_disk folder, or data files"
            )
        if not os.path.exists(path):
            if kind == "c4":
                fetch = f"run `python scripts/download_hf_assets.py --dataset c4 --num_shards 1 --local_dir {path}`"
            else:
                fetch = "save one with datasets' save_to_disk, or fetch c4 with scripts/download_hf_assets.py"
            raise DataError(
                f"training.dataset_path {path!r} does not exist; datasets are read from local paths only: "
                f"{fetch}, or set training.dataset_path"
            )
        self._datasets = _import_datasets()
        # load_from_disk datasets are memory-mapped and indexable: open them once. Streamed files reopen per epoch.
        self._saved = self._load_saved() if _is_saved_dataset(path) else None
        if self._saved is not None:
            self._check_columns(self._saved.column_names)

    def _load_saved(self) -> Any:
        try:
            loaded = self._datasets.load_from_disk(self.path)
        except Exception as exc:  # datasets raises FileNotFoundError, ValueError, ... for a damaged folder
            raise DataError(f"cannot load Hugging Face dataset {self.path!r} ({_first_line(exc)})") from exc
        if isinstance(loaded, self._datasets.DatasetDict):
            if SPLIT not in loaded:
                raise DataError(
                    f"Hugging Face dataset {self.path!r} has no {SPLIT!r} split (splits: {', '.join(loaded)})"
                )
            loaded = loaded[SPLIT]
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
            return self._datasets.load_dataset(*args, split=SPLIT, streaming=True, **kwargs)
        except Exception as exc:  # no data files, unknown split, unreadable files, ...
            raise DataError(f"cannot load Hugging Face dataset {self.path!r} ({_first_line(exc)})") from exc

    def documents(self, start: int = 0) -> Iterator[tuple[int, Document]]:
        if self._saved is not None:
            if start >= len(self._saved):  # Dataset.skip rejects a start past the end
                return
            rows = self._saved.select_columns([self.text_field]).skip(start).iter(batch_size=256)
            texts = (text for batch in rows for text in batch[self.text_field])
        else:
            texts = self._stream_texts(start)
        for position, text in enumerate(texts, start=start):
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
