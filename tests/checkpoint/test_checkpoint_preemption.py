"""Preemption: a signal sets a flag the loop polls; in a world of processes all ranks stop after the same step."""

from __future__ import annotations

import os
import signal

import pytest
import torch.distributed as dist
from dist_harness import run_world

from dtrain.checkpoint import PreemptionWatcher


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_signal_stops_after_the_current_step_and_handlers_are_restored(sig):
    before = signal.getsignal(sig)
    watcher = PreemptionWatcher()
    try:
        assert not watcher.should_stop(1)
        os.kill(os.getpid(), sig)
        assert watcher.should_stop(2) and watcher.should_stop(3)
        assert watcher.received == signal.Signals(sig).name
        assert signal.getsignal(sig) == signal.SIG_DFL  # a second signal is not caught: it acts at once
    finally:
        watcher.close()
    assert signal.getsignal(sig) == before


def test_check_every_must_be_positive():
    with pytest.raises(ValueError, match="check_every"):
        PreemptionWatcher(check_every=0)


def stop_steps(rank: int, world_size: int, signalled_rank: int, signal_step: int, check_every: int) -> list:
    """Every rank's stop step when only `signalled_rank` gets SIGUSR1, during step `signal_step`."""
    watcher = PreemptionWatcher(world_size, check_every=check_every)
    stopped = None
    for step in range(1, 20):
        if rank == signalled_rank and step == signal_step:
            os.kill(os.getpid(), signal.SIGUSR1)
        if watcher.should_stop(step):
            stopped = step
            break
    watcher.close()
    steps = [None] * world_size
    dist.all_gather_object(steps, stopped)
    return steps


@pytest.mark.multiprocess
def test_all_ranks_stop_after_the_same_step():
    # One check to exchange the flags (without waiting), one to read them: the stop comes at the next check.
    assert run_world(2, stop_steps, 1, 3, 1) == [4, 4]
