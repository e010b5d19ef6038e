"""Losing every replica group at once is a whole-job restart: each group resumes from its own latest checkpoint
(they are the same state) and the job continues the curve of a run that was never interrupted."""

import os
import signal
import subprocess
import time

import pytest
from torchft.coordination import LighthouseServer

from tests.e2e.run_train_helpers import FP32, REPO, read_metrics, user_env

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
STEPS = 8
SHAPE = ["--training.steps", str(STEPS), "--training.dataset", "synthetic", "--model.tokenizer", "byte",
         "--training.seq_len", "32", "--training.local_batch_size", "2", "--metrics.log_freq", "1", *FP32,
         "--fault_tolerance.enable", "--fault_tolerance.group_size", "2", "--fault_tolerance.min_replica_size", "2"]


def start_groups(folder, lighthouse, *args):
    return [
        subprocess.Popen(
            ["timeout", "200", "./run_train.sh", *SHAPE, *args, "--fault_tolerance.replica_id", str(g),
             "--job.dump_folder", str(folder / f"group{g}")],
            cwd=REPO, env=user_env(TORCHFT_LIGHTHOUSE=lighthouse.address(), OMP_NUM_THREADS="1"), text=True,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        )
        for g in (0, 1)
    ]


def finish(groups):
    errors = [group.communicate(timeout=220)[1] for group in groups]
    for group, err in zip(groups, errors):
        assert group.returncode == 0, err[-2000:]


def steps_logged(folder, g):
    path = folder / f"group{g}" / "metrics.jsonl"
    return len(read_metrics(folder / f"group{g}")) if path.exists() else 0


def test_a_job_that_lost_every_group_resumes_from_the_checkpoints_exactly(tmp_path):
    # Both groups take part in every step (min_replicas 2), as in the reference run.
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=1000, heartbeat_timeout_ms=1000)
    groups = []
    try:
        finish(start_groups(tmp_path / "reference", lighthouse))
        checkpointed = ["--checkpoint.enable", "--checkpoint.interval", "3"]
        groups = start_groups(tmp_path / "killed", lighthouse, *checkpointed)
        deadline = time.monotonic() + 120
        while min(steps_logged(tmp_path / "killed", g) for g in (0, 1)) < 5:
            assert time.monotonic() < deadline and all(group.poll() is None for group in groups)
            time.sleep(0.05)
        for group in groups:  # every group lost at once, after the step-3 checkpoint and before the end
            os.killpg(group.pid, signal.SIGKILL)
            group.wait(timeout=30)
        finish(start_groups(tmp_path / "killed", lighthouse, *checkpointed))
    finally:
        for group in groups:
            if group.poll() is None:
                os.killpg(group.pid, signal.SIGKILL)
        lighthouse.shutdown()
    want = {m["step"]: m for m in read_metrics(tmp_path / "reference" / "group0")}
    for g in (0, 1):
        resumed = read_metrics(tmp_path / "killed" / f"group{g}")
        # The first launch logged steps 1..k (k >= 5); the second resumed after step 3 and logged 4..8.
        restart = max(i for i, m in enumerate(resumed) if m["step"] == 4)
        after = resumed[restart:]
        assert restart >= 4  # the first launch got past step 4 before it was killed
        assert [m["step"] for m in after] == list(range(4, STEPS + 1))
        for got in after:
            assert got["loss"] == pytest.approx(want[got["step"]]["loss"], rel=1e-5, abs=1e-5)
            assert got["grad_norm"] == pytest.approx(want[got["step"]]["grad_norm"], rel=1e-5, abs=1e-5)
