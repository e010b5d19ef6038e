"""A line at least every 30 seconds: while the run says nothing (a slow step, a long data pass, a checkpoint being
read), a daemon thread says what it is doing and for how long, so that a quiet console never leaves a user guessing
whether the run hangs.

The phases are told with `doing(...)` from where they start (prepare, build, restore, each step and its hooks);
that is a module-level state because those places are far apart and the thread is one per process. Any line of the
"dtrain" logger restarts the 30 s, so a run that logs often never sees one of these.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

from dtrain.metrics.logging_setup import LOGGER_NAME

EVERY_S = 30.0
logger = logging.getLogger(LOGGER_NAME)


class Liveness(logging.Filter):
    def __init__(self, every_s: float) -> None:
        super().__init__()
        self.every_s = every_s
        self.what, self.since = "starting", time.monotonic()
        self.last_line = self.since
        self.stop = threading.Event()

    def filter(self, record: logging.LogRecord) -> bool:  # every line the logger lets through
        self.last_line = time.monotonic()
        return True

    def doing(self, what: str) -> None:
        self.what, self.since = what, time.monotonic()

    def watch(self) -> None:
        while not self.stop.wait(min(1.0, self.every_s / 4)):
            now = time.monotonic()
            if now - self.last_line >= self.every_s:
                logger.info("still %s: %.0f s so far", self.what, now - self.since)


_current: Liveness | None = None


@contextlib.contextmanager
def liveness(every_s: float = EVERY_S) -> Iterator[None]:
    """Within the block, a line every `every_s` seconds of silence."""
    global _current
    _current = Liveness(every_s)
    logger.addFilter(_current)
    thread = threading.Thread(target=_current.watch, name="dtrain-liveness", daemon=True)
    thread.start()
    try:
        yield
    finally:
        _current.stop.set()
        thread.join()
        logger.removeFilter(_current)
        _current = None


def doing(what: str) -> None:
    """What the run does from now on (said after `EVERY_S` of silence); nothing outside a `liveness` block."""
    if _current is not None:
        _current.doing(what)
