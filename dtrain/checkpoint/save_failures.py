"""One line for a failed save: where it was writing, and for the usual causes (a full disk above all) what to do.

A full disk does not always arrive as ENOSPC: torch's zip writer (used for every tensor DCP writes) reports a short
write as `RuntimeError: [enforce fail at inline_container.cc:...] . unexpected pos ...`, with no errno. So the
exception chain is searched for an errno, torch's writer failure is recognised by its message, and the free space
of the checkpoint's file system is read at the moment of failure.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from dtrain.checkpoint import dcp_io
from dtrain.errors import DtrainError

_FULL = (
    "the disk is full ({free} bytes free on its file system): free some, lower checkpoint.keep_latest_k, "
    "or move job.dump_folder"
)
# What a failed save most often means, by an errno anywhere in the exception chain.
_SAVE_HINTS = {
    errno.ENOSPC: _FULL,
    errno.EDQUOT: "disk quota exceeded ({free} bytes free on its file system): free some, or move job.dump_folder",
    errno.EROFS: "its file system is read-only: move job.dump_folder",
    errno.EACCES: "permission denied: make the folder writable, or move job.dump_folder",
}
# torch's PyTorchFileWriter failing a write (inline_container.cc), as a full disk makes it.
_TORCH_SHORT_WRITE = "unexpected pos"
# Below this share of the file system free, a failed write is taken for a full disk (the failed write itself was
# larger than what is left; f_bavail, what a non-root user may still write).
_FULL_FRACTION = 0.01


def _chain(err: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    while err is not None and all(err is not e for e in seen):
        seen.append(err)
        err = err.__cause__ or err.__context__
    return seen


def free_bytes(folder: Path) -> tuple[int, int] | None:
    """(free, total) bytes of the file system holding `folder` (its nearest existing parent), or None."""
    for candidate in (folder, *folder.parents):
        if candidate.exists():
            try:
                usage = shutil.disk_usage(candidate)
            except OSError:
                return None
            return usage.free, usage.total
    return None


def save_failed(partial: Path, what: str, err: BaseException) -> DtrainError:
    """One line for a failed save, naming where it was writing and, for the usual causes, what to do."""
    _, cause = dcp_io.first_failure(err)
    chain = _chain(cause) + ([] if cause is err else _chain(err))
    code = next((e.errno for e in chain if getattr(e, "errno", None) in _SAVE_HINTS), None)
    space = free_bytes(partial)
    free = "unknown" if space is None else space[0]
    if code is not None:
        detail = _SAVE_HINTS[code].format(free=free)
    elif any(_TORCH_SHORT_WRITE in str(e) for e in chain):
        nearly_full = space is not None and space[0] <= space[1] * _FULL_FRACTION
        summary = dcp_io.failure_summary(err)
        detail = _FULL.format(free=free) if nearly_full else f"{summary}; {free} bytes free on its file system"
    else:
        detail = dcp_io.failure_summary(err)
    return DtrainError(
        f"checkpoint {partial}: {what} failed, the checkpoint could not be written ({detail}); "
        "the folder is removed on the next start"
    )
