"""Checksums of every stored tensor chunk, taken as it is written and checked as it is read (docs/checkpointing.md,
"Checksums": why sizes are not enough, and what is refused).

Writing: `ChecksummingWriter` hashes the byte ranges each rank has just written (from the page cache, in the
background thread of an async save) into `__<rank>_checksums.json` before DCP's final barrier; `commit` moves them
into the record. Reading: `VerifyingReader` hashes each range before DCP decodes it, against the record, and raises
a one-line `ChecksumMismatch` naming file, range and tensor. xxh3-64: ~11 GB/s on one core, several times zlib's
crc32.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, BinaryIO

import xxhash
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner

from dtrain.checkpoint.safe_reading import SafeFileSystemReader
from dtrain.errors import DtrainError

ALGORITHM = "xxh3_64"
_SIDE_FILE_SUFFIX = "checksums.json"
_CHUNK = 16 * 1024 * 1024  # hash in pieces, so a multi-GB range never needs a second copy in memory


class ChecksumMismatch(DtrainError):
    """Bytes of a committed checkpoint differ from what was written."""


_DIGEST = re.compile(r"[0-9a-f]{16}")


def table_problem(checksums: Any, algorithm: Any, dcp: bool) -> str | None:
    """What is wrong with a commit record's `checksums` and `checksum_algorithm` values, or None if nothing is.

    A record dtrain commits always has both ({file: {byte offset: xxh3-64 hex digest}}, with .metadata's for a DCP
    checkpoint), so a missing or malformed one was edited, or written by a dtrain from before checksums."""
    if not checksums:
        return "has no 'checksums'"
    if algorithm != ALGORITHM:
        return f"has 'checksum_algorithm' {algorithm!r}, dtrain writes {ALGORITHM!r}"
    if not isinstance(checksums, dict):
        return f"has 'checksums' of type {type(checksums).__name__}, not a {{file: {{offset: digest}}}} table"
    for name, digests in checksums.items():
        if not isinstance(digests, dict) or not digests:
            return f"has 'checksums' entry {name!r} that is not a non-empty {{offset: digest}} table"
        for offset, digest in digests.items():
            if not str(offset).isdigit() or not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
                return f"has 'checksums' entry {name!r} {offset!r}: {digest!r}, not a byte offset and xxh3-64 digest"
    if dcp and ".metadata" not in checksums:
        return "has 'checksums' without '.metadata'"
    return None


def hash_range(file: BinaryIO, offset: int, length: int) -> str:
    """The xxh3-64 hex digest of `length` bytes of `file` from `offset`."""
    digest = xxhash.xxh3_64()
    file.seek(offset)
    remaining = length
    while remaining > 0:
        piece = file.read(min(_CHUNK, remaining))
        if not piece:
            break  # short file: the digest then differs, and the size check names the cause
        digest.update(piece)
        remaining -= len(piece)
    return digest.hexdigest()


def hash_file(path: Path) -> str:
    with open(path, "rb") as file:
        return hash_range(file, 0, path.stat().st_size)


class ChecksummingWriter(FileSystemWriter):
    """FileSystemWriter that records the checksum of every item this rank wrote in a file beside them."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Any:
        future = super().write_data(plan, planner)
        results = future.wait()  # FileSystemWriter has written every file before it returns the future
        folder = Path(self.path)
        ranges_by_file: dict[str, list[Any]] = {}
        for result in results:
            ranges_by_file.setdefault(str(result.storage_data.relative_path), []).append(result.storage_data)
        by_file: dict[str, dict[str, str]] = {}
        for name, ranges in ranges_by_file.items():
            with open(folder / name, "rb") as file:
                by_file[name] = {str(r.offset): hash_range(file, int(r.offset), int(r.length)) for r in ranges}
        side_file = folder / f"{plan.storage_data.prefix}{_SIDE_FILE_SUFFIX}"
        temporary = side_file.with_name(side_file.name + ".tmp")
        temporary.write_text(json.dumps(by_file, sort_keys=True))
        os.replace(temporary, side_file)
        return future


def collect_checksums(folder: Path, metadata: Metadata) -> dict[str, dict[str, str]]:
    """{file: {offset: digest}} of every storage item of the just-written checkpoint in `folder`, plus the
    metadata file's, gathered from the writers' side files (which are then removed). Raises ChecksumMismatch if
    an item has none, which means a writer other than ChecksummingWriter wrote it."""
    side_files = sorted(folder.glob(f"__*_{_SIDE_FILE_SUFFIX}"))
    checksums: dict[str, dict[str, str]] = {}
    for side_file in side_files:
        for name, items in json.loads(side_file.read_text()).items():
            checksums.setdefault(name, {}).update(items)
    for info in (metadata.storage_data or {}).values():
        if str(info.offset) not in checksums.get(str(info.relative_path), {}):
            raise ChecksumMismatch(
                f"{folder}/{info.relative_path} at byte {info.offset} was written without a checksum"
            )
    checksums[".metadata"] = {"0": hash_file(folder / ".metadata")}
    for side_file in side_files:
        side_file.unlink()
    return checksums


def check_metadata_file(folder: Path, checksums: dict[str, dict[str, str]]) -> None:
    expected = checksums.get(".metadata", {}).get("0")
    if expected is not None and hash_file(folder / ".metadata") != expected:
        raise ChecksumMismatch(f"{folder}/.metadata differs from what was committed (damaged after writing)")


class VerifyingReader(SafeFileSystemReader):
    """SafeFileSystemReader that checks every item it reads against `checksums` ({file: {offset: digest}}); an item
    without one is refused. `checksums` None reads a checkpoint from elsewhere (no commit record) unverified."""

    def __init__(self, path: str, checksums: dict[str, dict[str, str]] | None) -> None:
        super().__init__(path)
        self._checksums = checksums
        self._verified = 0

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
        self._verified = 0
        future = super().read_data(plan, planner)
        expected = 0 if self._checksums is None else len(plan.items)
        if self._verified < expected:
            # torch's reader no longer reads through _slice_file: refuse rather than load unverified.
            raise DtrainError(
                "this torch's FileSystemReader bypasses dtrain's checksum check (dtrain/checkpoint/checksums.py); "
                "report it with the torch version"
            )
        return future

    def _expected(self, info: Any) -> str | None:
        if self._checksums is None:
            return None
        return self._checksums.get(str(info.relative_path), {}).get(str(info.offset))

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        # The one place FileSystemReader.read_data turns a storage item into bytes (torch 2.11 to 2.13).
        if self._checksums is None:
            return super()._slice_file(file, sinfo)
        expected = self._expected(sinfo)
        offset, length = int(sinfo.offset), int(sinfo.length)
        if expected is None:
            # Every item dtrain wrote has one: an entry removed from the record must not skip the check.
            raise ChecksumMismatch(
                f"{Path(self.path) / str(sinfo.relative_path)} bytes {offset}..{offset + length} "
                f"({self._fqn(sinfo)}) have no checksum in the commit record: the record was edited"
            )
        if hash_range(file, offset, length) != expected:
            raise ChecksumMismatch(
                f"{Path(self.path) / str(sinfo.relative_path)} bytes {offset}..{offset + length} "
                f"({self._fqn(sinfo)}) differ from what was committed: the file was damaged after it was written"
            )
        self._verified += 1
        return super()._slice_file(file, sinfo)

    def _fqn(self, sinfo: Any) -> str:
        return next((index.fqn for index, info in self.storage_data.items() if info is sinfo), "unknown item")
