"""Helpers for end-to-end checkpoint tests: start ./run_train.sh in the background, wait for a condition, kill it."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

# run_train and read_metrics are also what the tests use, so they import them from here.
from run_train_helpers import REPO, TINY, read_metrics, run_train, user_env

# TINY training with a checkpoint every 2 steps; the final save (step 8) holds the weights only.
CHECKPOINTED = [*TINY, "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.last_save_model_only"]


def start_train(*args: str) -> subprocess.Popen:
    """./run_train.sh in the background (one process: run_train.sh execs python, so the pid is the trainer's)."""
    return subprocess.Popen(
        ["./run_train.sh", *args], cwd=REPO, env=user_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for(process: subprocess.Popen, condition: Callable[[], bool], timeout: float = 240) -> None:
    """Poll `condition` every few milliseconds until it holds; fail if the process ends first or time runs out."""
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"training ended (rc {process.returncode}) first:\n{process.stdout.read()[-3000:]}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


def logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def kill_hard(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)


def losses_by_step(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records}


def resumed_step(log: str) -> int:
    """The step a run resumed from, as its start-up log line says (0 when it did not resume)."""
    match = re.search(r"checkpoint: resuming from \S+/step-(\d+) ", log)
    return int(match.group(1)) if match else 0


def last_run_records(run_dir: Path, start_step: int, steps: int = 8) -> list[dict]:
    """The records the last run appended to metrics.jsonl (appended across resumes): steps start_step+1..steps."""
    records = read_metrics(run_dir)
    return records[len(records) - (steps - start_step):]


def rerun_and_compare(
    run_dir: Path, uninterrupted: dict[int, float], args: list[str] = CHECKPOINTED
) -> tuple[int, str]:
    """Rerun the same command; every loss it logs equals the uninterrupted run's. Returns (resumed step, log)."""
    result = run_train(*args, "--job.dump_folder", str(run_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    start = resumed_step(result.stderr)
    resumed = last_run_records(run_dir, start)
    assert [r["step"] for r in resumed] == list(range(start + 1, 9))
    for record in resumed:
        assert record["loss"] == uninterrupted[record["step"]], record["step"]
    return start, result.stderr
