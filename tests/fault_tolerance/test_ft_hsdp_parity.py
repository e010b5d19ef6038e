"""With no failure, fault-tolerant HSDP (2 replica groups of 2 FSDP processes, gradients summed over the groups
by torchft) trains plain HSDP's curve (2 replicas x 2 shards in one 4-process job): same loss, grad norm and lr
per step at fp32."""

import pytest

from tests.e2e.run_train_helpers import run_train
from tests.fault_tolerance.replica_harness import SHAPE, Group, groups_ended, lighthouse, read_metrics

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
STEPS = ["--training.steps", "4"]


def test_fault_tolerant_hsdp_trains_plain_hsdps_curve(tmp_path):
    plain = run_train(
        *SHAPE, *STEPS, "--parallelism.data_parallel_replicate_degree", "2",
        "--parallelism.data_parallel_shard_degree", "2", "--job.dump_folder", str(tmp_path / "hsdp"), NPROC="4",
        timeout=300,
    )
    assert plain.returncode == 0, plain.stderr[-2000:]
    # min_replicas 2: the first step waits for both groups, as plain HSDP's first step has both replicas.
    with lighthouse(min_replicas=2) as address, groups_ended() as started:
        started += [
            Group(tmp_path / f"group{g}", g, address, *STEPS, "--parallelism.data_parallel_shard_degree", "2",
                  "--fault_tolerance.min_replica_size", "2", nproc=2)
            for g in (0, 1)
        ]
        for group in started:
            code, err = group.finish()
            assert code == 0, err[-2000:]
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
