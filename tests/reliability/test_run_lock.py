"""One live run per run folder: the lock names its holder, refuses a second live run in one line, and takes over
the lock of a run that died."""

from __future__ import annotations

import json
import logging
import subprocess

import pytest

from dtrain.reliability.run_lock import LOCK_FILE, RunFolderInUse, RunLock, locked_run_folder


def dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def write_lock(folder, pid: int, host: str) -> None:
    (folder / LOCK_FILE).write_text(json.dumps({"pid": pid, "host": host, "started": "2026-01-01T00:00:00+00:00"}))


def test_the_lock_names_its_holder_and_is_released(tmp_path):
    with RunLock(tmp_path) as lock:
        recorded = json.loads((tmp_path / LOCK_FILE).read_text())
        assert recorded["pid"] == lock.holder.pid and recorded["host"] == lock.holder.host
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_second_live_run_is_refused_in_one_line(tmp_path):
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        write_lock(tmp_path, sleeper.pid, RunLock(tmp_path).holder.host)
        with pytest.raises(RunFolderInUse, match=rf"run folder {tmp_path} is in use by pid {sleeper.pid} on .*stop it"):
            RunLock(tmp_path).acquire()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == sleeper.pid  # refused, and left as it was


def test_a_lock_on_another_host_is_refused_with_how_to_clear_it(tmp_path):
    write_lock(tmp_path, 1, "some-other-node")
    with pytest.raises(RunFolderInUse, match=f"if that run has ended, delete {tmp_path / LOCK_FILE}"):
        RunLock(tmp_path).acquire()


@pytest.mark.parametrize("content", ["dead", "torn"])
def test_a_dead_runs_lock_is_taken_over_with_a_log_line(tmp_path, caplog, content):
    if content == "dead":
        write_lock(tmp_path, dead_pid(), RunLock(tmp_path).holder.host)
    else:
        (tmp_path / LOCK_FILE).write_text('{"pid": 12')
    with caplog.at_level(logging.WARNING), RunLock(tmp_path) as lock:
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == lock.holder.pid
    assert "taking over the lock of a run that is gone" in caplog.text


@pytest.mark.parametrize(
    "held_by, ours, taken_over",
    [
        ((7, 0, 0), (7, 1, 0), True),  # requeued after a node failure: the first incarnation's allocation has ended
        ((7, 1, 2), (7, 1, 3), True),  # torchrun restarted the workers, rank 0 now on another node
        ((7, 1, 0), (7, 0, 5), False),  # a lower requeue count is not an earlier incarnation, whatever the restarts
        ((7, 1, 0), (7, 1, 0), False),  # the same incarnation on two hosts: not ours to judge
        ((7, 0, 0), (8, 1, 0), False),  # another job
        (("", 0, 0), (7, 1, 0), False),  # a lock written outside SLURM
    ],
)
def test_a_lock_left_by_an_earlier_incarnation_of_this_slurm_job_is_taken_over(
    tmp_path, monkeypatch, caplog, held_by, ours, taken_over
):
    job, requeues, restarts = held_by
    (tmp_path / LOCK_FILE).write_text(json.dumps({
        "pid": 1, "host": "some-other-node", "started": "2026-01-01T00:00:00+00:00", "slurm_job": str(job),
        "slurm_restart": requeues, "elastic_restart": restarts,
    }))
    for name, value in zip(("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"), ours):
        monkeypatch.setenv(name, str(value))
    if taken_over:
        with caplog.at_level(logging.WARNING), RunLock(tmp_path) as lock:
            assert lock.holder.slurm_job == "7"
            assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == lock.holder.pid
        assert f"SLURM job 7 (requeue {requeues}, worker restart {restarts})" in caplog.text
    else:
        with pytest.raises(RunFolderInUse, match="in use by pid 1 on some-other-node"):
            RunLock(tmp_path).acquire()


def test_release_never_removes_another_runs_lock(tmp_path):
    lock = RunLock(tmp_path)
    lock.acquire()
    write_lock(tmp_path, 1, "some-other-node")  # e.g. an operator cleared ours and another run took the folder
    lock.release()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["host"] == "some-other-node"


def test_a_run_that_fails_before_writing_leaves_no_folder_but_keeps_one_it_found(tmp_path):
    new = tmp_path / "new"
    with pytest.raises(RuntimeError), locked_run_folder(new, rank=0, distributed=False):
        raise RuntimeError("bad data")
    assert not new.exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    with pytest.raises(RuntimeError), locked_run_folder(existing, rank=0, distributed=False):
        raise RuntimeError("bad data")
    assert existing.is_dir() and list(existing.iterdir()) == []
    with locked_run_folder(new, rank=0, distributed=False) as folder:
        (folder / "metrics.jsonl").write_text("{}")
    assert (new / "metrics.jsonl").exists()  # a folder the run wrote into stays
