"""End to end through ./run_train.sh: a 2-stage pipeline run with [validation] on the built-in corpus's held-out
part logs val_loss and val_perplexity on the console, in metrics.jsonl records of their own and in TensorBoard."""

import math
import re

import pytest
from run_train_helpers import TINY, read_metrics, run_train
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytestmark = pytest.mark.slow

VALIDATION = ["--validation.enable", "--validation.freq", "4", "--validation.steps", "3", "--validation.seq_len", "32",
              "--validation.local_batch_size", "2"]


def test_pipeline_run_validates_every_freq_steps(tmp_path):
    run_dir = tmp_path / "run"
    result = run_train(*TINY, *VALIDATION, "--parallelism.pipeline_parallel_degree", "2", "--job.dump_folder",
                       str(run_dir), NPROC="2")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "validation every 4 steps: 3 batch(es) of 2 x 32 per dp rank from builtin corpus, held-out part" in output
    lines = re.findall(r"validation  step +(\d+)/8  val_loss ([\d.]+)  val_perplexity ([\d.]+)", output)
    assert [int(step) for step, _, _ in lines] == [4, 8]

    records = [r for r in read_metrics(run_dir) if "val_loss" in r]
    assert [sorted(r) for r in records] == [["step", "val_loss", "val_perplexity"]] * 2
    assert [r["step"] for r in records] == [4, 8]
    assert all(r["val_perplexity"] == pytest.approx(math.exp(r["val_loss"])) for r in records)
    assert records[1]["val_loss"] < records[0]["val_loss"]  # the model learns, the held-out loss falls
    assert [float(loss) for _, loss, _ in lines] == pytest.approx([r["val_loss"] for r in records], abs=1e-4)
    # Training records stay as they were: every step logged, none of them carries validation fields.
    assert [r["step"] for r in read_metrics(run_dir) if "loss" in r] == list(range(1, 9))

    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    for tag in ("val_loss", "val_perplexity"):
        assert [event.step for event in events.Scalars(tag)] == [4, 8]
    assert [e.value for e in events.Scalars("val_loss")] == pytest.approx([r["val_loss"] for r in records])


def test_whole_set_on_synthetic_data_is_refused_before_anything_is_written(tmp_path):
    run_dir = tmp_path / "run"
    result = run_train("--validation.enable", "--validation.dataset", "synthetic", "--job.dump_folder", str(run_dir))
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: validation.steps = -1 evaluates the whole validation set")
    assert not run_dir.exists()
