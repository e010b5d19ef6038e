"""Benchmark: the collectives that data, tensor, context and expert parallel spend their communication on, and the
reference ring all-reduce (scripts/ring_all_reduce.py), timed per message size over every rank of the world.

    NPROC=4 ./scripts/comm_bench.sh
    NPROC=8 ./scripts/comm_bench.sh --ops all_reduce,all_gather --sizes 1M,64M,1G --iters 50 --json bench.json

Each op and size: `--warmup` untimed calls, then `--iters` calls between two synchronisations of every rank (a
tiny all-reduce plus, on CUDA, a device synchronize), timed on the host; the time per call is the slowest rank's.
Then one more call on fresh inputs whose expected result is known exactly (small integers in float32) is checked on
every rank: the `ok` column. Bandwidths are nccl-tests': algbw = bytes / time, busbw = algbw times 2(n-1)/n for an
all-reduce and (n-1)/n for all-gather, reduce-scatter and all-to-all, in GB/s (10^9 bytes per second). A size is
the bytes of float32 elements in the op's largest buffer (nccl-tests' convention: the all-reduce buffer, the
gathered output, the scattered input, the all-to-all send buffer), rounded to a whole number of elements per rank.
docs/collectives.md explains the figures; gloo on CPU, NCCL on GPUs (one per local rank), chosen automatically.
"""

from __future__ import annotations

import _repo_env  # noqa: F401  (first: re-runs this script in the repository's .venv when needed)

import argparse
import difflib
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

OPS = ("all_reduce", "ring_all_reduce", "all_gather", "reduce_scatter", "all_to_all")
UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}  # nccl-tests' sizes: powers of two
ELEMENT_BYTES = 4  # float32
# comm_bench.sh runs the argument check once before torchrun; ANSWERED means it answered (--help): do not launch.
CHECK_FLAG = "--check_args"
ANSWERED = 3
# Under comm_bench.sh, wrong results are reported through this file rather than a failing rank, so that the run
# ends with the error line and exit status 1 instead of torchrun's failure report.
WRONG_FILE_ENV = "COMM_BENCH_WRONG_FILE"


class UsageError(Exception):
    """A bad argument: printed as one line, before any process group exists."""


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw: what each rank's link carries per byte of the op's size, under the optimal algorithm."""
    return 2 * (n - 1) / n if op in ("all_reduce", "ring_all_reduce") else (n - 1) / n


def parse_size(text: str) -> int:
    match = re.fullmatch(r"(\d+)([KMG]?)", text.strip(), flags=re.IGNORECASE)
    if not match:
        raise UsageError(f"--sizes: {text!r} is not a size (bytes, or a number with K, M or G: 4K, 1M, 64M)")
    size = int(match.group(1)) * UNITS[match.group(2).upper()]
    if size == 0 or size % ELEMENT_BYTES:
        raise UsageError(f"--sizes: {text!r} is not a positive whole number of float32 elements (4 bytes each)")
    return size


def parse_ops(text: str) -> list[str]:
    ops = []
    for name in (part.strip() for part in text.split(",")):
        if name not in OPS:
            close = difflib.get_close_matches(name, OPS, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise UsageError(f"--ops: unknown op {name!r} ({hint}choose from {', '.join(OPS)})")
        if name not in ops:
            ops.append(name)
    return ops


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own errors (a missing value, an unknown flag) as one line too
        raise UsageError(message)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = _Parser(prog="comm_bench.sh", description="Time collectives per message size on every rank.")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, from {', '.join(OPS)} (default: all)")
    parser.add_argument("--sizes", default="4K,1M,64M", help="bytes of float32 data per op, K/M/G = 2^10/2^20/2^30")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per op and size")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls before them")
    parser.add_argument("--json", type=Path, help="also write the rows to this file (a JSON list)")
    parser.add_argument(CHECK_FLAG, action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.ops = parse_ops(args.ops)
    args.sizes = [parse_size(part) for part in args.sizes.split(",")]
    if args.iters < 1 or args.warmup < 0:
        raise UsageError(f"--iters must be >= 1 and --warmup >= 0 (got {args.iters} and {args.warmup})")
    if args.json is not None and not args.json.parent.is_dir():
        raise UsageError(f"--json: folder {str(args.json.parent)!r} does not exist")
    return args


def human(size: int) -> str:
    for suffix, unit in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if size % unit == 0:
            return f"{size // unit}{suffix}"
    return str(size)


def table(rows: list[dict], sizes: list[int]) -> str:
    """The rows as markdown; `sizes` are the sizes asked for, row by row (a row's bytes are what the op moved)."""
    lines = [
        "| op | size | bytes | ranks | time (us) | algbw (GB/s) | busbw (GB/s) | ok |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row, size in zip(rows, sizes):
        lines.append(
            f"| {row['op']} | {human(size)} | {row['bytes']:,} | {row['world_size']} | "
            f"{row['time_s'] * 1e6:,.1f} | {row['algbw_gbps']:.3f} | {row['busbw_gbps']:.3f} | "
            f"{'yes' if row['ok'] else 'NO'} |"
        )
    return "\n".join(lines)


# --- the part that runs on every rank --------------------------------------------------------------------------


def pattern(rank, index):
    """What rank `rank` holds at element `index` of an input: small integers, exact in float32 under any sum of
    up to thousands of ranks, and different per rank and position so that a misplaced chunk shows."""
    return (index % 251 + rank + 1).float()


def pattern_sum(n: int, index):
    """The sum of `pattern(rank, index)` over ranks 0..n-1, without materialising n copies."""
    return (n * (index % 251) + n * (n + 1) // 2).float()


def make_case(op: str, size: int, n: int, rank: int, device) -> tuple[int, Callable[[], None], Callable[[], bool]]:
    """(bytes the op moves, one call of the op, a check: re-fill the inputs, call once, compare with the exact
    expected result)."""
    import torch
    import torch.distributed as dist
    from ring_all_reduce import ring_all_reduce

    def arange(count, start=0):
        return torch.arange(start, start + count, device=device)

    # torch 2.13 renamed the tensor forms and deprecates the old names, the only ones torch 2.11 has.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    ranks = torch.arange(n, device=device).view(n, 1)
    elements = size // ELEMENT_BYTES
    # The split ops cut their largest buffer into one block per rank: a whole number of elements each.
    block = max(1, elements // n)
    if op in ("all_reduce", "ring_all_reduce"):
        nbytes = elements * ELEMENT_BYTES
        source = output = pattern(rank, arange(elements))  # in place
        expected = pattern_sum(n, arange(elements))
        reduce = dist.all_reduce if op == "all_reduce" else ring_all_reduce

        def call():
            reduce(output)
    elif op == "all_gather":
        nbytes = n * block * ELEMENT_BYTES
        source, output = pattern(rank, arange(block)), torch.empty(n * block, device=device)
        expected = pattern(ranks, arange(block)).view(-1)  # block k comes from rank k

        def call():
            all_gather(output, source)
    elif op == "reduce_scatter":
        nbytes = n * block * ELEMENT_BYTES
        source, output = pattern(rank, arange(n * block)), torch.empty(block, device=device)
        expected = pattern_sum(n, arange(block, rank * block))  # our block, summed over the ranks

        def call():
            reduce_scatter(output, source)
    else:  # all_to_all: block k of our send buffer goes to rank k; block k of the output comes from rank k
        nbytes = n * block * ELEMENT_BYTES
        source, output = pattern(rank, arange(n * block)), torch.empty(n * block, device=device)
        expected = pattern(ranks, arange(block, rank * block)).view(-1)

        def call():
            dist.all_to_all_single(output, source)

    pristine = source.clone()  # the timed calls may have reduced an in-place buffer many times over

    def check() -> bool:
        source.copy_(pristine)
        if output is not source:
            output.fill_(-1)  # nothing left over from the timed calls can pass for a result
        call()
        return torch.equal(output, expected)

    return nbytes, call, check


def measure(op: str, size: int, args, world, device) -> dict:
    import torch
    import torch.distributed as dist

    nbytes, call, check = make_case(op, size, world.world_size, world.rank, device)
    for _ in range(args.warmup):
        call()
    _line_up(device)
    started = time.perf_counter()
    for _ in range(args.iters):
        call()
    _synchronize(device)
    per_call = (time.perf_counter() - started) / args.iters
    mine = torch.tensor([per_call, float(check())], device=device, dtype=torch.float64)
    slowest, all_ok = mine.clone(), mine.clone()
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a collective is done when its last rank is
    dist.all_reduce(all_ok, op=dist.ReduceOp.MIN)  # ok only where every rank's result was right
    time_s = slowest[0].item()
    algbw = nbytes / time_s / 1e9
    return {"op": op, "bytes": nbytes, "world_size": world.world_size, "time_s": time_s, "algbw_gbps": algbw,
            "busbw_gbps": algbw * bus_factor(op, world.world_size), "ok": bool(all_ok[1].item())}


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _line_up(device) -> None:
    """Every rank here, with nothing queued on its device: the timer then starts together on every rank."""
    import torch
    import torch.distributed as dist

    _synchronize(device)
    dist.all_reduce(torch.zeros(1, device=device))
    _synchronize(device)


def join_world():
    """This process's World in a process group: torchrun's (comm_bench.sh), or a world of one when started with
    plain python."""
    from datetime import timedelta

    import torch.distributed as dist

    from dtrain.run.world import World, backend_for, join_process_group, pick_device

    timeout = timedelta(seconds=300)
    if "RANK" in os.environ:
        world_size, local_rank = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))
        device = pick_device(local_rank)
        join_process_group(backend_for(device), world_size, timeout)
        return World(int(os.environ["RANK"]), local_rank, world_size, device)
    device = pick_device(0)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="comm_bench"), "store"), 1)
    dist.init_process_group(backend_for(device), store=store, rank=0, world_size=1, timeout=timeout)
    return World(0, 0, 1, device)


def run(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    world = join_world()
    try:
        rows = [measure(op, size, args, world, world.device) for op in args.ops for size in args.sizes]
    finally:
        dist.destroy_process_group()
    if world.rank != 0:
        return 0
    backend = "NCCL" if world.device.type == "cuda" else "gloo"
    ranks = f"{world.world_size} rank{'s' if world.world_size > 1 else ''}"
    print(f"{backend}, {ranks} on {world.device.type}, {args.iters} timed calls after {args.warmup} warm-up calls; "
          "time per call of the slowest rank")
    print(table(rows, [size for _ in args.ops for size in args.sizes]))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    wrong = [f"{row['op']} {row['bytes']} bytes" for row in rows if not row["ok"]]
    if not wrong:
        return 0
    print(f"error: wrong results from {', '.join(wrong)}", file=sys.stderr)
    if os.environ.get(WRONG_FILE_ENV):
        Path(os.environ[WRONG_FILE_ENV]).touch()
        return 0
    return 1


def main(argv: list[str]) -> int:
    try:
        args = parse_args(argv)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except SystemExit as done:  # --help
        return ANSWERED if CHECK_FLAG in argv and done.code == 0 else done.code
    if args.check_args:
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
