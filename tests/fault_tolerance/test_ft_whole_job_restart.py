"""Losing every replica group at once is a whole-job restart: each group resumes from its own latest checkpoint
(they are the same state) and the job continues the curve of a run that was never interrupted."""

import pytest

from tests.fault_tolerance.replica_harness import (
    Group,
    finished_well,
    groups_ended,
    lighthouse,
    read_metrics,
    wait_for,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
STEPS = 8
# Both groups take part in every step (the lighthouse's min_replicas 2 too), as in the reference run.
BOTH = ["--training.steps", str(STEPS), "--fault_tolerance.min_replica_size", "2"]
CHECKPOINTED = ["--checkpoint.enable", "--checkpoint.interval", "3"]


def run_to_the_end(folder, address, *args):
    groups = [Group(folder / f"group{g}", g, address, *BOTH, *args) for g in (0, 1)]
    finished_well(*groups)


def test_a_job_that_lost_every_group_resumes_from_the_checkpoints_exactly(tmp_path):
    killed = tmp_path / "killed"
    with lighthouse(min_replicas=2) as address, groups_ended() as started:
        run_to_the_end(tmp_path / "reference", address)
        started += [Group(killed / f"group{g}", g, address, *BOTH, *CHECKPOINTED) for g in (0, 1)]
        wait_for(lambda: min(len(read_metrics(group.folder)) for group in started) >= 5, 120, started,
                 "step 5 in both groups")
        for group in started:  # every group lost at once, after the step-3 checkpoint and before the end
            group.kill()
        run_to_the_end(killed, address, *CHECKPOINTED)
    want = {m["step"]: m for m in read_metrics(tmp_path / "reference" / "group0")}
    for g in (0, 1):
        resumed = read_metrics(killed / f"group{g}")
        restart = max(i for i, m in enumerate(resumed) if m["step"] == 4)
        assert restart >= 4  # the first launch got past step 4 before it was killed
        assert [m["step"] for m in resumed[restart:]] == list(range(4, STEPS + 1))
        for got in resumed[restart:]:
            assert got["loss"] == pytest.approx(want[got["step"]]["loss"], rel=1e-5, abs=1e-5)
            assert got["grad_norm"] == pytest.approx(want[got["step"]]["grad_norm"], rel=1e-5, abs=1e-5)
