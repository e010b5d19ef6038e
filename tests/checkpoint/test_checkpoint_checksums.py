"""Checksums: every stored item's is committed with the checkpoint and checked as it is read, so bytes changed in
place after a save are refused in one line (or fallen back from) instead of training on garbage."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from checkpoint_helpers import make_cfg, manager_for, tiny_state, train

from dtrain.checkpoint import dcp_io
from dtrain.checkpoint.checksums import ChecksumMismatch
from dtrain.checkpoint.folders import COMMIT_FILE, CommitRecord, DamagedCheckpoint, commit, read_record
from dtrain.errors import DtrainError


@pytest.fixture(params=["disabled", "async"])
def saved(request, tmp_path):
    """A run folder with full checkpoints at steps 2 and 4, saved synchronously or in the background."""
    cfg = make_cfg(tmp_path / "saved", steps=10, async_mode=request.param)
    state = tiny_state(cfg)
    manager = manager_for(cfg, state)
    train(state, manager, 4, cfg)
    manager.close()
    return cfg


def folder(cfg, step: int) -> Path:
    return Path(cfg.job.dump_folder) / "checkpoint" / f"step-{step}"


def restore(cfg):
    state = tiny_state(cfg)
    return manager_for(cfg, state).restore_at_startup(), state


def stored_range(path: Path, fqn: str) -> tuple[Path, int, int]:
    """(file, offset, length) of the item of `fqn` in the checkpoint at `path`."""
    storage = dcp_io.read_metadata(path).storage_data
    info = next(info for index, info in storage.items() if index.fqn == fqn)
    return path / info.relative_path, int(info.offset), int(info.length)


def flip_byte(file: Path, position: int) -> None:
    data = bytearray(file.read_bytes())
    data[position] ^= 0x01
    file.write_bytes(bytes(data))


def flip_weight(path: Path, fqn: str = "model.output.weight") -> Path:
    """Change one bit of the last value of `fqn`'s stored bytes (a float of the tensor, not its header)."""
    file, offset, length = stored_range(path, fqn)
    flip_byte(file, offset + length - 100)
    return file


def test_every_stored_item_and_the_metadata_have_a_committed_checksum(saved):
    path = folder(saved, 4)
    record = read_record(path)
    assert record.checksum_algorithm == "xxh3_64"
    for info in dcp_io.read_metadata(path).storage_data.values():
        assert len(record.checksums[str(info.relative_path)][str(info.offset)]) == 16
    assert ".metadata" in record.checksums
    assert not list(path.glob("*checksums.json*"))  # the writers' side files were folded into the record


def test_a_changed_weight_byte_is_refused_naming_file_and_tensor_and_can_be_fallen_back_from(saved, caplog):
    file = flip_weight(folder(saved, 4))
    with pytest.raises(DtrainError) as err:
        restore(saved)
    line = str(err.value)
    assert "\n" not in line and "cannot load checkpoint" in line
    assert f"{file} bytes" in line and "(model.output.weight)" in line and "damaged after it was written" in line
    saved.checkpoint.fallback_to_previous = True
    with caplog.at_level(logging.WARNING, logger="dtrain"):
        startup, state = restore(saved)
    assert startup.step == 2 and state.step == 2 and "falling back" in caplog.text


def edit_record(path: Path, edit) -> None:
    record = json.loads((path / COMMIT_FILE).read_text())
    edit(record)
    (path / COMMIT_FILE).write_text(json.dumps(record))


@pytest.mark.parametrize("edit, problem", [
    (lambda r: r.pop("checksums"), "has no 'checksums'"),
    (lambda r: r.update(checksums={}), "has no 'checksums'"),
    (lambda r: r.pop("checksum_algorithm"), "has 'checksum_algorithm' '', dtrain writes 'xxh3_64'"),
    (lambda r: r.update(checksums=["x"]), "has 'checksums' of type list"),
    (lambda r: r["checksums"].update({".metadata": "0"}), "has 'checksums' entry '.metadata' that is not"),
    (lambda r: r["checksums"].update({".metadata": {"0": "xyz"}}), "has 'checksums' entry '.metadata' '0': 'xyz'"),
    (lambda r: r["checksums"].pop(".metadata"), "has 'checksums' without '.metadata'"),
])
def test_a_commit_record_without_well_formed_checksums_is_refused_naming_file_and_key(saved, edit, problem):
    """Deleting or spoiling the checksums of a record must not switch the check off (issue 29, item 9)."""
    path = folder(saved, 4)
    flip_weight(path)
    edit_record(path, edit)
    with pytest.raises(DamagedCheckpoint) as err:
        read_record(path)
    assert str(err.value).startswith(f"{path / COMMIT_FILE} {problem}") and "\n" not in str(err.value)
    with pytest.raises(DtrainError) as err:
        restore(saved)
    assert f"{path / COMMIT_FILE} {problem}" in str(err.value) and "always verified" in str(err.value)


def test_an_item_whose_checksum_entry_was_deleted_is_refused_as_it_is_read(saved):
    path = folder(saved, 4)
    file = flip_weight(path)
    edit_record(path, lambda r: r["checksums"].pop(file.name))
    with pytest.raises(ChecksumMismatch, match="have no checksum in the commit record"):
        dcp_io.read_whole_state(path)


def test_a_checkpoint_from_elsewhere_loads_unverified_with_one_warning_line(saved, tmp_path, caplog):
    """No commit record: another tool's checkpoint (here dtrain's with its record removed) loads, and says so."""
    path = folder(saved, 4)
    (path / COMMIT_FILE).unlink()
    cfg = make_cfg(tmp_path / "new", steps=10, initial_load_path=str(path), initial_load_model_only=True)
    with caplog.at_level(logging.WARNING, logger="dtrain"):
        startup, _ = restore(cfg)
    warnings = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert startup.rule == "initial_load"
    assert warnings == [f"checkpoint: {path} has no {COMMIT_FILE}: a checkpoint from elsewhere, read without checksums"]


def test_changed_metadata_bytes_mark_the_checkpoint_damaged(saved):
    path = folder(saved, 4)
    flip_byte(path / ".metadata", (path / ".metadata").stat().st_size // 2)
    with pytest.raises(DamagedCheckpoint, match=r"\.metadata differs from what was committed"):
        read_record(path)
    saved.checkpoint.fallback_to_previous = True
    startup, _ = restore(saved)
    assert startup.step == 2


def test_whole_state_reads_for_conversion_are_verified_too(saved):
    path = folder(saved, 4)
    assert "model" in dcp_io.read_whole_state(path)
    flip_weight(path)
    with pytest.raises(ChecksumMismatch, match="model.output.weight"):
        dcp_io.read_whole_state(path)


def test_a_folder_written_without_checksums_is_not_committed(tmp_path):
    partial = tmp_path / "step-1.partial"
    dcp.save({"w": torch.ones(4)}, checkpoint_id=str(partial), no_dist=True)
    with pytest.raises(DamagedCheckpoint, match="written without a checksum"):
        commit(partial, tmp_path / "step-1", CommitRecord(step=1, kind="full"))
    assert not (tmp_path / "step-1").exists()
