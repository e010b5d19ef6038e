"""The checkpoint folder on disk: names, the commit record, scanning, verification, atomic commit and retention.

    <job.dump_folder>/<checkpoint.folder>/
        step-40/                 committed: the DCP files (.metadata, __<rank>_<n>.distcp) and dtrain_commit.json
        step-50.partial/         being written, or left behind by a crash: never loaded, reported at start-up
        step-20.deleting/        being deleted by keep_latest_k (renamed first): never loaded, removed later

A checkpoint is written under `step-N.partial`, verified (the DCP metadata reads back and every file it refers to
is there and long enough), given its commit record, and only then renamed to `step-N`. A rename within one folder
is atomic, so a `step-N` folder with a record is a whole checkpoint; the record lists every file's size, so a
checkpoint truncated later is recognised before anything is loaded from it, and a checksum of every stored item
(checksums.py), so bytes changed in place are recognised as they are read.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from dtrain.checkpoint.checksums import (
    ALGORITHM,
    ChecksumMismatch,
    check_metadata_file,
    collect_checksums,
    hash_file,
    table_problem,
)
from dtrain.checkpoint.safe_reading import read_metadata_file
from dtrain.reliability.durable import fsync_path

COMMIT_FILE = "dtrain_commit.json"
PARTIAL_SUFFIX = ".partial"
REPLACED_SUFFIX = ".replaced"
# A committed checkpoint is renamed to this before keep_latest_k deletes it: a deletion cut short (kill -9) leaves a
# leftover, never a `step-N` without its record that could be anybody's checkpoint.
DELETING_SUFFIX = ".deleting"
# The kind of a final save written as Hugging Face safetensors with config.json (checkpoint.last_save_in_hf).
HF_KIND = "hf"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_LEFTOVER_DIR = re.compile(
    rf"^step-(\d+)({re.escape(PARTIAL_SUFFIX)}|{re.escape(REPLACED_SUFFIX)}|{re.escape(DELETING_SUFFIX)})$"
)


class DamagedCheckpoint(Exception):
    """A committed checkpoint whose files no longer match its commit record (truncated, missing, unreadable)."""


@dataclass(frozen=True)
class CommitRecord:
    """What a committed checkpoint holds and how it was written; stored as dtrain_commit.json in its folder.

    `kind` is "full" (the whole TrainState), "model_only" (weights only, in `dtype`) or "hf" (weights only, as
    Hugging Face safetensors with config.json; `files` and `checksums` then cover whole files). `data` describes
    the data position's meaning (global batch, seq_len, dataset) so a resume can tell whether it carries over exactly.
    """

    step: int
    kind: str
    tokens_seen: int = 0
    seed: int | None = None
    dtype: str = "float32"
    world_size: int = 1
    parallelism: dict = field(default_factory=dict)
    data: dict = field(default_factory=dict)
    files: dict = field(default_factory=dict)
    saved_at: str = ""
    torch_version: str = ""
    # Whether the head shared the embedding's weight; None where not recorded (older and converted checkpoints).
    tie_word_embeddings: bool | None = None
    # optimizer.name of the run that saved a full state; "" where not recorded (older and model-only checkpoints).
    optimizer: str = ""
    # How the optimizer grouped the parameters (dtrain.step.optimizer.param_grouping: "all" or "no_decay_on_vectors") in a full
    # state; "" where not recorded (model-only, and full ones from before the grouping was an option).
    optimizer_grouping: str = ""
    # {file: {byte offset: digest}} of every stored item and of .metadata (checksums.py); empty in older records.
    checksums: dict = field(default_factory=dict)
    checksum_algorithm: str = ""
    # The model it holds: {"name", "flavor", "args": every resolved arg} (config_checks.model_record), so that a resume
    # can refuse another model; empty in older records and where the saver had no model args.
    model: dict = field(default_factory=dict)
    # A LoRA run's [lora] settings and the reference to the frozen base its adapter-only checkpoints leave out
    # (lora_base.lora_record); empty for a run without LoRA and in older records.
    lora: dict = field(default_factory=dict)

    @property
    def model_only(self) -> bool:
        return self.kind in ("model_only", HF_KIND)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> CommitRecord:
        raw = json.loads(text)
        known = {name: raw[name] for name in CommitRecord.__dataclass_fields__ if name in raw}
        return CommitRecord(**known)


@dataclass(frozen=True)
class Committed:
    """A `step-N` folder that carries a commit record (not yet verified against its files)."""

    step: int
    path: Path


@dataclass(frozen=True)
class FolderScan:
    """The checkpoints of one folder: committed ones oldest first, and leftovers that are never loaded."""

    committed: list[Committed]
    incomplete: list[Path]

    def describe_incomplete(self) -> str:
        return ", ".join(p.name for p in self.incomplete)


def step_dir(folder: Path, step: int) -> Path:
    return folder / f"step-{step}"


def partial_dir(folder: Path, step: int) -> Path:
    return folder / f"step-{step}{PARTIAL_SUFFIX}"


def scan_checkpoints(folder: Path) -> FolderScan:
    """Committed checkpoints (a `step-N` folder with a commit record) and incomplete leftovers in `folder`."""
    committed, incomplete = [], []
    if folder.is_dir():
        for entry in folder.iterdir():
            if not entry.is_dir():
                continue
            match = _STEP_DIR.match(entry.name)
            if match and (entry / COMMIT_FILE).is_file():
                committed.append(Committed(int(match.group(1)), entry))
            elif match or _LEFTOVER_DIR.match(entry.name):
                incomplete.append(entry)
    committed.sort(key=lambda c: c.step)
    incomplete.sort(key=lambda p: p.name)
    return FolderScan(committed, incomplete)


def is_leftover(path: Path) -> bool:
    """Whether `path` is a `step-N.partial` (a save that never committed), `step-N.replaced` (an older copy being
    replaced) or `step-N.deleting` (a checkpoint being pruned) folder: never loaded, whatever files it holds."""
    return bool(_LEFTOVER_DIR.match(path.name))


def is_dcp_checkpoint(path: Path) -> bool:
    return (path / ".metadata").is_file()


def _read_metadata(path: Path):
    try:
        return read_metadata_file(path / ".metadata")
    except Exception as err:  # a torn, unreadable or refused .metadata: the message is what matters
        raise DamagedCheckpoint(f"{path}/.metadata cannot be read ({type(err).__name__}: {err})") from err


def written_files(path: Path) -> tuple[dict[str, int], dict[str, dict[str, str]]]:
    """Check a just-written DCP folder: ({file name: size} of every file in it but the record, the checksums).

    The metadata must read back, every storage file it refers to must hold the bytes it points at, and every
    stored item must have the checksum its writer took (the writers' side files are folded into the result).
    """
    metadata = _read_metadata(path)
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = str(info.relative_path)
        needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    try:
        checksums = collect_checksums(path, metadata)
    except ChecksumMismatch as err:
        raise DamagedCheckpoint(str(err)) from None
    sizes = {p.name: p.stat().st_size for p in path.iterdir() if p.is_file() and p.name != COMMIT_FILE}
    for name, length in sorted(needed.items()):
        if sizes.get(name, -1) < length:
            raise DamagedCheckpoint(f"{path}/{name} holds {sizes.get(name, 0)} bytes where {length} were written")
    return sizes, checksums


def read_record(path: Path) -> CommitRecord:
    """The commit record of the checkpoint at `path`, checked against the files present (DamagedCheckpoint if not)."""
    try:
        record = CommitRecord.from_json((path / COMMIT_FILE).read_text())
    except (OSError, ValueError, TypeError) as err:
        raise DamagedCheckpoint(f"{path}/{COMMIT_FILE} cannot be read ({err})") from err
    problem = table_problem(record.checksums, record.checksum_algorithm, dcp=record.kind != HF_KIND)
    if problem is not None:
        # Every record dtrain commits carries its checksums (since 08813d4); one without was edited or predates them.
        raise DamagedCheckpoint(
            f"{path}/{COMMIT_FILE} {problem}: a dtrain checkpoint is always verified, so it is refused (save it "
            f"again, or delete {COMMIT_FILE} to load it as a checkpoint from elsewhere, unverified)"
        )
    if record.kind == HF_KIND and set(record.checksums) != set(record.files):
        raise DamagedCheckpoint(f"{path}/{COMMIT_FILE} has 'checksums' that do not cover exactly its 'files'")
    for name, size in sorted(record.files.items()):
        file = path / name
        actual = file.stat().st_size if file.is_file() else None
        if actual != size:
            found = "is missing" if actual is None else f"has {actual} bytes"
            raise DamagedCheckpoint(f"{file} {found}; {size} were committed")
    if is_dcp_checkpoint(path):
        try:
            check_metadata_file(path, record.checksums)
        except ChecksumMismatch as err:
            raise DamagedCheckpoint(str(err)) from None
        _read_metadata(path)
    elif record.kind == HF_KIND:
        # safetensors files are read without a verifying reader, so each whole file is checked here.
        for name, digests in sorted(record.checksums.items()):
            if hash_file(path / name) != digests.get("0"):
                raise DamagedCheckpoint(f"{path / name} differs from what was committed (damaged after writing)")
    return record


def whole_files(path: Path) -> tuple[dict[str, int], dict[str, dict[str, str]]]:
    """({file name: size}, {file name: {"0": checksum}}) of every file in a just-written Hugging Face export."""
    files = sorted(p for p in path.iterdir() if p.is_file() and p.name != COMMIT_FILE)
    return {p.name: p.stat().st_size for p in files}, {p.name: {"0": hash_file(p)} for p in files}


def write_record(path: Path, record: CommitRecord) -> None:
    """Write the commit record into `path` via a temporary file, so a torn record is never seen."""
    temporary = path / f"{COMMIT_FILE}.tmp"
    temporary.write_text(record.to_json())
    fsync_path(temporary)
    os.replace(temporary, path / COMMIT_FILE)
    fsync_path(path)


def commit(partial: Path, final: Path, record: CommitRecord) -> CommitRecord:
    """Verify the DCP files in `partial` (or checksum a Hugging Face export's), record them, and rename the folder
    to `final` (replacing an older one)."""
    sizes, checksums = whole_files(partial) if record.kind == HF_KIND else written_files(partial)
    record = replace(record, files=sizes, checksums=checksums, checksum_algorithm=ALGORITHM)
    write_record(partial, record)
    replaced = None
    if final.exists():
        # A checkpoint of the same step from an abandoned timeline (resume from an earlier load_step): keep it
        # until the new one is in place, so that some checkpoint of this step always exists.
        replaced = final.with_name(final.name + REPLACED_SUFFIX)
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(final, replaced)
    os.replace(partial, final)
    fsync_path(final.parent)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    return record


def prune(folder: Path, keep_latest_k: int, keep: Path) -> list[Path]:
    """Delete committed checkpoints beyond the newest `keep_latest_k` (0 keeps all), each renamed to
    `step-N.deleting` first, and our own leftovers (`.partial`, `.replaced`, `.deleting`) of steps before the newest
    committed one.

    `keep` (the checkpoint just committed) is never deleted, whatever its step. A `step-N` folder without a record
    may be something the user put there (say, a torchtitan checkpoint), so it is reported, never deleted.
    Returns the deleted folders.
    """
    scan = scan_checkpoints(folder)
    removed: list[Path] = []
    doomed: list[Path] = []  # what is deleted: a pruned checkpoint under its `.deleting` name
    if keep_latest_k > 0:
        others = [c for c in scan.committed if c.path != keep]
        for old in others[: max(len(others) - (keep_latest_k - 1), 0)]:
            deleting = old.path.with_name(old.path.name + DELETING_SUFFIX)
            try:
                os.replace(old.path, deleting)
            except OSError:  # left for the next pruning: retention never fails a save
                continue
            removed.append(old.path)
            doomed.append(deleting)
    newest = max((c.step for c in scan.committed), default=-1)
    for leftover in scan.incomplete:
        match = _LEFTOVER_DIR.match(leftover.name)
        if match and int(match.group(1)) < newest:
            removed.append(leftover)
            doomed.append(leftover)
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def remove_partials(folder: Path) -> list[Path]:
    """Delete the `step-N.partial` folders in `folder` (saves that never committed: a crash, a full disk) and the
    `step-N.deleting` ones (a pruning cut short).

    Called once a run is accepted, so that they neither fill the disk nor stand in a later save's way; never a
    `.replaced` folder (it may hold the only copy of a committed step) nor anything without our suffix.
    """
    suffixes = (PARTIAL_SUFFIX, DELETING_SUFFIX)
    partials = [p for p in scan_checkpoints(folder).incomplete if p.name.endswith(suffixes)]
    for path in partials:
        shutil.rmtree(path, ignore_errors=True)
    return partials
