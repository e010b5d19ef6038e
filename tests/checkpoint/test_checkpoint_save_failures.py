"""A failed save is one line saying the checkpoint could not be written, where, and that the disk is full when it
is, with the free bytes; its half-written folder is never committed. The disk is never really filled: the writer
raises what torch raises on a full disk, and the free space is what the test says it is."""

from __future__ import annotations

import errno
import os
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
from checkpoint_helpers import make_cfg, manager_for, tiny_state
from torch.distributed.checkpoint import FileSystemWriter

from dtrain.checkpoint.folders import scan_checkpoints
from dtrain.errors import DtrainError

# What torch's zip writer raised when the disk filled during a save (issue 29, item 3).
TORCH_FULL_DISK = "[enforce fail at inline_container.cc:672] . unexpected pos 4416 vs 4314"
Usage = namedtuple("Usage", "total used free")


def failing_save(tmp_path, monkeypatch, error: BaseException, free: int, total: int = 10**9):
    cfg = make_cfg(tmp_path / "run", steps=10)
    manager = manager_for(cfg, tiny_state(cfg))

    def write_data(self, plan, planner):
        (Path(self.path) / "__0_0.distcp").write_bytes(b"half")  # the half-written file a full disk leaves
        raise error

    monkeypatch.setattr(FileSystemWriter, "write_data", write_data)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(total, total - free, free))
    with pytest.raises(DtrainError) as err:
        manager.save(2)
    text = str(err.value)
    assert "\n" not in text
    folder = Path(cfg.job.dump_folder) / cfg.checkpoint.folder
    assert scan_checkpoints(folder).committed == [] and not (folder / "step-2").exists()
    return text, folder / "step-2.partial"


def test_torchs_writer_failure_on_a_full_disk_says_the_disk_is_full(tmp_path, monkeypatch):
    text, partial = failing_save(tmp_path, monkeypatch, RuntimeError(TORCH_FULL_DISK), free=0)
    assert text == (
        f"checkpoint {partial}: save failed, the checkpoint could not be written (the disk is full (0 bytes free on "
        "its file system): free some, lower checkpoint.keep_latest_k, or move job.dump_folder); the folder is "
        "removed on the next start"
    )


def test_torchs_writer_failure_with_space_left_quotes_it_and_the_free_bytes(tmp_path, monkeypatch):
    text, _ = failing_save(tmp_path, monkeypatch, RuntimeError(TORCH_FULL_DISK), free=5 * 10**8)
    assert "unexpected pos 4416 vs 4314; 500000000 bytes free on its file system" in text
    assert "disk is full" not in text


def test_enospc_anywhere_in_the_exception_chain_is_a_full_disk(tmp_path, monkeypatch):
    wrapped = RuntimeError("write failed")
    wrapped.__cause__ = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    text, _ = failing_save(tmp_path, monkeypatch, wrapped, free=4096)
    assert "(the disk is full (4096 bytes free on its file system)" in text
