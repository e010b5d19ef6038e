"""FSDP2 and TP on 2 processes through `NPROC=2 ./run_train.sh` reproduce the 1-process loss curve."""

import pytest
from run_train_helpers import FP32, TINY, read_metrics, run_train

pytestmark = pytest.mark.slow

# One global batch of 4 sequences per step however it is split; fp32 everywhere, compared at 1e-5.
SAME_GLOBAL_BATCH = [*TINY, "--training.steps", "5", "--training.global_batch_size", "4", *FP32]


@pytest.fixture(scope="module")
def single_process_losses(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single")
    result = run_train(*SAME_GLOBAL_BATCH, "--job.dump_folder", str(run_dir))
    assert result.returncode == 0, result.stderr[-2000:]
    return [r["loss"] for r in read_metrics(run_dir)]


@pytest.mark.parametrize(
    "layout, expected_in_log",
    [
        (["--parallelism.data_parallel_shard_degree", "2"], "FSDP"),
        (["--parallelism.tensor_parallel_degree", "2", "--activation_checkpoint.mode", "full"], "TP+SP"),
    ],
    ids=["fsdp2", "tp2_full_ac"],
)
def test_two_processes_match_one(tmp_path, single_process_losses, layout, expected_in_log):
    run_dir = tmp_path / "run"
    result = run_train(*SAME_GLOBAL_BATCH, "--training.local_batch_size", "2", *layout,
                       "--job.dump_folder", str(run_dir), NPROC="2")
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stdout + result.stderr
    assert f"2 processes ({expected_in_log}" in log
    assert "memory on this rank: params" in log
    if expected_in_log == "TP+SP":
        assert "tensor-parallel plan:" in log and "layers.*.attention.wq" in log
        assert ".moe" not in log  # the plan shows what the dense model has, not the family's MoE entries
    losses = [r["loss"] for r in read_metrics(run_dir)]
    assert losses == pytest.approx(single_process_losses, rel=1e-5)


@pytest.mark.parametrize(
    "layout, named",
    [
        (["--parallelism.tensor_parallel_degree", "3"], "parallelism.tensor_parallel_degree=3"),
        (["--parallelism.context_parallel_degree", "2", "--training.seq_len", "66"],
         "training.seq_len=66 is not a multiple of 2 × parallelism.context_parallel_degree = 4"),
        (["--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_rotate_method", "alltoall"],
         "parallelism.context_parallel_rotate_method='alltoall' needs torch's ring attention"),
    ],
    ids=["tp3", "cp_seq_len", "cp_alltoall"],
)
def test_bad_layout_is_refused_once_before_launch(tmp_path, layout, named):
    result = run_train(*TINY, *layout, "--job.dump_folder", str(tmp_path / "r"), NPROC="2")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0]
    assert not (tmp_path / "r").exists()
