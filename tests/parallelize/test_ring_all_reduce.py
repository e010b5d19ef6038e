"""The reference ring all-reduce (scripts/ring_all_reduce.py) equals dist.all_reduce: every group size 2..8, sizes that
n does not divide, sizes below n and empty tensors, sub-groups of scattered ranks, exact integers, every op.

One world of 8 gloo ranks runs everything (a world costs seconds on 2 cores, a sub-group milliseconds): groups of
2..7 ranks are built with new_group inside it and the 8th is the world itself, so the default group is covered too.
Every rank's results come back to the test, since a ring bug can leave one rank's copy wrong and not another's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_world

# The ring all-reduce is teaching code beside the benchmark that times it (scripts/comm_bench.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from ring_all_reduce import ring_all_reduce  # noqa: E402

pytestmark = pytest.mark.multiprocess

WORLD = 8
SCATTERED = [1, 3, 4, 6]  # a sub-group whose ranks are not 0..k-1: group ranks must map to global ranks
FP32_TOL = dict(rtol=1e-5, atol=1e-5)  # ≤ 8 N(0, 1) addends in another order: a few ulps apart


def numels(n: int) -> list[int]:
    """Empty, fewer elements than ranks, around n, a size n does not divide, and a larger odd one."""
    return sorted({0, 1, n - 1, n, n + 1, 3 * n + 2, 1031})


def values(rank: int, seed: int, numel: int, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=gen, dtype=torch.float64).to(dtype)
    return torch.randint(-(2**40), 2**40, (numel,), generator=gen).to(dtype)


def ring_and_library(x: torch.Tensor, group=None, op=dist.ReduceOp.SUM) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(ring result, dist.all_reduce result, whether the ring reduced in place and returned its argument)."""
    ring = x.clone()
    returned = ring_all_reduce(ring, op=op, group=group)
    library = x.clone()
    dist.all_reduce(library, op=op, group=group)
    return ring, library, returned is ring


def every_case(rank: int, world_size: int) -> list[dict]:
    mine: dict = {"sizes": {}, "scattered": {}, "ops": {}, "errors": []}
    for n in range(2, world_size + 1):
        # new_group is collective over the whole world: every rank calls it, members or not.
        group = None if n == world_size else dist.new_group(list(range(n)))
        if rank >= n:
            continue
        for numel in numels(n):
            mine["sizes"][n, numel] = ring_and_library(values(rank, n * 10_000 + numel, numel), group)
        # A 2-D tensor keeps its shape; float64 and int64 on the same group.
        mine["sizes"][n, "2d"] = ring_and_library(values(rank, n, 15).view(3, 5), group)
        mine["sizes"][n, "float64"] = ring_and_library(values(rank, n, 37, torch.float64), group)
        mine["sizes"][n, "int64"] = ring_and_library(values(rank, n, 37, torch.int64), group)

    scattered = dist.new_group(SCATTERED)
    if rank in SCATTERED:
        for numel in (0, 3, 4, 5, 103):
            mine["scattered"][numel] = ring_and_library(values(rank, numel, numel, torch.int64), scattered)
        mine["scattered"]["float32"] = ring_and_library(values(rank, 7, 1031), scattered)
    else:
        try:
            ring_all_reduce(torch.zeros(4), group=scattered)
        except ValueError as err:
            mine["errors"].append(str(err))

    for op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT):
        mine["ops"][str(op)] = ring_and_library(values(rank, 3, 29), None, op)
    avg = values(rank, 4, 29)
    mine["ops"]["AVG"] = (ring_all_reduce(avg.clone(), op=dist.ReduceOp.AVG), sum_over_world(avg) / world_size, True)
    # gloo's all_reduce rejects int16; the ring only sends and adds, so it takes it.
    small = torch.arange(11, dtype=torch.int16) * (rank + 1)
    mine["ops"]["int16"] = (ring_all_reduce(small.clone()), torch.arange(11, dtype=torch.int16) * 36, True)

    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, mine)
    return everyone


def sum_over_world(x: torch.Tensor) -> torch.Tensor:
    total = x.clone()
    dist.all_reduce(total)
    return total


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    return run_world(WORLD, every_case, timeout_s=180)


def test_equals_all_reduce_for_every_group_size_and_uneven_sizes(per_rank):
    for n in range(2, WORLD + 1):
        for key in [*numels(n), "2d", "float64", "int64"]:
            ring0 = per_rank[0]["sizes"][n, key][0]
            for rank in range(n):
                ring, library, in_place = per_rank[rank]["sizes"][n, key]
                assert in_place and ring.shape == library.shape and ring.dtype == library.dtype, (n, key, rank)
                if key == "int64":
                    assert torch.equal(ring, library), (n, rank)  # integers: exact whatever the order
                else:
                    torch.testing.assert_close(ring, library, **FP32_TOL, msg=f"group of {n}, {key}, rank {rank}")
                # Each chunk is reduced on one rank and copied to the others: every rank holds the same bits.
                assert torch.equal(ring, ring0), (n, key, rank)


def test_a_sub_group_of_scattered_ranks_reduces_over_its_members_only(per_rank):
    members = [per_rank[rank]["scattered"] for rank in SCATTERED]
    for key in (0, 3, 4, 5, 103):
        expected = sum(values(rank, key, key, torch.int64) for rank in SCATTERED)
        for ring, library, _ in (member[key] for member in members):
            assert torch.equal(ring, expected) and torch.equal(library, expected), key
    for ring, library, _ in (member["float32"] for member in members):
        torch.testing.assert_close(ring, library, **FP32_TOL)
    outsiders = [rank for rank in range(WORLD) if rank not in SCATTERED]
    for rank in outsiders:
        assert per_rank[rank]["errors"] == [f"ring_all_reduce called on global rank {rank}, which is not in the group"]


def test_max_min_product_avg_and_a_dtype_gloo_cannot_all_reduce(per_rank):
    for rank in range(WORLD):
        for op, (ring, expected, _) in per_rank[rank]["ops"].items():
            if op == "int16":
                assert torch.equal(ring, expected)
            else:
                torch.testing.assert_close(ring, expected, **FP32_TOL, msg=f"{op} on rank {rank}")


@pytest.mark.parametrize("call, error, message", [
    (lambda: ring_all_reduce(torch.zeros(4, 6).t()), ValueError,
     "ring_all_reduce needs a contiguous tensor (shape (6, 4), strides (1, 6)): reduce t.contiguous() and copy "
     "the result back"),
    (lambda: ring_all_reduce(torch.zeros(4), op=dist.ReduceOp.BAND), ValueError,
     "ring_all_reduce supports ReduceOp SUM, AVG, PRODUCT, MIN and MAX, not RedOpType.BAND"),
    (lambda: ring_all_reduce(torch.zeros(4, dtype=torch.int32), op=dist.ReduceOp.AVG), ValueError,
     "ring_all_reduce with AVG needs a floating-point tensor, not torch.int32 (use SUM)"),
    (lambda: ring_all_reduce([1.0, 2.0]), TypeError, "ring_all_reduce needs a torch.Tensor, not list"),
    (lambda: ring_all_reduce(torch.zeros(4)), RuntimeError,
     "ring_all_reduce needs a process group: call torch.distributed.init_process_group first"),
])
def test_misuse_gets_one_line(monkeypatch, call, error, message):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)  # whatever other tests left in this process
    with pytest.raises(error) as raised:
        call()
    assert str(raised.value) == message
