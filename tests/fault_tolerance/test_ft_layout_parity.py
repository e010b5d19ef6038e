"""With no failure, replica groups train the curve of one job holding the groups as a data-parallel dimension:
2 groups of 2 FSDP processes = plain HSDP (2 replicas x 2 shards), 2 groups of a 2-stage pipeline = a plain
2-stage pipeline over FSDP 2, each a 4-process job: same loss, grad norm and lr per step at fp32."""

import pytest

from tests.e2e.run_train_helpers import run_train
from tests.fault_tolerance.replica_harness import SHAPE, Group, finished_well, groups_ended, lighthouse, read_metrics

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
STEPS = ["--training.steps", "4"]
PIPELINE = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "1"]
# Each layout: inside a group, and the plain 4-process job whose data-parallel degree 2 holds what the 2 groups
# hold (a pipeline is not combined with plain replication here: its data-parallel dimension is FSDP's).
LAYOUTS = {
    "fsdp": (["--parallelism.data_parallel_shard_degree", "2"],
             ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.data_parallel_replicate_degree", "2"]),
    "pipeline": (["--parallelism.data_parallel_shard_degree", "1", *PIPELINE],
                 ["--parallelism.data_parallel_shard_degree", "2", *PIPELINE]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_replica_groups_train_the_curve_of_their_layout_replicated(tmp_path, layout):
    inside, whole_job = LAYOUTS[layout]
    plain = run_train(
        *SHAPE, *STEPS, *whole_job, "--job.dump_folder", str(tmp_path / "plain"), NPROC="4", timeout=300,
    )
    assert plain.returncode == 0, plain.stderr[-2000:]
    # min_replicas 2: the first step waits for both groups, as the plain job's first step has both replicas.
    with lighthouse(min_replicas=2) as address, groups_ended() as started:
        started += [
            Group(tmp_path / f"group{g}", g, address, *STEPS, *inside, "--fault_tolerance.min_replica_size", "2",
                  nproc=2)
            for g in (0, 1)
        ]
        finished_well(*started)
    want = read_metrics(tmp_path / "plain")
    assert len(want) == 4
    for g in (0, 1):
        got = read_metrics(tmp_path / f"group{g}")
        assert [m["step"] for m in got] == [m["step"] for m in want]
        for mine, theirs in zip(got, want):
            assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5, abs=1e-5)
            assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5, abs=1e-5)
            assert mine["lr"] == theirs["lr"]
            assert mine["ft/participating_groups"] == 2
