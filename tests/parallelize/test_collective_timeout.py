"""A hung collective ends the run: after the first step every process group's timeout drops to
comm.train_timeout_seconds, so a rank waiting on a dead or hung peer raises instead of waiting forever."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from dist_harness import run_world

from dtrain.run.world import is_timeout, set_collective_timeout


def wait_on_a_silent_peer(rank: int, world_size: int):
    group = dist.new_group(backend="gloo")  # as the mesh's and checkpointing's groups are made
    set_collective_timeout(1)
    if rank == 1:
        time.sleep(4)  # hung: never joins the all-reduce
        return None
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=group)
    except Exception as err:  # gloo raises a RuntimeError subclass
        return time.monotonic() - started, is_timeout(err)
    return None


def test_a_silent_peer_times_out_at_the_lowered_timeout():
    waited, recognised = run_world(2, wait_on_a_silent_peer)
    # The world's own timeout is 120 s: only the lowered one explains giving up this soon.
    assert waited < 3.5 and recognised
