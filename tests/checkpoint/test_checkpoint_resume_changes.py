"""Through ./run_train.sh: resuming a run with a changed sequence length, batch size or model is refused in one
line that names the key, the checkpoint's value and the new one, and what to do, with the run folder left byte for
byte as it was; or it continues where that is sound (dtrain/checkpoint/config_checks.py says which and why).

One run saves step 2 and goes on to step 3 uninterrupted (fp32); every refused start then reads its checkpoint,
and each continuation works in a copy of the run folder."""

from __future__ import annotations

import shutil

import pytest
from e2e_checkpoint_helpers import CHECKPOINTED, read_metrics, run_train
from run_train_helpers import FP32
from test_checkpoint_e2e_lock import folder_snapshot

# dtrain's own checks of a resume through the CLI: CI runs them under the default torch only (tests/torch_runs.py).
pytestmark = [pytest.mark.slow, pytest.mark.torch_independent]

# step-2 holds the full state; step-3 (the last save) the weights only, so resumes name step 2.
RUN = [*CHECKPOINTED, *FP32, "--training.steps", "3"]
RESUME = [*RUN, "--checkpoint.load_step", "2"]
DATA = "its data position counts {} and cannot continue"
KEEP_DATA = (
    ', or set checkpoint.exclude_from_loading = ["dataloader"] to continue the weights, optimizer and schedule with '
    "the data from its beginning, or start a new job.dump_folder"
)
SAME_MODEL = "a resume continues the same model; set {}, or start a new run in a new job.dump_folder"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(run folder, the uninterrupted run's metrics)."""
    run_dir = tmp_path_factory.mktemp("resume_changes") / "run"
    result = run_train(*RUN, "--job.dump_folder", str(run_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, read_metrics(run_dir)


@pytest.mark.parametrize("change, first, then", [
    (["--training.seq_len", "32"], "training.seq_len = 32 differs from checkpoint {}'s 64",
     DATA.format("sequences of that length") + "; resume with training.seq_len = 64" + KEEP_DATA),
    (["--training.local_batch_size", "2"],
     "the global batch (training.local_batch_size 2 x 1 data-parallel rank(s)) of 2 sequences differs from "
     "checkpoint {}'s 4", DATA.format("batches of that size") + "; resume with training.global_batch_size = 4 (any "
     "training.local_batch_size that divides it continues exactly)" + KEEP_DATA),
    (["--training.global_batch_size", "8"],
     "the global batch (training.global_batch_size) of 8 sequences differs from checkpoint {}'s 4",
     DATA.format("batches of that size")),
    # Fewer layers, or another RoPE base, keep every stored weight's shape: only the record tells them apart.
    (["--model.args.n_layers", "5"], "model.args.n_layers = 5 differs from checkpoint {}'s 6",
     SAME_MODEL.format("model.args.n_layers = 6")),
    (["--model.args.rope_theta", "10000"], "model.args.rope_theta = 10000.0 differs from checkpoint {}'s 500000.0",
     SAME_MODEL.format("model.args.rope_theta = 500000.0")),
    (["--model.flavor", "debugmodel"],
     "model.args.n_heads = 16 (model.flavor debugmodel_gqa -> debugmodel) differs from checkpoint {}'s 8 (as do "
     "model.args.n_kv_heads)", SAME_MODEL.format("model.flavor = debugmodel_gqa")),
    (["--model.name", "qwen3", "--model.flavor", "debugmodel"],
     "model.name = qwen3 differs from checkpoint {}'s llama3",
     SAME_MODEL.format("model.name = llama3 (model.flavor = debugmodel_gqa)")),
], ids=["seq_len", "local_batch_size", "global_batch_size", "n_layers", "rope_theta", "flavor", "name"])
def test_a_resume_that_cannot_continue_is_one_line_and_writes_nothing(saved, change, first, then):
    run_dir, _ = saved
    before = folder_snapshot(run_dir)
    result = run_train(*RESUME, *change, "--job.dump_folder", str(run_dir))
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {first.format(run_dir / 'checkpoint' / 'step-2')}: "), last
    assert then in last, last
    assert folder_snapshot(run_dir) == before


def test_the_same_global_batch_in_other_microbatches_continues_exactly(saved, tmp_path):
    run_dir, uninterrupted = saved
    copy = shutil.copytree(run_dir, tmp_path / "run")
    result = run_train(*RESUME, "--training.local_batch_size", "2", "--training.global_batch_size", "4",
                       "--job.dump_folder", str(copy))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming from {copy / 'checkpoint' / 'step-2'} (full training state)" in result.stderr
    (resumed,) = read_metrics(copy)[len(uninterrupted):]
    assert resumed["step"] == 3 and resumed["loss"] == pytest.approx(uninterrupted[2]["loss"], rel=1e-5)


def test_a_new_seq_len_continues_without_the_data_position_when_asked(saved, tmp_path):
    run_dir, _ = saved
    copy = shutil.copytree(run_dir, tmp_path / "run")
    result = run_train(*RESUME, "--training.seq_len", "32", "--checkpoint.exclude_from_loading", "dataloader",
                       "--job.dump_folder", str(copy))
    assert result.returncode == 0, result.stderr[-3000:]
    step_2 = copy / "checkpoint" / "step-2"
    assert (
        f"checkpoint: training.seq_len = 32 differs from checkpoint {step_2}'s 64: weights, optimizer and schedule "
        "continue, the data starts from its beginning (checkpoint.exclude_from_loading = dataloader)"
    ) in result.stderr
    assert f"resuming from {step_2} (full training state) at step 2" in result.stderr
    assert [r["step"] for r in read_metrics(copy)][-1] == 3
