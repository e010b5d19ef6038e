"""Helpers of the fault-tolerance end-to-end tests: a lighthouse, replica groups launched through run_train.sh
(each in its own session, so that a kill -9 takes its whole process tree), their metrics and their last weights."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import torch

from dtrain.checkpoint.dcp_io import read_full_weights
from tests.e2e.run_train_helpers import FP32, REPO, children, user_env

# A step of ~0.1 s on 2 cores: long runs stay cheap, and a kill lands between steps of a live run.
SHAPE = ["--training.dataset", "synthetic", "--model.tokenizer", "byte", "--training.seq_len", "32",
         "--training.local_batch_size", "2", "--metrics.log_freq", "1", *FP32]
# A group killed with -9 is dropped from the quorum after this long without a heartbeat.
HEARTBEAT_MS = 1000
# The bound of every launch: a group that hangs is killed by `timeout`, and the test fails on its exit code.
GROUP_TIMEOUT_S = 150


@contextlib.contextmanager
def lighthouse(min_replicas: int = 1, join_timeout_ms: int = 1000):
    """torchft's lighthouse in this process, on a free port; yields its address. A quorum waits up to
    `join_timeout_ms` for groups that heartbeat but have not asked for it yet."""
    # torchft's Rust logger reads RUST_LOG once, when torchft is first imported: its INFO line for every quorum
    # would flood a failure's report.
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                              heartbeat_timeout_ms=HEARTBEAT_MS)
    try:
        yield server.address()
    finally:
        server.shutdown()


class Group:
    """One replica group: one run_train.sh launch, its stderr kept in a file next to its dump folder."""

    def __init__(self, folder: Path, replica_id: int, address: str, *args: str, group_size: int = 2, nproc: int = 1):
        self.folder = folder
        self.stderr_path = folder.parent / f"{folder.name}.stderr.{time.monotonic_ns()}"
        folder.parent.mkdir(parents=True, exist_ok=True)
        command = ["timeout", "-s", "KILL", str(GROUP_TIMEOUT_S), "./run_train.sh", *SHAPE, *args,
                   "--fault_tolerance.enable", "--fault_tolerance.group_size", str(group_size),
                   "--fault_tolerance.replica_id", str(replica_id), "--job.dump_folder", str(folder)]
        # One OpenMP thread per process: spin-waiting threads of several groups on 2 cores slow steps 10-50x.
        env = user_env(TORCHFT_LIGHTHOUSE=address, OMP_NUM_THREADS="1", NPROC=str(nproc))
        with open(self.stderr_path, "w") as stderr:
            self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=stderr,
                                            start_new_session=True)
        self.killed = False

    def running(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """kill -9 of the whole group (launcher, torchrun and workers alike), as a lost machine would be."""
        if self.killed:  # once only: the group's id may name another process group by now
            return
        self.killed = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def preempt(self) -> None:
        """SIGTERM to the training process of a 1-process group (run_train.sh execs it under `timeout`), as a
        scheduler preempting the job sends it; once, since a second one ends the process at once."""
        for pid in children(self.process.pid):
            os.kill(pid, signal.SIGTERM)

    def finish(self, timeout: float = GROUP_TIMEOUT_S + 10) -> tuple[int, str]:
        """(exit code, stderr) once the group has ended; killed if it outlives `timeout`."""
        try:
            self.process.wait(timeout=timeout)
        finally:
            self.kill()  # also whatever the launcher left in its session
        return self.process.returncode, self.stderr()

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")


def finished_well(*groups: Group) -> list[str]:
    """Each group's stderr once it has ended, after asserting that each exited 0."""
    outcomes = [group.finish() for group in groups]
    for group, (code, stderr) in zip(groups, outcomes):
        assert code == 0, f"{group.folder.name}: {stderr[-3000:]}"
    return [stderr for _, stderr in outcomes]


@contextlib.contextmanager
def groups_ended(*groups: Group):
    """Kill every group still running at the end of the block (a failed assertion leaves nothing behind)."""
    started = list(groups)
    try:
        yield started
    finally:
        for group in started:
            group.kill()


def lose_one_of_two(folder: Path, address: str, started: list[Group], kill_after: int, *args: str,
                    nproc: int = 1) -> tuple[Group, Group]:
    """Groups 0 and 1 launched with `args` (added to `started`); group 1 killed with -9 once both are past step
    `kill_after`. Returns (survivor, victim)."""
    survivor, victim = (Group(folder / f"group{g}", g, address, *args, nproc=nproc) for g in (0, 1))
    started += [survivor, victim]
    wait_for(lambda: min(last_step(survivor.folder), last_step(victim.folder)) >= kill_after, 120,
             [survivor, victim], f"step {kill_after} in both groups")
    victim.kill()
    return survivor, victim


def read_metrics(folder: Path) -> list[dict]:
    """The complete records of a group's metrics.jsonl so far (a line being written is skipped)."""
    path = folder / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            records.append(json.loads(line))
    return records


def last_step(folder: Path) -> int:
    return max((record["step"] for record in read_metrics(folder)), default=0)


def wait_for(condition, seconds: float, groups: list[Group], what: str) -> None:
    """Poll `condition` until it holds; fail if `seconds` pass first or a group in `groups` ends meanwhile."""
    deadline = time.monotonic() + seconds
    while not condition():
        for group in groups:
            assert group.running(), f"{group.folder.name} ended while waiting for {what}: {group.stderr()[-2000:]}"
        assert time.monotonic() < deadline, f"no {what} within {seconds} s"
        time.sleep(0.05)


def last_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The weights of the newest checkpoint in a group's dump folder."""
    checkpoints = sorted((folder / "checkpoint").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    assert checkpoints, f"no checkpoint in {folder}"
    return read_full_weights(checkpoints[-1])


def assert_bitwise_equal(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == theirs.keys()
    differing = [key for key in ours if not torch.equal(ours[key], theirs[key])]
    assert not differing, f"weights differ: {differing[:5]}"
