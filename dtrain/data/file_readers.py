"""Readers for local data files: each yields `(row, text)` for the documents of one file, from a given row on.

Rows are the file's own coordinates (the line index of a JSON-lines file, the row of a Parquet table, 0 for a
.txt file), so a reader can seek to a row without parsing what comes before it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from dtrain.errors import DataError, first_line

SUPPORTED_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
# Positions of the files source are file_index * FILE_STRIDE + row: room for 2**32 rows per file.
FILE_STRIDE = 1 << 32


def read_file_documents(path: str, text_field: str, first_row: int = 0) -> Iterator[tuple[int, str]]:
    """The documents of one data file, by suffix; rows before `first_row` are skipped unparsed."""
    if path.endswith(".txt"):
        return _read_txt(path, first_row)
    if path.endswith((".jsonl", ".json")):
        return _read_json_lines(path, text_field, first_row)
    if path.endswith(".parquet"):
        return _read_parquet(path, text_field, first_row)
    raise DataError(f"data file {path!r} has an unsupported suffix; use one of {', '.join(SUPPORTED_SUFFIXES)}")


def _read_txt(path: str, first_row: int) -> Iterator[tuple[int, str]]:
    if first_row > 0:
        return
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as exc:
        raise DataError(f"data file {path!r} is not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    except OSError as exc:
        raise DataError(f"cannot read data file {path!r} ({exc.strerror})") from exc
    yield 0, text


def _text_of(record: object, text_field: str, where: str) -> str | None:
    if not isinstance(record, dict):
        raise DataError(f"{where} is not a JSON object; .json/.jsonl files hold one object per line")
    if text_field not in record:
        fields = ", ".join(sorted(record)) or "none"
        raise DataError(f"{where} has no field {text_field!r} (fields: {fields}); set training.dataset_text_field")
    text = record[text_field]
    if text is not None and not isinstance(text, str):
        raise DataError(f"{where} field {text_field!r} is {type(text).__name__}, not text")
    return text


def json_lines(path: str, first_row: int, label: str | None = None) -> Iterator[tuple[int, str, Any]]:
    """(row, where, object) of each non-empty line of a JSON-lines file from `first_row` on; `where` names the file
    (as `label`, default "data file '<path>'") and line for the reader's own errors. A line that is not JSON, or a
    file that cannot be read, is a DataError."""
    label = label or f"data file {path!r}"
    try:
        with open(path, "rb") as f:
            for row, line in enumerate(f):
                if row < first_row or not line.strip():
                    continue
                where = f"{label} line {row + 1}"
                try:
                    record = json.loads(line)
                except ValueError as exc:
                    raise DataError(
                        f"{where} is not valid JSON ({first_line(exc)}); .json/.jsonl files hold one object per line"
                    ) from None
                yield row, where, record
    except OSError as exc:
        raise DataError(f"cannot read {label} ({exc.strerror})") from exc


def _read_json_lines(path: str, text_field: str, first_row: int) -> Iterator[tuple[int, str]]:
    for row, where, record in json_lines(path, first_row):
        text = _text_of(record, text_field, where)
        if text is not None:  # a null text is a missing document, not an empty one
            yield row, text


def _read_parquet(path: str, text_field: str, first_row: int) -> Iterator[tuple[int, str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise DataError(f"reading {path!r} needs pyarrow: pip install 'dtrain[hf]'") from exc
    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError variants for unreadable files
        raise DataError(f"cannot read Parquet file {path!r} ({str(exc).splitlines()[0]})") from exc
    columns = parquet.schema_arrow.names
    if text_field not in columns:
        raise DataError(
            f"Parquet file {path!r} has no column {text_field!r} (columns: {', '.join(columns)}); "
            "set training.dataset_text_field"
        )
    # Skip whole row groups before first_row using the footer's row counts: nothing of them is read.
    metadata, row, group = parquet.metadata, 0, 0
    while group < metadata.num_row_groups and row + metadata.row_group(group).num_rows <= first_row:
        row += metadata.row_group(group).num_rows
        group += 1
    groups = list(range(group, metadata.num_row_groups))
    if not groups:
        return
    for batch in parquet.iter_batches(row_groups=groups, columns=[text_field]):
        for text in batch.column(0).to_pylist():
            if row >= first_row and text is not None:
                if not isinstance(text, str):
                    kind = type(text).__name__
                    raise DataError(f"Parquet file {path!r} column {text_field!r} holds {kind}, not text")
                yield row, text
            row += 1
