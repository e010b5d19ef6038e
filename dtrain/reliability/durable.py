"""Making a write survive a crash: flush a file's data, or a folder's entries (the renames done in it), to disk."""

from __future__ import annotations

import os


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a folder. Some filesystems (and Windows) cannot open or fsync a folder: there this does
    nothing, and a rename done in it is still atomic, only not yet durable."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)
