"""Through ./run_train.sh: a second launch into a live run's folder is refused in one line and changes nothing
there; after the first run dies by kill -9, the next launch takes its lock over and resumes."""

from __future__ import annotations

import pytest
from e2e_checkpoint_helpers import CHECKPOINTED, kill_hard, logged_steps, run_train, start_train, wait_for

from dtrain.reliability.run_lock import LOCK_FILE

pytestmark = [pytest.mark.slow, pytest.mark.torch_independent]


def test_one_live_run_per_folder_and_a_dead_runs_lock_is_taken_over(tmp_path):
    run_dir = tmp_path / "run"
    args = [*CHECKPOINTED, "--training.steps", "200", "--job.dump_folder", str(run_dir)]
    first = start_train(*args)
    try:
        wait_for(first, lambda: logged_steps(run_dir) >= 2)
        before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name != "metrics.jsonl"}
        second = run_train(*args)
        assert second.returncode != 0
        last = second.stderr.strip().splitlines()[-1]
        assert last.startswith(f"error: run folder {run_dir} is in use by pid {first.pid} on "), second.stderr
        assert last.endswith("; stop it, or use another job.dump_folder") and "Traceback" not in second.stderr
        after = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name != "metrics.jsonl"}
        assert after == before  # config.toml, the lock and everything else as the first run left them
    finally:
        kill_hard(first)
    assert (run_dir / LOCK_FILE).exists()  # kill -9 leaves the lock behind
    third = run_train(*CHECKPOINTED, "--job.dump_folder", str(run_dir))
    assert third.returncode == 0, third.stderr[-3000:]
    assert "taking over the lock of a run that is gone" in third.stderr
    assert "checkpoint: resuming from" in third.stderr
    assert not (run_dir / LOCK_FILE).exists()


def folder_snapshot(run_dir) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_a_refused_resume_leaves_the_run_folder_byte_for_byte_unchanged(tmp_path):
    run_dir = tmp_path / "run"
    first = run_train(*CHECKPOINTED, "--training.steps", "4", "--job.dump_folder", str(run_dir))
    assert first.returncode == 0, first.stderr[-3000:]
    before = folder_snapshot(run_dir)
    assert "config.toml" in before and any(name.startswith("tb") for name in before)
    # Another sequence length cannot continue the saved data position: the resume is refused.
    refused = run_train(*CHECKPOINTED, "--training.steps", "6", "--training.seq_len", "32",
                        "--job.dump_folder", str(run_dir))
    assert refused.returncode != 0
    assert refused.stderr.strip().splitlines()[-1].startswith("error: training.seq_len = 32 differs from checkpoint ")
    assert folder_snapshot(run_dir) == before
