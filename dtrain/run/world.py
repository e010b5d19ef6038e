"""The distributed world a run lives in: process group from torchrun's environment, device, and teardown.

One process without torchrun is a world of one with no process group at all, so single-device runs never
touch torch.distributed's rendezvous.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtrain.reliability.parent_watch import exit_when_orphaned

STORE_FILE_ENV = "DTRAIN_STORE_FILE"

if TYPE_CHECKING:  # importing parallelize would load FSDP and TP for every CLI call
    from dtrain.parallelize.mesh import ParallelMesh


@dataclass(frozen=True)
class World:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def set_collective_timeout(seconds: int) -> None:
    """Give every process group of this process (the world, the mesh's, checkpointing's) a new timeout.

    Start-up may legitimately take long (loading, compilation), training steps may not: torchtitan lowers the
    timeout after the first step the same way. torch offers no public setter; `_set_pg_timeout` is what it uses.
    """
    from torch.distributed.distributed_c10d import _set_pg_timeout, _world

    for group in list(_world.pg_map):
        _set_pg_timeout(timedelta(seconds=seconds), group)


def is_timeout(err: BaseException) -> bool:
    """Whether `err` is a collective that gave up waiting (gloo and NCCL word it differently)."""
    text = str(err).lower()
    return isinstance(err, (RuntimeError, dist.DistError)) and ("timed out" in text or "timeout" in text)


def world_size_from_env() -> int:
    """The world size torchrun announced (1 when started directly)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def pick_device(local_rank: int) -> torch.device:
    """One CUDA device per local rank when CUDA exists, else the CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    """gloo on CPU; on CUDA, NCCL for GPU tensors plus gloo for host tensors (FSDP CPU offload keeps shards and
    gradients on the host, so clipping their norm all-reduces CPU tensors)."""
    return "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"


def join_process_group(backend: str, world_size: int, timeout: timedelta) -> None:
    """Join the default process group through torchrun's TCP store, or through a file store where run_train.sh
    names one (DTRAIN_STORE_FILE, single-node runs: no socket then listens beyond loopback).

    A file store's keys outlive a failed attempt, so each restart (torchrun --max-restarts) gets its own file,
    or the restarted workers would read their peers' addresses from the attempt that failed.
    """
    store_file = os.environ.get(STORE_FILE_ENV)
    if not store_file:
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.FileStore(f"{store_file}-{attempt}", world_size)
    store.set_timeout(timeout)
    dist.init_process_group(
        backend=backend, store=store, rank=int(os.environ["RANK"]), world_size=world_size, timeout=timeout
    )


@contextlib.contextmanager
def init_world(timeout_s: int = 600) -> Iterator[World]:
    """Join the process group (NCCL on CUDA, gloo on CPU) for the duration of the run and always leave it."""
    world_size = world_size_from_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(local_rank)
    if world_size > 1:
        exit_when_orphaned()
        join_process_group(backend_for(device), world_size, timedelta(seconds=timeout_s))
    try:
        yield World(int(os.environ.get("RANK", "0")), local_rank, world_size, device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def dp_rank_and_size(mesh: ParallelMesh | None) -> tuple[int, int]:
    """This rank's index among the data-parallel ranks and their number: how the dataloader splits the batch."""
    if mesh is None:
        return 0, 1
    dp = mesh["dp"]
    return dp.get_local_rank(), dp.size()


def sum_over_dp(tensor: torch.Tensor, mesh: ParallelMesh | None) -> torch.Tensor:
    """The sum of `tensor` over the ranks that hold different tokens of the global batch (data × context
    parallel), as a new plain tensor (the input is left alone).

    A DTensor (a loss under loss parallel is replicated over the TP ranks) is made whole first; that costs no
    communication for a replicated value.
    """
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    if mesh is None or mesh["dp_cp"].size() == 1:
        return tensor.clone()
    total = tensor.clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=mesh["dp_cp"].get_group())
    return total


def dp_summer(mesh: ParallelMesh | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """`sum_over_dp` bound to `mesh`: what TrainState.reduce_over_dp expects."""
    return functools.partial(sum_over_dp, mesh=mesh)
