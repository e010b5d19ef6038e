"""Through ./run_train.sh: SIGTERM finishes the step, saves and exits 0, and the rerun continues bit-identically;
the seed checkpoint command; start-up errors are one line."""

from __future__ import annotations

import signal

import pytest
from e2e_checkpoint_helpers import CHECKPOINTED, logged_steps, read_metrics, run_train, start_train, wait_for

from dtrain.checkpoint import scan_checkpoints

# CLI walkthroughs of signals and start-up: CI runs them under the default torch only (tests/torch_runs.py).
pytestmark = [pytest.mark.slow, pytest.mark.torch_independent]


# The signal's handling is dtrain's own; resuming under torch 2.11 is tests/e2e/test_run_train_elastic.py's subject.
def test_sigterm_saves_exits_zero_and_the_rerun_continues(tmp_path):
    run_dir, reference = tmp_path / "run", tmp_path / "reference"
    # No periodic saves: whatever is on disk after the signal was saved because of it.
    args = [*CHECKPOINTED, "--checkpoint.interval", "100"]
    process = start_train(*args, "--job.dump_folder", str(run_dir))
    wait_for(process, lambda: logged_steps(run_dir) >= 3)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=240)
    assert process.returncode == 0, output[-3000:]
    assert "preemption: SIGTERM received" in output
    saved = [c.step for c in scan_checkpoints(run_dir / "checkpoint").committed]
    assert len(saved) == 1 and 3 <= saved[0] < 8
    assert read_metrics(run_dir)[-1]["step"] == saved[0]  # stopped right after the step it saved

    result = run_train(*args, "--job.dump_folder", str(run_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming from {run_dir}/checkpoint/step-{saved[0]}" in result.stderr
    assert run_train(*args, "--job.dump_folder", str(reference)).returncode == 0
    # The stopped run logged steps 1..k, the rerun k+1..8: together, exactly the uninterrupted run.
    assert [(r["step"], r["loss"]) for r in read_metrics(run_dir)] == [
        (r["step"], r["loss"]) for r in read_metrics(reference)
    ]


def test_seed_checkpoint_then_training_starts_from_it(tmp_path):
    run_dir = tmp_path / "run"
    seeded = run_train(*CHECKPOINTED, "--checkpoint.create_seed_checkpoint", "--job.dump_folder", str(run_dir))
    assert seeded.returncode == 0, seeded.stderr[-3000:]
    assert [c.step for c in scan_checkpoints(run_dir / "checkpoint").committed] == [0]
    assert not (run_dir / "metrics.jsonl").exists() or not read_metrics(run_dir)

    trained = run_train(*CHECKPOINTED, "--training.steps", "2", "--job.dump_folder", str(run_dir))
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert f"resuming from {run_dir}/checkpoint/step-0 (weights only) at step 0" in trained.stderr


def test_start_up_errors_are_one_line(tmp_path):
    run_dir = tmp_path / "run"
    result = run_train(*CHECKPOINTED, "--checkpoint.initial_load_path", str(tmp_path / "nothing"),
                       "--job.dump_folder", str(run_dir))
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: checkpoint.initial_load_path {tmp_path / 'nothing'} does not exist"
    assert not run_dir.exists()

    result = run_train(*CHECKPOINTED, "--checkpoint.require_checkpoint", "--job.dump_folder", str(run_dir))
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: checkpoint.require_checkpoint is set") and "Traceback" not in result.stderr
