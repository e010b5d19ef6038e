"""Peak memory of this rank: the accelerator's allocator on GPUs, the process's resident set on CPU."""

from __future__ import annotations

import resource
import sys

import torch

GIB = 1024**3


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory this process has used on ``device`` since it started, in GiB.

    CUDA: the most memory PyTorch's caching allocator has handed out to tensors (``max_memory_allocated``);
    memory it reserves but has not allocated is not counted. CPU: the process's peak resident set size, which
    includes the Python interpreter and libraries as well as tensors, since CPU tensors have no separate allocator
    statistics.
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # getrusage reports ru_maxrss in bytes on macOS and in KiB on Linux and the other Unixes.
    rss_bytes = max_rss if sys.platform == "darwin" else max_rss * 1024
    return rss_bytes / GIB
