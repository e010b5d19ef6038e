"""With no failure, fault-tolerant HSDP (2 replica groups of 2 FSDP processes, gradients summed over the groups
by torchft) trains plain HSDP's curve (2 replicas x 2 shards in one 4-process job): same loss, grad norm and lr
per step at fp32."""

import subprocess

import pytest
from torchft.coordination import LighthouseServer

from tests.e2e.run_train_helpers import FP32, REPO, read_metrics, run_train, user_env

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
SHAPE = ["--training.steps", "4", "--training.dataset", "synthetic", "--model.tokenizer", "byte",
         "--training.seq_len", "64", "--training.local_batch_size", "2", "--metrics.log_freq", "1", *FP32]


def test_fault_tolerant_hsdp_trains_plain_hsdps_curve(tmp_path):
    plain = run_train(
        *SHAPE, "--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree",
        "2", "--job.dump_folder", str(tmp_path / "hsdp"), NPROC="4", timeout=300,
    )
    assert plain.returncode == 0, plain.stderr[-2000:]
    # min_replicas 2: the first step waits for both groups, as plain HSDP's first step has both replicas.
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=1000, heartbeat_timeout_ms=1000)
    try:
        groups = [
            subprocess.Popen(
                ["timeout", "300", "./run_train.sh", *SHAPE, "--parallelism.data_parallel_shard_degree", "2",
                 "--fault_tolerance.enable", "--fault_tolerance.group_size", "2",
                 "--fault_tolerance.min_replica_size", "2", "--fault_tolerance.replica_id", str(g),
                 "--job.dump_folder", str(tmp_path / f"group{g}")],
                cwd=REPO, env=user_env(NPROC="2", TORCHFT_LIGHTHOUSE=lighthouse.address()), text=True,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )
            for g in (0, 1)
        ]
        outputs = [group.communicate(timeout=320) for group in groups]
    finally:
        lighthouse.shutdown()
    for group, (_, err) in zip(groups, outputs):
        assert group.returncode == 0, err[-2000:]
    want = read_metrics(tmp_path / "hsdp")
    assert len(want) == 4
    for g in (0, 1):
        got = read_metrics(tmp_path / f"group{g}")
        assert [m["step"] for m in got] == [m["step"] for m in want]
        for mine, theirs in zip(got, want):
            assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5, abs=1e-5)
            assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5, abs=1e-5)
            assert mine["lr"] == theirs["lr"]
            assert mine["ft/participating_groups"] == 2
