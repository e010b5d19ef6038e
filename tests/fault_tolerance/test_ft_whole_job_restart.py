"""The curve of a job whose groups all took part in every step, reached again after interruptions: losing every
group at once (a whole-job restart from the checkpoints), and a group that waited alone for its peer (its attempts
discarded and retried on the same batches)."""

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
# Both groups take part in every step that is done.
BOTH = ["--training.steps", str(STEPS), "--fault_tolerance.min_replica_size", "2"]
CHECKPOINTED = ["--checkpoint.enable", "--checkpoint.interval", "3"]


def run_to_the_end(folder, address, *args):
    finished_well(*(Group(folder / f"group{g}", g, address, *BOTH, *args) for g in (0, 1)))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, dict]:
    """Step -> metrics of the uninterrupted job (the lighthouse's min_replicas 2: both groups from the first step)."""
    folder = tmp_path_factory.mktemp("reference")
    with lighthouse(min_replicas=2) as address:
        run_to_the_end(folder, address)
    return {m["step"]: m for m in read_metrics(folder / "group0")}


def assert_on_the_curve(records: list[dict], reference: dict[int, dict]) -> None:
    for got in records:
        want = reference[got["step"]]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-5), got["step"]
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5, abs=1e-5), got["step"]


def test_a_job_that_lost_every_group_resumes_from_the_checkpoints_exactly(tmp_path, reference):
    killed = tmp_path / "killed"
    with lighthouse(min_replicas=2) as address, groups_ended() as started:
        started += [Group(killed / f"group{g}", g, address, *BOTH, *CHECKPOINTED) for g in (0, 1)]
        wait_for(lambda: min(len(read_metrics(group.folder)) for group in started) >= 5, 120, started,
                 "step 5 in both groups")
        for group in started:  # every group lost at once, after the step-3 checkpoint and before the end
            group.kill()
        run_to_the_end(killed, address, *CHECKPOINTED)
    for g in (0, 1):
        resumed = read_metrics(killed / f"group{g}")
        restart = max(i for i, m in enumerate(resumed) if m["step"] == 4)
        assert restart >= 4  # the first launch got past step 4 before it was killed
        assert [m["step"] for m in resumed[restart:]] == list(range(4, STEPS + 1))
        assert_on_the_curve(resumed[restart:], reference)


def test_a_group_waiting_alone_retries_its_first_step_on_the_same_batches(tmp_path, reference):
    # min_replicas 1: the lighthouse lets group 0 step alone, and min_replica_size 2 discards every such attempt.
    with lighthouse(min_replicas=1) as address, groups_ended() as started:
        first = Group(tmp_path / "group0", 0, address, *BOTH)
        started.append(first)
        wait_for(lambda: "discarded" in first.stderr(), 90, started, "a discarded attempt")
        started.append(Group(tmp_path / "group1", 1, address, *BOTH))
        stderr, _ = finished_well(*started)
    assert stderr.count("discarded (") == 1  # said once for the whole run of discarded attempts
    assert "step 1 done after" in stderr
    records = read_metrics(tmp_path / "group0")
    assert [m["step"] for m in records] == list(range(1, STEPS + 1))
    assert read_metrics(tmp_path / "group0")[-1]["ft/discarded_steps"] >= 1
    assert_on_the_curve(records, reference)
