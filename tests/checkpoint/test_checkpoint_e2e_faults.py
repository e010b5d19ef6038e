"""Faults around saving, end to end (CPU, fp32, one process): kill -9 right after an async save started, kill -9
in the middle of keep_latest_k's pruning, and the checkpoint folder turning read-only mid-run. The same command
then resumes from an intact committed checkpoint with the uninterrupted run's losses, or the run ends in dtrain's
one line with nothing half-written committed."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
from e2e_checkpoint_helpers import (
    CHECKPOINTED,
    REPO,
    kill_hard,
    losses_by_step,
    read_metrics,
    rerun_and_compare,
    run_train,
    user_env,
    wait_for,
)
from run_train_helpers import FP32

from dtrain.checkpoint.folders import COMMIT_FILE, read_record, scan_checkpoints

pytestmark = [pytest.mark.slow, pytest.mark.torch_independent]

ASYNC = [*CHECKPOINTED, *FP32, "--checkpoint.async_mode", "async"]
# Saves at steps 2, 4, 6 (and the final weights at 8); committing step-6 prunes step-2.
PRUNED = [*CHECKPOINTED, *FP32, "--checkpoint.keep_latest_k", "2"]

# dtrain.main with shutil.rmtree replaced: the first deletion of a committed checkpoint (keep_latest_k's pruning)
# removes the commit record and half the other files, the worst order rmtree could take, then kill -9s the process.
KILLED_WHILE_PRUNING = """
import os, runpy, shutil, signal, sys
from pathlib import Path

def rmtree_then_kill(path, *args, **kwargs):
    path = Path(path)
    if path.parent.name == "checkpoint" and path.is_dir() and not path.name.endswith(".partial"):
        files = sorted(path.iterdir(), key=lambda file: file.name != "dtrain_commit.json")
        for file in files[: len(files) // 2 + 1]:
            file.unlink()
        os.kill(os.getpid(), signal.SIGKILL)
    real_rmtree(path, *args, **kwargs)

real_rmtree, shutil.rmtree = shutil.rmtree, rmtree_then_kill
sys.argv = ["dtrain.main", *sys.argv[1:]]
runpy.run_module("dtrain.main", run_name="__main__")
"""


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    """The losses of a run never interrupted (async saving and keep_latest_k change none of them)."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    result = run_train(*CHECKPOINTED, *FP32, "--job.dump_folder", str(run_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    return losses_by_step(read_metrics(run_dir))


def test_kill_right_after_an_async_save_started_resumes_from_the_newest_committed(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    folder = run_dir / "checkpoint"
    process = subprocess.Popen(
        ["./run_train.sh", *ASYNC, "--job.dump_folder", str(run_dir)], cwd=REPO, env=user_env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    # The async save of step-4 has begun (its folder exists under the temporary name): kill -9 at once.
    wait_for(process, lambda: (folder / "step-4.partial").exists())
    kill_hard(process)
    committed = [c.step for c in scan_checkpoints(folder).committed]
    start, log = rerun_and_compare(run_dir, uninterrupted, ASYNC)
    assert start == max(committed)  # the newest committed one, never the interrupted save
    if 4 not in committed:  # the usual case: the background write had not been committed
        assert start == 2 and "step-4.partial" in log


def test_kill_during_pruning_leaves_nothing_that_is_loaded_or_stays(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    folder = run_dir / "checkpoint"
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_WHILE_PRUNING, *PRUNED, "--job.dump_folder", str(run_dir)], cwd=REPO,
        env=user_env(), capture_output=True, text=True, timeout=240,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not (folder / "step-2" / COMMIT_FILE).exists()  # killed with step-2 half deleted
    start, log = rerun_and_compare(run_dir, uninterrupted, PRUNED)
    assert start == 6
    # The half-deleted folder is never taken for a checkpoint (dtrain's or someone else's), nor kept.
    assert "removed" in log and re.search(r"step-2(?!\.deleting)\b", log) is None, log
    assert sorted(p.name for p in folder.iterdir()) == ["step-6", "step-8"]


def can_lose_write_access() -> str | None:
    """Why this process cannot run the trainer without the right to write into a read-only folder, or None.

    Root writes into a chmod 0555 folder regardless: as root the trainer runs without CAP_DAC_OVERRIDE and
    CAP_DAC_READ_SEARCH (setpriv), so the folder's mode binds it as it binds any user.
    """
    if os.geteuid() != 0:
        return None
    if shutil.which("setpriv") is None:
        return "running as root and setpriv (util-linux) is missing: chmod cannot take write access away from root"
    probe = subprocess.run([*WITHOUT_OVERRIDE, "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"running as root and setpriv cannot drop CAP_DAC_OVERRIDE here: {probe.stderr.strip()}"
    return None


WITHOUT_OVERRIDE = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]


def test_a_checkpoint_folder_turned_read_only_ends_the_run_in_one_line(tmp_path):
    reason = can_lose_write_access()
    if reason:
        pytest.skip(reason)
    run_dir = tmp_path / "run"
    folder = run_dir / "checkpoint"
    prefix = WITHOUT_OVERRIDE if os.geteuid() == 0 else []
    args = [*CHECKPOINTED, *FP32, "--training.steps", "400", "--checkpoint.interval", "3"]
    process = subprocess.Popen(
        [*prefix, "./run_train.sh", *args, "--job.dump_folder", str(run_dir)], cwd=REPO, env=user_env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        wait_for(process, lambda: (folder / "step-3" / COMMIT_FILE).exists())
        folder.chmod(0o555)
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=30)
        folder.chmod(0o755)
    assert process.returncode == 1, output[-3000:]
    last = output.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"error: checkpoint {re.escape(str(folder))}/step-\d+\.partial: \w+ failed, the checkpoint could not be "
        r"written \(permission denied: make the folder writable, or move job.dump_folder\); the folder is "
        r"removed on the next start",
        last,
    ), last
    # What was committed before stays, whole; nothing of the failed save was committed.
    (committed,) = scan_checkpoints(folder).committed
    assert committed.step == 3
    read_record(committed.path)
