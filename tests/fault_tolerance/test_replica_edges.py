"""Replica groups at their edges: a late launch under a live group's id, groups that start one after the other, a
lost lighthouse (a group whose peers never come: test_replica_join_wait.py). Each event is one line in the logs, no
traceback."""

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fault_tolerance.replica_harness import (
    HEARTBEAT_MS,
    Group,
    assert_bitwise_equal,
    finished_well,
    groups_ended,
    last_step,
    last_weights,
    lighthouse,
    read_metrics,
    wait_for,
)

# What torchft and dtrain do at these edges, not torch: CI runs them under the default torch only.
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.torch_independent]
LIGHTHOUSE = Path(sys.executable).parent / "torchft_lighthouse"  # the wheel's own server, as users start it


def last_line(stderr: str) -> str:
    return stderr.strip().splitlines()[-1]


def test_groups_started_apart_wait_for_each_other_and_a_late_launch_under_a_live_id_is_the_only_one_refused(
    tmp_path,
):
    # Steps enough to outlast a late launch's start; the groups are stopped (preempted) once it was refused.
    args = ["--training.steps", "1000", "--fault_tolerance.join_timeout_seconds", "30"]
    with lighthouse() as address, groups_ended() as started:
        started.append(Group(tmp_path / "group1", 1, address, *args))
        wait_for(lambda: "discarded (waiting" in started[0].stderr(), 60, started, "group 1 waiting")
        started.append(Group(tmp_path / "group0", 0, address, *args))
        wait_for(lambda: min(last_step(g.folder) for g in started) >= 5, 90, started, "step 5 in both groups")
        late = Group(tmp_path / "late0", 0, address, *args)
        code, stderr = late.finish(timeout=90)
        assert code != 0 and last_line(stderr).startswith(
            "error: fault_tolerance.replica_id 0 is used by 2 replica groups at once"), stderr[-2000:]
        refused_at = max(last_step(g.folder) for g in started)
        wait_for(lambda: min(last_step(g.folder) for g in started) > refused_at + 3, 60, started, "steps after it")
        for group in started:
            group.preempt()
        logs = finished_well(*started)
    for group, log in zip(started, logs):
        records = read_metrics(group.folder)
        # Step 1 waited for both groups: no step of the job was trained on half its batch because one came first.
        assert records[0]["step"] == 1 and records[0]["ft/participating_groups"] == 2
        assert "a second launch with replica_id 0 joined at step" in log and "Traceback" not in log, log[-3000:]
    assert "step 1 done after" in logs[0]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def start_lighthouse(port: int) -> subprocess.Popen:
    server = subprocess.Popen([str(LIGHTHOUSE), "--bind", f"[::]:{port}", "--min_replicas", "1",
                               "--join_timeout_ms", "1000", "--heartbeat_timeout_ms", str(HEARTBEAT_MS)],
                              stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("localhost", port), timeout=1).close()
            return server
        except OSError:
            assert time.monotonic() < deadline and server.poll() is None, "the lighthouse did not start"
            time.sleep(0.1)


@pytest.fixture
def lighthouse_process():
    """A lighthouse process on a fixed free port, `start`ed and killed at will; none left behind."""
    servers = []

    class Lighthouse:
        port = free_port()
        address = f"http://localhost:{port}"

        def start(self) -> None:
            servers.append(start_lighthouse(self.port))

        def kill(self) -> None:
            servers[-1].kill()
            servers[-1].wait(timeout=10)

    yield Lighthouse()
    for server in servers:
        server.kill()
        server.wait(timeout=10)


# Reading a checkpoint in this one process, outside any process group, is what DCP warns about.
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_lost_lighthouse_ends_the_groups_after_they_saved_and_a_relaunch_resumes_them(tmp_path, lighthouse_process):
    quorum_timeout = 4
    steps = 30
    args = ["--training.steps", str(steps), "--checkpoint.enable", "--checkpoint.interval", "1000",
            "--fault_tolerance.quorum_timeout_seconds", str(quorum_timeout), "--fault_tolerance.join_timeout_seconds",
            "3"]
    lighthouse_process.start()
    with groups_ended() as started:
        started += [Group(tmp_path / f"group{g}", g, lighthouse_process.address, *args) for g in (0, 1)]
        wait_for(lambda: min(last_step(g.folder) for g in started) >= 5, 90, started, "step 5 in both groups")
        lighthouse_process.kill()
        lost = time.monotonic()
        outcomes = [group.finish(timeout=60) for group in started]
        took = time.monotonic() - lost
    saved = []
    for group, (code, stderr) in zip(started, outcomes):
        line = last_line(stderr)
        assert code != 0 and line.startswith("error: the replica groups' quorum failed") and (
            f"within {quorum_timeout} s (fault_tolerance.quorum_timeout_seconds)" in line), stderr[-2000:]
        assert "this group saved step" in line and "Traceback" not in stderr, stderr[-2000:]
        saved.append(last_step(group.folder))
        assert (group.folder / "checkpoint" / f"step-{saved[-1]}").is_dir()
    assert saved[0] == saved[1] and took < quorum_timeout + 20, (saved, took)

    lighthouse_process.start()
    with groups_ended() as started:
        started += [Group(tmp_path / f"group{g}", g, lighthouse_process.address, *args) for g in (0, 1)]
        finished_well(*started)
    for group in started:
        resumed = [r for r in read_metrics(group.folder) if r["step"] > saved[0]]
        assert resumed[0]["step"] == saved[0] + 1 and resumed[-1]["step"] == steps
        assert all(r["ft/participating_groups"] == 2 for r in resumed)
    assert_bitwise_equal(last_weights(tmp_path / "group0"), last_weights(tmp_path / "group1"))
