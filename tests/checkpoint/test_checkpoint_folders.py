"""The on-disk protocol: atomic commit with a verified record, scanning, damage detection and retention."""

from __future__ import annotations

import json

import pytest
import torch

from dtrain.checkpoint import dcp_io
from dtrain.checkpoint.folders import (
    COMMIT_FILE,
    CommitRecord,
    DamagedCheckpoint,
    commit,
    partial_dir,
    prune,
    read_record,
    scan_checkpoints,
    step_dir,
)


def write_checkpoint(folder, step, value=0.0, committed=True):
    partial = partial_dir(folder, step)
    dcp_io.save({"w": torch.full((64,), value), "step": step}, partial)
    if committed:
        commit(partial, step_dir(folder, step), CommitRecord(step=step, kind="full"))
    return step_dir(folder, step) if committed else partial


def test_commit_verifies_records_file_sizes_and_renames(tmp_path):
    path = write_checkpoint(tmp_path, 4)
    assert path.name == "step-4" and not partial_dir(tmp_path, 4).exists()
    record = read_record(path)
    assert record.step == 4 and record.kind == "full"
    assert ".metadata" in record.files and any(name.endswith(".distcp") for name in record.files)
    assert all((path / name).stat().st_size == size for name, size in record.files.items())


def test_scan_separates_committed_from_incomplete_folders(tmp_path):
    for step in (10, 2):
        write_checkpoint(tmp_path, step)
    write_checkpoint(tmp_path, 12, committed=False)  # a crash before the commit
    (tmp_path / "step-14").mkdir()  # no record: something else put it here
    (tmp_path / "notes").mkdir()
    scan = scan_checkpoints(tmp_path)
    assert [c.step for c in scan.committed] == [2, 10]
    assert scan.describe_incomplete() == "step-12.partial, step-14"
    assert scan_checkpoints(tmp_path / "absent").committed == []


def test_truncated_missing_or_unreadable_files_are_damage(tmp_path):
    path = write_checkpoint(tmp_path, 2)
    data = next(p for p in path.iterdir() if p.suffix == ".distcp")
    data.write_bytes(data.read_bytes()[:-7])
    with pytest.raises(DamagedCheckpoint, match=rf"{data.name} has \d+ bytes; \d+ were committed"):
        read_record(path)
    data.unlink()
    with pytest.raises(DamagedCheckpoint, match="is missing"):
        read_record(path)
    other = write_checkpoint(tmp_path, 4)
    (other / COMMIT_FILE).write_text("{not json")
    with pytest.raises(DamagedCheckpoint, match=f"{COMMIT_FILE} cannot be read"):
        read_record(other)


def test_commit_refuses_a_folder_whose_data_files_are_short(tmp_path):
    partial = write_checkpoint(tmp_path, 6, committed=False)
    data = next(p for p in partial.iterdir() if p.suffix == ".distcp")
    data.write_bytes(b"")
    with pytest.raises(DamagedCheckpoint, match="bytes where"):
        commit(partial, step_dir(tmp_path, 6), CommitRecord(step=6, kind="full"))
    assert not step_dir(tmp_path, 6).exists()


def test_commit_replaces_a_checkpoint_of_the_same_step(tmp_path):
    write_checkpoint(tmp_path, 4, value=1.0)
    path = write_checkpoint(tmp_path, 4, value=2.0)
    loaded = {"w": torch.zeros(64), "step": 0}
    dcp_io.load(loaded, path)
    assert torch.equal(loaded["w"], torch.full((64,), 2.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4"]


def test_prune_keeps_the_newest_k_and_never_the_one_just_written(tmp_path):
    for step in (2, 4, 6, 8):
        write_checkpoint(tmp_path, step)
    write_checkpoint(tmp_path, 5, committed=False)
    (tmp_path / "step-1").mkdir()
    removed = prune(tmp_path, keep_latest_k=2, keep=step_dir(tmp_path, 8))
    assert sorted(p.name for p in removed) == ["step-2", "step-4", "step-5.partial"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-6", "step-8"]
    # A checkpoint just written at an earlier step (a resume from an earlier load_step) survives keep_latest_k=1.
    write_checkpoint(tmp_path, 3)
    prune(tmp_path, keep_latest_k=1, keep=step_dir(tmp_path, 3))
    assert [c.step for c in scan_checkpoints(tmp_path).committed] == [3]
    assert prune(tmp_path, keep_latest_k=0, keep=step_dir(tmp_path, 3)) == []


def test_record_round_trips_and_ignores_unknown_fields():
    record = CommitRecord(step=3, kind="model_only", dtype="bfloat16", data={"global_batch": 8})
    raw = json.loads(record.to_json())
    raw["added_later"] = 1
    assert CommitRecord.from_json(json.dumps(raw)) == record
