"""kill -9 during training and during a save, then the same command again: it resumes from the newest complete
checkpoint and every loss from there on is bit-identical to the run that was never interrupted (CPU, fp32)."""

from __future__ import annotations

import pytest
from e2e_checkpoint_helpers import (
    CHECKPOINTED,
    kill_hard,
    logged_steps,
    losses_by_step,
    read_metrics,
    rerun_and_compare,
    run_train,
    start_train,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.torch_independent]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    result = run_train(*CHECKPOINTED, "--job.dump_folder", str(run_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    return losses_by_step(read_metrics(run_dir))


def test_kill_during_training_then_rerun_resumes_bit_identically(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    process = start_train(*CHECKPOINTED, "--job.dump_folder", str(run_dir))
    wait_for(process, lambda: logged_steps(run_dir) >= 5)
    kill_hard(process)
    start, log = rerun_and_compare(run_dir, uninterrupted)
    assert start in (4, 6)  # step-6 only if it was committed in the moment before the kill
    assert f"resuming from {run_dir}/checkpoint/step-{start} (full training state)" in log


def test_kill_during_a_save_never_resumes_the_torn_checkpoint(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    folder = run_dir / "checkpoint"
    process = start_train(*CHECKPOINTED, "--job.dump_folder", str(run_dir))
    # The second save (step-4) is being written: kill while its folder still has the temporary name.
    wait_for(process, lambda: (folder / "step-4.partial").exists())
    kill_hard(process)
    torn = (folder / "step-4.partial").exists()
    start, log = rerun_and_compare(run_dir, uninterrupted)
    if torn:  # the usual case; a kill that came a moment late leaves a committed step-4 instead
        assert "ignoring incomplete checkpoint folder(s)" in log and "step-4.partial" in log
        assert start == 2
