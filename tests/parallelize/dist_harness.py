"""Run a function in a fresh world of gloo processes and collect what rank 0 returns.

Each world starts once and runs many layouts: the tiny models cost milliseconds, importing torch and the
distributed stack costs seconds per process. Ranks are therefore forked from a forkserver that imported all of
that once per test session (a fresh, single-threaded process: safe to fork, unlike pytest itself), so a 4-rank
world starts in about a second instead of ten. Rendezvous goes through a FileStore in a temporary folder, so
parallel test sessions never race for a port. Results come back through a file written with torch.save
(tensors through multiprocessing queues break once the child exits).

Each rank writes its stdout and stderr to a file in that folder: a rank that dies in C++ (gloo's SIGABRT) leaves
no Python traceback, and its own last lines are the only account of why, so a failure shows every rank's tail.
"""

from __future__ import annotations

import os
import tempfile
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PROCESS_GROUP_TIMEOUT_S = 120
PRELOAD = ["torch", "torch.distributed.tensor.parallel", "torch.distributed.fsdp", "dtrain.parallelize", "dtrain.step.train_step"]


def _entry(rank: int, world_size: int, folder: str, fn: Callable, args: tuple, backend: str) -> None:
    log = os.open(os.path.join(folder, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    if backend == "nccl":  # one GPU per rank
        torch.cuda.set_device(rank)
    store = dist.FileStore(os.path.join(folder, "store"), world_size)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S)
    )
    try:
        result = fn(rank, world_size, *args)
        if rank == 0:
            torch.save(result, os.path.join(folder, "result.pt"))
        _wait_for_all(store, world_size)
    finally:
        dist.destroy_process_group()


def _wait_for_all(store: dist.Store, world_size: int) -> None:
    """Return once every rank has finished its function, so that none tears its connections down while another
    still works (a peer closing under a pending gloo operation aborts the process that waits: SIGABRT, seen on a
    loaded CI machine). Through the store, not a collective: a test may have lowered the groups' timeouts."""
    store.add("finished", 1)
    deadline = time.monotonic() + PROCESS_GROUP_TIMEOUT_S
    while store.add("finished", 0) < world_size and time.monotonic() < deadline:
        time.sleep(0.01)


def run_world(world_size: int, fn: Callable, *args: Any, timeout_s: float = 240, backend: str = "gloo") -> Any:
    """Spawn `world_size` ranks running `fn(rank, world_size, *args)`; return rank 0's result.

    A rank that fails re-raises here with its traceback; a world that hangs is killed after `timeout_s`.
    """
    # Takes effect when the session's forkserver starts (at the first world); later calls change nothing.
    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory() as folder:
        context = mp.start_processes(
            _entry,
            args=(world_size, folder, fn, args, backend),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        deadline = time.monotonic() + timeout_s
        try:
            # join returns False while some rank still runs, and raises (with its traceback) if one failed.
            while not context.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"world of {world_size} did not finish in {timeout_s} s")
        except Exception as error:
            raise RuntimeError(f"{error}\n{_rank_log_tails(folder, world_size)}") from error
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        return torch.load(os.path.join(folder, "result.pt"), weights_only=False)


def _rank_log_tails(folder: str, world_size: int, lines: int = 30) -> str:
    tails = []
    for rank in range(world_size):
        path = os.path.join(folder, f"rank{rank}.log")
        text = open(path, errors="replace").read() if os.path.exists(path) else ""
        tail = "\n".join(text.splitlines()[-lines:]) or "(nothing)"
        tails.append(f"--- rank {rank}, last lines of its output ---\n{tail}")
    return "\n".join(tails)
