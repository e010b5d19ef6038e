"""A rank that stops making progress (SIGSTOP, a hang) ends the run within comm.train_timeout_seconds, and the
launcher's last line names it, not the peer that timed out waiting for it nor "killed by SIGKILL"."""

from __future__ import annotations

import os
import signal
import time

import pytest
from run_train_helpers import alive, children, start_two_process_run, worker_rank

from dtrain.config.schema import Comm
from dtrain.reliability.launcher import COLLECTIVE_TIMEOUT, StallWatch, summary
from dtrain.run.train import timed_out

TIMEOUT_S = 5

# torchrun's log when rank 1 (PID 12) was still running 30 s after the SIGTERM that ended rank 0's failed attempt.
HUNG_REPORT = """W1126 01:10:00 api.py:1047] Unable to shutdown process 12 via 15, forcefully exiting via 9
Failures:
[1]:
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 12)  (SIGKILL)
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 11)
"""


def watch_knowing(tmp_path, ranks: dict[int, str]) -> StallWatch:
    watch = StallWatch(torchrun=1, error_dir=tmp_path / "errors")
    watch.ranks = ranks
    return watch


def test_the_trainers_timeout_line_is_what_the_launcher_recognises():
    assert COLLECTIVE_TIMEOUT in str(timed_out(Comm(), RuntimeError("Timed out waiting 5000ms")))


def test_a_hung_rank_torchrun_had_to_kill_is_named_as_stalled_not_as_killed(tmp_path):
    errors, report = tmp_path / "errors", tmp_path / "torchrun.log"
    errors.mkdir()
    report.write_text(HUNG_REPORT)
    timeout_line = f"error: {timed_out(Comm(), RuntimeError('Timed out waiting'))}"
    (errors / "rank0").write_text(f"10.0\nfailed\n{timeout_line}\n")
    line = summary(errors, report, None, 2, None, watch_knowing(tmp_path, {12: "1", 11: "0"}))
    assert line.startswith(
        "error: rank 1 stopped making progress (it was still running 30 s after torchrun's SIGTERM; ended with "
        "SIGKILL), and rank 0 gave up waiting for it: a collective timed out"
    ), line
    # When rank 0 failed on its own, rank 1 being slow to leave is no cause: rank 0's line is the run's.
    (errors / "rank0").write_text("10.0\nfailed\nerror: a bad batch\n")
    line = summary(errors, report, None, 2, None, watch_knowing(tmp_path, {12: "1", 11: "0"}))
    assert line.startswith("error: a bad batch (rank 0 failed first"), line


@pytest.mark.slow
def test_a_stopped_rank_ends_the_run_in_one_line_naming_it(tmp_path):
    run_dir = tmp_path / "run"
    process = start_two_process_run(run_dir, 1000, "--comm.train_timeout_seconds", str(TIMEOUT_S))
    (torchrun,) = children(process.pid)
    workers = children(torchrun)
    try:
        (rank1,) = [pid for pid in workers if worker_rank(pid) == "1"]
        os.kill(rank1, signal.SIGSTOP)  # acts on nothing but SIGKILL and SIGCONT from now on
        stopped = time.monotonic()
        _, stderr = process.communicate(timeout=60)
        # torchrun alone would wait 30 s after its SIGTERM before killing the stopped rank.
        assert time.monotonic() - stopped < TIMEOUT_S + 15
        assert process.returncode != 0
        last = stderr.strip().splitlines()[-1]
        assert last.startswith(
            "error: rank 1 stopped making progress (its process was stopped by a signal such as SIGSTOP; ended with "
            f"SIGKILL), and rank 0 gave up waiting for it: {COLLECTIVE_TIMEOUT}"
        ), last
        assert f"comm.train_timeout_seconds = {TIMEOUT_S}" in last and f"{run_dir}/torchrun-" in last
        assert not any(alive(pid) for pid in [torchrun, *workers])
    finally:
        for pid in [torchrun, *workers]:  # a stopped worker ignores all but SIGKILL: leave nothing behind
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=30)
