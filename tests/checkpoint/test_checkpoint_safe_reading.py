"""No code runs from a checkpoint: hostile pickles in `.metadata` or in a non-tensor value are refused in one line
before they execute, while every real dtrain checkpoint still reads (metadata classes of both torch versions)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from dtrain.checkpoint import dcp_io
from dtrain.checkpoint.safe_reading import SafeFileSystemReader, SafeLoadPlanner, UnsafeCheckpoint, read_metadata_file


class Payload:
    """Unpickling this touches `marker`: what a hostile checkpoint would do with os.system instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def save_plain(path: Path, state: dict) -> None:
    dcp.save(state, checkpoint_id=str(path), no_dist=True)


def test_real_metadata_reads_and_loads(tmp_path):
    state = {"w": torch.arange(6.0).reshape(2, 3), "lr": 0.5, "betas": (0.9, 0.95), "pos": {"doc": 3}}
    save_plain(tmp_path / "ckpt", state)
    metadata = read_metadata_file(tmp_path / "ckpt" / ".metadata")
    assert set(metadata.state_dict_metadata) >= {"w", "lr"}
    loaded = {"w": torch.zeros(2, 3), "lr": 0.0, "betas": None, "pos": {"doc": 0}}
    dcp.load(loaded, storage_reader=SafeFileSystemReader(str(tmp_path / "ckpt")), planner=SafeLoadPlanner(),
             no_dist=True)
    assert torch.equal(loaded["w"], state["w"]) and loaded["lr"] == 0.5 and loaded["pos"] == {"doc": 3}
    assert tuple(loaded["betas"]) == (0.9, 0.95)


def test_a_hostile_metadata_pickle_does_not_run(tmp_path):
    save_plain(tmp_path / "ckpt", {"w": torch.ones(2)})
    marker = tmp_path / "pwned"
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(UnsafeCheckpoint, match=r"asks for pathlib.Path.touch|asks for .*Path.*touch"):
        read_metadata_file(tmp_path / "ckpt" / ".metadata")
    # DCP wraps the reader's error (torch 2.11 keeps only "metadata is None" of it), so dtrain's load reads the
    # metadata itself first: the one line the user sees is the refusal.
    with pytest.raises(CheckpointException):
        dcp.load({"w": torch.zeros(2)}, storage_reader=SafeFileSystemReader(str(tmp_path / "ckpt")), no_dist=True)
    with pytest.raises(UnsafeCheckpoint, match="which DCP metadata never holds"):
        dcp_io.load({"w": torch.zeros(2)}, tmp_path / "ckpt")
    assert not marker.exists()
    # The regression this guards against: torch's own reader runs the payload (then trips over its None result).
    with pytest.raises(AttributeError):
        FileSystemReader(str(tmp_path / "ckpt")).read_metadata()
    assert marker.exists()


def test_a_hostile_value_does_not_run(tmp_path):
    marker = tmp_path / "pwned"
    save_plain(tmp_path / "ckpt", {"w": torch.ones(2), "extra": Payload(marker)})
    assert not marker.exists()
    with pytest.raises(CheckpointException, match="checkpoint value extra is not plain data"):
        dcp.load({"w": torch.zeros(2), "extra": None}, storage_reader=SafeFileSystemReader(str(tmp_path / "ckpt")),
                 planner=SafeLoadPlanner(), no_dist=True)
    assert not marker.exists()
    with pytest.raises(UnsafeCheckpoint, match="checkpoint value extra is not plain data"):
        dcp_io.load({"w": torch.zeros(2), "extra": None}, tmp_path / "ckpt")
    assert not marker.exists()
    dcp.load({"w": torch.zeros(2), "extra": None}, checkpoint_id=str(tmp_path / "ckpt"),
             planner=DefaultLoadPlanner(), no_dist=True)
    assert marker.exists()


def test_metadata_that_is_not_dcp_metadata_is_refused(tmp_path):
    file = tmp_path / ".metadata"
    file.write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(UnsafeCheckpoint, match="holds a dict, not DCP metadata"):
        read_metadata_file(file)
    file.write_bytes(os.urandom(64))
    with pytest.raises(Exception, match="is not readable DCP metadata"):
        read_metadata_file(file)
