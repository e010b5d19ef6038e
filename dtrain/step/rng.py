"""Explicit randomness: every random stream is derived from (seed, purpose, step, mesh coordinates).

Deriving instead of carrying one global generator means a result never depends on how many steps ran in this
process, and a resumed run continues the same streams (docs/architecture.md, "Following one step").
"""

from __future__ import annotations

import hashlib
import os

import torch


def derive_seed(seed: int, *keys: object) -> int:
    """A stable 63-bit seed for `keys` (e.g. "init", or "step", 12, "dp", 1) under the run's `seed`."""
    text = repr((seed, *keys)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def seed_everything(seed: int, *keys: object) -> None:
    """Seed torch's CPU and CUDA default generators from `derive_seed(seed, *keys)`."""
    torch.manual_seed(derive_seed(seed, *keys))


def set_determinism(deterministic: bool, warn_only: bool = False) -> None:
    """Ask torch for deterministic kernels (bit-identical runs on GPU too) when `deterministic` is set; with
    `warn_only`, an op that has no deterministic kernel warns instead of raising.

    CPU training is bit-identical for the same seed without this; on CUDA it costs speed, so it is opt-in.
    """
    if not deterministic:
        return
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    # cuBLAS needs a fixed workspace to be deterministic; it must be set before the first cuBLAS call.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
