"""The distributed world a run lives in: process group from torchrun's environment, device, and teardown.

One process without torchrun is a world of one with no process group at all, so single-device runs never
touch torch.distributed's rendezvous.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def world_size_from_env() -> int:
    """The world size torchrun announced (1 when started directly)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def pick_device(local_rank: int) -> torch.device:
    """One CUDA device per local rank when CUDA exists, else the CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


@contextlib.contextmanager
def init_world(timeout_s: int = 600) -> Iterator[World]:
    """Join the process group (NCCL on CUDA, gloo on CPU) for the duration of the run and always leave it."""
    world_size = world_size_from_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(local_rank)
    if world_size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    try:
        yield World(int(os.environ.get("RANK", "0")), local_rank, world_size, device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
