"""Reading a DCP checkpoint's tensors at start-up: any failure of a checkpoint that looked intact is a `LoadFailed`,
which the start-up may fall back from (checkpoint.fallback_to_previous)."""

from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from dtrain.checkpoint import dcp_io
from dtrain.checkpoint.checksums import ChecksumMismatch
from dtrain.checkpoint.folders import DamagedCheckpoint
from dtrain.checkpoint.safe_reading import UnsafeCheckpoint
from dtrain.errors import DtrainError


class LoadFailed(DtrainError):
    """Reading a checkpoint that looked intact failed; with fallback_to_previous the one before it is tried."""


def read_dcp(wanted: dict, path: Path) -> None:
    """Fill `wanted` (a state dict, sharded as this rank holds it) from the DCP checkpoint at `path`."""
    try:
        dcp_io.load(wanted, path)
    except (UnsafeCheckpoint, ChecksumMismatch, DamagedCheckpoint) as err:
        # Nothing ran; like any unreadable checkpoint it may be fallen back from (checkpoint.fallback_to_previous).
        raise LoadFailed(f"cannot load checkpoint {path}: {err}") from None
    except (Exception, CheckpointException) as err:
        if isinstance(err, DtrainError):
            raise
        raise LoadFailed(f"cannot load checkpoint {path}: {dcp_io.failure_summary(err)}") from None
