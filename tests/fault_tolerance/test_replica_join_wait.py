"""A group's first step waits for all fault_tolerance.group_size groups (its attempts discarded), then trains with
those present and says what it assumed; a group that recovered live joined a running job and never waits. Driven
with a stand-in for torchft's Manager: the rule is dtrain's (fault_tolerance/replica_groups.py)."""

import logging
import time

from dtrain.config.schema_opt_in import FaultTolerance
from dtrain.fault_tolerance.replica_groups import LiveRecovery, PerStepGroups


class Alone:
    """torchft's Manager as a group with no peer sees it: a quorum of one, whose commit vote follows the errors."""

    def __init__(self) -> None:
        self.step, self.reported = 4, []

    def start_quorum(self) -> None:
        self.reported = []

    def num_participants(self) -> int:
        return 1

    def current_step(self) -> int:
        return self.step

    def report_error(self, err: Exception) -> None:
        self.reported.append(err)

    def errored(self):
        return self.reported[-1] if self.reported else None

    def should_commit(self) -> bool:
        committed = not self.reported
        self.step += committed
        return committed


def lone_group(join_timeout: float, manager=None, recovery=None) -> PerStepGroups:
    ft = FaultTolerance(enable=True, replica_id=1, group_size=2, join_timeout_seconds=join_timeout)
    return PerStepGroups(manager or Alone(), recovery or LiveRecovery(None, 1, say_each=False), ft, store=None)


def attempt(groups: PerStepGroups) -> bool:
    assert groups.start_step()
    return groups.should_commit()


def test_a_group_whose_peers_never_come_waits_then_says_what_it_assumed(caplog):
    groups = lone_group(join_timeout=0.3)
    with caplog.at_level(logging.INFO, logger="dtrain"):
        assert not attempt(groups) and not attempt(groups)  # discarded while it waits
        time.sleep(0.35)
        assert attempt(groups) and attempt(groups)  # then it trains alone
    said = caplog.text
    assert said.count("step 5 discarded (waiting up to 0 s, fault_tolerance.join_timeout_seconds, for all 2") == 1
    assert ("only 1 of 2 replica groups joined within 0 s (fault_tolerance.join_timeout_seconds); training from "
            "step 5 without the others, assuming they were lost (if they finished the job, stop this group") in said
    assert groups.metrics()["ft/discarded_steps"] == 2.0


def test_a_group_that_recovered_live_joined_a_running_job_and_does_not_wait():
    recovery = LiveRecovery(None, 1, say_each=False)

    class Recovering(Alone):
        def start_quorum(self) -> None:  # a quorum in which torchft hands this group a live peer's state
            super().start_quorum()
            recovery.loads += 1

    assert attempt(lone_group(join_timeout=60, manager=Recovering(), recovery=recovery))  # no wait for 2 groups
