"""A replica group lost to kill -9 in the middle of a run: the other group goes on alone, the lost one is launched
again with the same command, takes the live state from its peer, and both end with the same weights, bit for bit."""

import pytest

from tests.fault_tolerance.replica_harness import (
    HEARTBEAT_MS,
    Group,
    assert_bitwise_equal,
    finished_well,
    groups_ended,
    last_step,
    last_weights,
    lighthouse,
    lose_one_of_two,
    read_metrics,
    wait_for,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
# Long enough that the survivor, faster alone, is still training when the relaunched group (~4 s to start) joins.
STEPS = 120
KILL_AT = 10
# Both groups save the last step's weights only (in float32): the checkpoints compared at the end.
LAST_WEIGHTS = ["--training.steps", str(STEPS), "--checkpoint.enable", "--checkpoint.interval", "100000",
                "--checkpoint.last_save_model_only", "true"]
# The longest pause of the survivor's steps around the kill: the heartbeat timeout that drops the lost group, the
# failed collective of the step in flight, and some slack for 2 busy cores.
LONGEST_PAUSE_S = HEARTBEAT_MS / 1000 + 4.0


# Reading a checkpoint in this one process, outside any process group, is what DCP warns about.
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_killed_group_is_relaunched_recovers_live_and_ends_with_the_survivors_weights(tmp_path):
    with lighthouse() as address, groups_ended() as started:
        survivor, victim = lose_one_of_two(tmp_path, address, started, KILL_AT, *LAST_WEIGHTS)
        first_life = len(read_metrics(victim.folder))
        # The same command, the same dump folder: what a supervisor restarting the group does. The lost launch's
        # run-folder lock died with it, and it left no checkpoint, so the relaunch starts at step 0 and is behind.
        relaunched = Group(tmp_path / "group1", 1, address, *LAST_WEIGHTS)
        started.append(relaunched)
        wait_for(lambda: len(read_metrics(relaunched.folder)) > first_life, 90, [relaunched],
                 "step of the relaunched group")
        survivor_step_at_rejoin = last_step(survivor.folder)
        assert survivor.running() and survivor_step_at_rejoin < STEPS, "the relaunched group joined too late"
        survivor_err, err = finished_well(survivor, relaunched)

    survivor_records = read_metrics(survivor.folder)
    alone = [r["step"] for r in survivor_records if r["step"] > KILL_AT and r["ft/participating_groups"] == 1]
    assert alone and alone[-1] <= survivor_step_at_rejoin, alone  # alone from the kill to the rejoin only
    assert survivor_records[-1]["step"] == STEPS and survivor_records[-1]["ft/participating_groups"] == 2
    elapsed = [r["elapsed_s"] for r in survivor_records]
    pauses = [later - earlier for earlier, later in zip(elapsed, elapsed[1:])]
    assert max(pauses) < LONGEST_PAUSE_S, f"the survivor stalled {max(pauses):.1f} s"

    second_life = read_metrics(relaunched.folder)[first_life:]
    assert second_life[0]["step"] > KILL_AT  # it continued from its peer's step, not from its own start
    assert second_life[-1]["step"] == STEPS and second_life[-1]["ft/recoveries"] >= 1
    assert second_life[0]["tps"] is None  # its step of the live recovery: the peer's tokens, no throughput
    assert "recovered live at step" in err
    # The loss and the rejoin are one line each in the survivor's log; torchft's tracebacks only with DTRAIN_TRACEBACK.
    assert "replica group 0: group 1 lost at step" in survivor_err and "group 1 joined at step" in survivor_err
    assert "Traceback" not in survivor_err, survivor_err[-3000:]
    assert_bitwise_equal(last_weights(relaunched.folder), last_weights(survivor.folder))


def test_a_killed_two_process_group_leaves_its_two_process_peer_training_alone(tmp_path):
    """kill -9 of a whole group of 2 FSDP processes (launcher, torchrun, workers): both ranks of the other group
    drop it together and finish the run."""
    steps, kill_at = 20, 5
    args = ["--training.steps", str(steps), "--parallelism.data_parallel_shard_degree", "2"]
    with lighthouse() as address, groups_ended() as started:
        survivor, _ = lose_one_of_two(tmp_path, address, started, kill_at, *args, nproc=2)
        finished_well(survivor)
    records = read_metrics(survivor.folder)
    assert records[-1]["step"] == steps
    assert [r["step"] for r in records if r["step"] > kill_at and r["ft/participating_groups"] == 1]


def test_a_group_whose_attempts_are_all_discarded_still_stops_on_a_preemption_signal(tmp_path):
    """Alone where fault_tolerance.min_replica_size asks for 2 groups, every attempt at step 1 is discarded; SIGTERM
    still stops the group after the attempt in flight, with exit code 0 and nothing trained."""
    with lighthouse() as address, groups_ended() as started:
        lone = Group(tmp_path / "group0", 0, address, "--training.steps", "20", "--fault_tolerance.min_replica_size",
                     "2")
        started.append(lone)
        wait_for(lambda: "discarded" in lone.stderr(), 90, started, "a discarded attempt")
        lone.preempt()
        (stderr,) = finished_well(lone)
    assert "stopped at step 0 on a preemption signal" in stderr
    assert not read_metrics(lone.folder)
