"""Workers end when their launcher dies.

torchrun starts each worker in its own session, so when torchrun itself is killed (kill -9, an OOM kill) nothing
reaches the workers: they keep training and writing checkpoints into the run folder, and a relaunch races them.
A daemon thread in each worker watches its parent process and, once the worker has been re-parented (the launcher
is gone), ends the worker at once. Checkpoints are atomic (a save commits by a rename once every rank is done),
so dying mid-save leaves only a `step-N.partial` folder that is never loaded and is removed at the next start.
"""

from __future__ import annotations

import os
import sys
import threading
import time

POLL_SECONDS = 1.0


def exit_when_orphaned(poll_seconds: float = POLL_SECONDS) -> threading.Thread:
    """Start the watch for this process's current parent; returns the (daemon) thread."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_seconds)
        print(f"dtrain: the launcher (pid {parent}) is gone; this worker (pid {os.getpid()}) exits now",
              file=sys.stderr, flush=True)
        # os._exit: no cleanup that could wait on peers that are gone too.
        os._exit(1)

    thread = threading.Thread(target=watch, name="dtrain-launcher-watch", daemon=True)
    thread.start()
    return thread
