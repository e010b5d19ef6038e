"""Through ./run_train.sh: a run that diverges stops on that step with one line and exit 1, and no checkpoint of
its non-finite state is ever committed (the good ones before it stay)."""

from __future__ import annotations

from run_train_helpers import TINY, read_metrics, run_train

from dtrain.checkpoint import scan_checkpoints

# A learning rate of 1e4 without warmup: the second step's gradient norm is NaN on the debug model (measured).
DIVERGING = [*TINY, "--optimizer.lr", "1e4", "--lr_scheduler.warmup_steps", "0", "--model.args.n_layers", "1"]


def test_a_diverged_run_stops_with_one_line_and_saves_nothing_after_it(tmp_path):
    run_dir = tmp_path / "run"
    result = run_train(*DIVERGING, "--checkpoint.enable", "--checkpoint.interval", "1", "--metrics.log_freq", "4",
                       "--job.dump_folder", str(run_dir))
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: training diverged at step 2 (loss ") and "grad_norm nan" in last, result.stderr
    assert "Traceback" not in result.stderr and "training done" not in result.stderr
    assert [c.step for c in scan_checkpoints(run_dir / "checkpoint").committed] == [1]
    assert [r["step"] for r in read_metrics(run_dir)] == [1]  # the first step is always logged; step 4 never was


def test_skip_nonfinite_steps_skips_updates_up_to_the_budget(tmp_path):
    result = run_train(*DIVERGING, "--training.skip_nonfinite_steps", "2", "--job.dump_folder", str(tmp_path / "r"))
    assert result.returncode == 1
    assert result.stderr.count("not finite; update skipped") == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: training diverged at step ")
