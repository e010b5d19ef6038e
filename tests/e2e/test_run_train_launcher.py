"""Several processes end like one: run_train.sh's last line is the first failing rank's one-line error (torchrun's
failure report goes to a file in the run folder), or names the rank a signal killed; a preemption signal ends the
launch with exit 0, and kill -9 of the launcher or of torchrun takes every process of the run down."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from run_train_helpers import (
    REPO,
    TINY,
    alive,
    children,
    run_train,
    start_two_process_run,
    user_env,
    worker_rank,
)

from dtrain.reliability.launcher import filter_output, killed_ranks, outcomes, summary

DIVERGING = [*TINY, "--optimizer.lr", "1e4", "--lr_scheduler.warmup_steps", "0", "--model.args.n_layers", "1"]


def test_a_failing_multi_process_run_ends_with_the_ranks_one_line(tmp_path):
    run_dir = tmp_path / "run"
    result = run_train(*DIVERGING, "--job.dump_folder", str(run_dir), NPROC="2")
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: training diverged at step ") and "failed first; torchrun's report: " in last
    report = last.rsplit("torchrun's report: ", 1)[1].rstrip(")")
    assert report.startswith(f"{run_dir}/torchrun-") and "ChildFailedError" in open(report).read()
    assert "ChildFailedError" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_sigterm_to_the_launcher_saves_and_exits_zero(tmp_path):
    run_dir = tmp_path / "run"
    process = start_two_process_run(run_dir, checkpoint_interval=1000)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        "stopped on SIGTERM: every worker exited cleanly (rerun the same command to resume)"
    )
    assert any(p.name.startswith("step-") for p in (run_dir / "checkpoint").iterdir())


def test_the_summary_names_the_first_failure_or_torchruns_last_line(tmp_path):
    errors, report = tmp_path / "errors", tmp_path / "torchrun.log"
    errors.mkdir()
    with open(report, "w") as kept, open(tmp_path / "console", "w") as out:
        filter_output(kept, ["W123 banner\n", "[rank0]:hello\n", "SignalException: got signal 15\n"], out)
    assert (tmp_path / "console").read_text() == "[rank0]:hello\n"
    assert summary(errors, report, None, 2, None) == (
        f"error: torchrun failed before any worker reported an error: SignalException: got signal 15 "
        f"(its report: {report})"
    )
    (errors / "rank1").write_text("20.0\nfailed\nerror: late\n")
    (errors / "rank0").write_text("10.0\nfailed\nerror: first\n")
    assert [o[1] for o in outcomes(errors)] == ["0", "1"]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    line = summary(errors, report, run_dir, 2, None)
    assert line.startswith("error: first (rank 0 failed first; torchrun's report: ") and str(run_dir) in line
    for rank in (0, 1):
        (errors / f"rank{rank}").write_text("1.0\nok\nfinished\n")
    assert summary(errors, report, None, 2, "SIGTERM") is None  # a preemption, not a failure
    assert summary(errors, report, None, 3, "SIGTERM").startswith("error: torchrun failed")  # a worker is missing


# torchrun's failure report (ChildFailedError) for a kill -9 of rank 1 that rank 0 then failed on.
REPORT = """Failures:
[1]:
  time      : 2026-11-25_22:00:01
  host      : node
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 11)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
[2]:
  rank      : 2 (local_rank: 2)
  exitcode  : -6 (pid: 13) (SIGABRT)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-25_22:00:01
  host      : node
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 12) (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 12
"""


def test_a_rank_killed_by_a_signal_comes_before_the_errors_of_the_survivors(tmp_path):
    errors, report = tmp_path / "errors", tmp_path / "torchrun.log"
    errors.mkdir()
    report.write_text(REPORT)
    (errors / "rank0").write_text("10.0\nfailed\nRuntimeError: Connection reset by peer\n")
    assert killed_ranks(report) == [("1", "SIGKILL")]  # SIGABRT: NCCL's watchdog ends survivors with it
    line = summary(errors, report, None, 2, None)
    assert line == f"error: rank 1 was killed by SIGKILL (torchrun's report: {report})"
    (errors / "rank1").write_text("9.0\nfailed\nerror: its own line\n")  # it did report: its line counts
    assert summary(errors, report, None, 2, None).startswith("error: its own line (rank 1 failed first")


@pytest.mark.slow
def test_workers_exit_when_torchrun_is_killed(tmp_path):
    run_dir = tmp_path / "run"
    process = start_two_process_run(run_dir, checkpoint_interval=2)
    (torchrun,) = children(process.pid)
    workers = children(torchrun)
    assert len(workers) == 2
    os.kill(torchrun, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while any(alive(w) for w in workers):
        assert time.monotonic() < deadline, "workers outlived torchrun"
        time.sleep(0.1)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode != 0 and "torchrun failed" in stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_kill_9_of_the_launcher_takes_the_whole_run_down(tmp_path):
    run_dir = tmp_path / "run"
    process = start_two_process_run(run_dir, checkpoint_interval=1000)
    launcher = process.pid  # run_train.sh execs the launcher: the script's own PID, as a user sees it
    (torchrun,) = children(launcher)
    workers = children(torchrun)
    assert len(workers) == 2
    with open(f"/proc/{launcher}/cmdline") as cmdline:
        launch_dir = cmdline.read().split("\0")[3]  # python -m dtrain.reliability.launcher LAUNCH_DIR ...
    process.kill()
    process.communicate(timeout=60)
    try:
        deadline = time.monotonic() + 10
        while any(alive(p) for p in [torchrun, *workers]):
            assert time.monotonic() < deadline, "torchrun or a worker outlived the launcher"
            time.sleep(0.1)
        while os.path.exists(launch_dir):  # the workers removed it on their way out (parent_watch.py)
            assert time.monotonic() < deadline, f"the killed launcher's launch folder {launch_dir} stayed behind"
            time.sleep(0.1)
    finally:
        for pid in [torchrun, *workers]:  # leave nothing behind, even when the test fails
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(launch_dir, ignore_errors=True)


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:  # a short-lived child (mktemp, setup_env.sh's checks) already gone
        return b""


@pytest.mark.slow
def test_kill_9_during_the_launch_check_ends_the_check_too(tmp_path):
    """run_train.sh validates the config in a child process before torchrun starts: killed in those seconds, the
    script takes the check with it (PR_SET_PDEATHSIG) instead of leaving it to finish on its own."""
    process = subprocess.Popen(["./run_train.sh", *TINY, "--job.dump_folder", str(tmp_path / "run")], cwd=REPO,
                               env=user_env(NPROC="2"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checks: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not checks:  # the shell's child running `python -m dtrain.main --launcher_check ...`
            assert process.poll() is None and time.monotonic() < deadline, "no launch check seen"
            checks = [c for c in children(process.pid) if b"--launcher_check" in cmdline(c)]
            time.sleep(0.02)
        process.kill()
        process.wait(timeout=10)
        deadline = time.monotonic() + 2
        while alive(checks[0]):
            assert time.monotonic() < deadline, "the launch check outlived run_train.sh"
            time.sleep(0.05)
    finally:
        if process.poll() is None:
            process.kill()
        for pid in checks:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_rank_killed_by_a_signal_is_named_not_the_survivor_it_broke(tmp_path):
    run_dir = tmp_path / "run"
    process = start_two_process_run(run_dir, checkpoint_interval=1000)
    (torchrun,) = children(process.pid)
    (rank1,) = [pid for pid in children(torchrun) if worker_rank(pid) == "1"]
    os.kill(rank1, signal.SIGKILL)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode != 0
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: rank 1 was killed by SIGKILL (torchrun's report: {run_dir}/torchrun-"), last
