"""The multi-process harness: a rank that dies in C++ (no Python traceback) is explained by its own last lines."""

from __future__ import annotations

import os

import pytest

from dist_harness import run_world

pytestmark = [pytest.mark.multiprocess]


def _abort_on_rank_1(rank: int, world_size: int) -> int:
    print(f"rank {rank} reached the abort", flush=True)
    if rank == 1:
        os.abort()  # what gloo does when a peer closes under a pending operation
    return rank


def test_a_rank_that_aborts_is_reported_with_the_last_lines_of_every_rank():
    with pytest.raises(RuntimeError) as raised:
        run_world(2, _abort_on_rank_1, timeout_s=60)
    message = str(raised.value)
    assert "process 1 terminated with signal SIGABRT" in message
    assert "--- rank 1, last lines of its output ---\nrank 1 reached the abort" in message
