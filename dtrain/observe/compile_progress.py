"""Progress lines while the first step compiles: torch.compile traces and builds every graph during the run's
first step, which can take minutes of otherwise silent console on a large model or a slow machine."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger("dtrain")

PROGRESS_EVERY_S = 30.0


@contextmanager
def compile_progress(every_s: float = PROGRESS_EVERY_S) -> Iterator[None]:
    """Around the first step of a compiled run: one line at its start, one every `every_s` seconds while it
    lasts (from a daemon thread: the main thread is busy compiling), one when it is done."""
    logger.info("compile: the first step compiles the model (torch.compile); progress every %.0f s", every_s)
    start = time.perf_counter()
    done = threading.Event()

    def report() -> None:
        while not done.wait(every_s):
            logger.info("compile: still compiling the first step, %.0f s so far", time.perf_counter() - start)

    reporter = threading.Thread(target=report, name="dtrain-compile-progress", daemon=True)
    reporter.start()
    try:
        yield
    finally:
        done.set()
        reporter.join()
    logger.info("compile: first step done in %.1f s (compilation included)", time.perf_counter() - start)
