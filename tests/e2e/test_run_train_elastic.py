"""Multi-process runs at scale: MAX_RESTARTS restarts failed workers, which resume from the last checkpoint and
train exactly as an uninterrupted run would (also with torchao's 8-bit optimizer states, DTensors of quantized
tensors under FSDP2); a single-node run listens on no interface but loopback."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest
from run_train_helpers import FP32, children, read_metrics, start_two_process_run

def losses_by_step(run_dir: Path) -> dict[int, tuple[float, float]]:
    """The loss and learning rate of every step, the last record winning (steps run again after a restart are
    logged again)."""
    return {record["step"]: (record["loss"], record["lr"]) for record in read_metrics(run_dir)}


def rank_of(pid: int) -> int:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(e for e in environ if e.startswith(b"RANK="))[len("RANK="):])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_killed_worker_is_restarted_and_the_run_matches_an_uninterrupted_one(tmp_path):
    # torchao's 8-bit AdamW, whose states are DTensors of quantized tensors, is the harder case of the restart;
    # plain AdamW's exact resume is proven in process (tests/checkpoint) and by the kill tests.
    steps = 16
    args = [*FP32, "--optimizer.name", "AdamW8bit"]
    reference = start_two_process_run(tmp_path / "reference", 2, *args, steps=steps)
    _, stderr = reference.communicate(timeout=240)
    assert reference.returncode == 0, stderr[-2000:]

    run_dir = tmp_path / "restarted"
    process = start_two_process_run(run_dir, 2, *args, steps=steps, MAX_RESTARTS="1")
    deadline = time.monotonic() + 120
    while len(read_metrics(run_dir)) < 5:  # past a checkpoint, so that the restart resumes from one
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    (torchrun,) = children(process.pid)
    (victim,) = [pid for pid in children(torchrun) if rank_of(pid) == 1]
    os.kill(victim, signal.SIGKILL)
    _, stderr = process.communicate(timeout=240)
    assert process.returncode == 0, stderr[-3000:]
    assert "checkpoint: resuming from" in stderr  # the restarted workers resumed, not started over
    restarted, uninterrupted = losses_by_step(run_dir), losses_by_step(tmp_path / "reference")
    assert sorted(restarted) == list(range(1, steps + 1))
    assert restarted == uninterrupted  # bit for bit


def listening_addresses(pids: list[int]) -> list[str]:
    """The local addresses of the TCP sockets the processes `pids` listen on (from /proc, as `ss -ltnp` does)."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            target = os.readlink(fd) if fd.is_symlink() else ""
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    addresses = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                host = bytes.fromhex(fields[1].split(":")[0])
                # /proc prints each 32-bit word of the address in host (little-endian) order.
                host = b"".join(host[i:i + 4][::-1] for i in range(0, len(host), 4))
                addresses.append(socket.inet_ntop(family, host))
    return addresses


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_single_node_run_listens_on_loopback_only(tmp_path):
    process = start_two_process_run(tmp_path / "run", 1000)
    try:
        (torchrun,) = children(process.pid)
        addresses = listening_addresses([process.pid, torchrun, *children(torchrun)])
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=120)
    assert addresses, "gloo listens for its peers, so something must be found"
    assert set(addresses) <= {"127.0.0.1", "::1"}, addresses
