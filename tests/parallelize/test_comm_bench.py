"""scripts/comm_bench.sh as a user runs it: two gloo ranks, tiny sizes, one table, JSON rows whose every result
checked out; bad arguments get one line before torchrun starts."""

from __future__ import annotations

import importlib.util
import json
import subprocess

import pytest

from tests.e2e.run_train_helpers import REPO, user_env

spec = importlib.util.spec_from_file_location("comm_bench", REPO / "scripts" / "comm_bench.py")
comm_bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(comm_bench)

KEYS = {"op", "bytes", "world_size", "time_s", "algbw_gbps", "busbw_gbps", "ok"}


def comm_bench_sh(*args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    return subprocess.run(["./scripts/comm_bench.sh", *args], cwd=REPO, env=user_env(NPROC=str(nproc)),
                          capture_output=True, text=True, timeout=180)


@pytest.mark.multiprocess
def test_two_ranks_time_and_check_every_op(tmp_path):
    out = tmp_path / "rows.json"
    # 4K: a round size; 1000 B: not a power of two; 12 B: fewer float32 elements per rank than some ops split into.
    result = comm_bench_sh("--sizes", "4K,1000,12", "--iters", "2", "--warmup", "1", "--json", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(row["op"], row["bytes"]) for row in rows] == [
        (op, size) for op in comm_bench.OPS
        # The split ops move a whole number of elements per rank: 12 B is 3 elements, 1 per rank on 2 ranks.
        for size in ((4096, 1000, 12) if op.endswith("all_reduce") else (4096, 1000, 8))
    ]
    for row in rows:
        assert set(row) == KEYS and row["world_size"] == 2 and row["ok"] is True, row
        assert row["time_s"] > 0 and row["algbw_gbps"] == pytest.approx(row["bytes"] / row["time_s"] / 1e9)
        # n = 2: an all-reduce moves 2(n-1)/n = 1 times its size per rank, the other ops (n-1)/n = 1/2.
        factor = 1.0 if row["op"].endswith("all_reduce") else 0.5
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * factor)
    table = [line for line in result.stdout.splitlines() if line.startswith("|")]
    assert len(table) == 2 + len(rows) and table[0].startswith("| op | size | bytes | ranks | time (us) |")
    assert result.stdout.count("| op |") == 1 and all(line.endswith("| yes |") for line in table[2:])
    assert "| all_gather | 12 | 8 |" in result.stdout  # the size asked for, and the bytes moved


@pytest.mark.parametrize("args, message", [
    (["--ops", "all_reduce,allgather"], "error: --ops: unknown op 'allgather' (did you mean all_gather? choose from "
     "all_reduce, ring_all_reduce, all_gather, reduce_scatter, all_to_all)"),
    (["--sizes", "4K,6"], "error: --sizes: '6' is not a positive whole number of float32 elements (4 bytes each)"),
    (["--sizes", "1MB"], "error: --sizes: '1MB' is not a size (bytes, or a number with K, M or G: 4K, 1M, 64M)"),
    (["--iters", "0"], "error: --iters must be >= 1 and --warmup >= 0 (got 0 and 5)"),
    (["--json", "/nonexistent/rows.json"], "error: --json: folder '/nonexistent' does not exist"),
])
def test_bad_arguments_get_one_line_before_any_rank_starts(args, message):
    result = comm_bench_sh(*args)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [message]  # nothing from torchrun: it never started


def test_sizes_read_as_nccl_tests_does_and_bus_factors():
    assert [comm_bench.parse_size(s) for s in ("4K", "1m", "64M", "1G", "4096")] == [
        4096, 2**20, 64 * 2**20, 2**30, 4096
    ]
    assert comm_bench.bus_factor("all_reduce", 8) == comm_bench.bus_factor("ring_all_reduce", 8) == 2 * 7 / 8
    assert comm_bench.bus_factor("all_gather", 4) == comm_bench.bus_factor("all_to_all", 4) == 3 / 4
    assert comm_bench.bus_factor("reduce_scatter", 1) == 0.0
