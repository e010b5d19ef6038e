"""A background thread that makes items ahead of their consumer, with a bounded queue and clean shutdown.

The training loop's data loader uses it to read, tokenize and pack batches while the step runs (the step's torch
ops release the GIL). An exception in the thread is raised in the consumer, at the item where it happened, with its
one-line message; `close` stops the thread, also while it waits on a full queue or on worker processes.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from dtrain.errors import DtrainError, first_line

T = TypeVar("T")
# How often a blocked producer or consumer looks for a stop request or a dead peer.
POLL_SECONDS = 0.1
# How long `close` waits for the thread to finish the item it is making.
JOIN_SECONDS = 30.0


class BackgroundError(RuntimeError):
    """An exception that is not a DtrainError (a bug), raised in background loading: its type and first line."""


class Stopped(Exception):
    """Raised inside a producer that was asked to stop while it waited (it ends the thread quietly)."""


def background_error(exc: BaseException, where: str) -> BaseException:
    """What the consumer raises for `exc` raised in the background: a DtrainError as it is (its message is one
    actionable line already), anything else (a bug) as a BackgroundError naming its type, with its first line."""
    if isinstance(exc, (DtrainError, BackgroundError)):
        return exc
    return BackgroundError(f"{where} failed: {type(exc).__name__}: {first_line(exc)}")


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


class Prefetcher(Generic[T]):
    """Calls `make()` in a daemon thread and keeps up to `depth` results ready for `next()`.

    `make` must not hold a reference to the object that owns the prefetcher, so that dropping the owner can close
    it (see DataLoader). `stopping` is set while closing: `make` may poll it and raise Stopped.
    """

    def __init__(self, make: Callable[[], T], depth: int, name: str):
        self._make = make
        self._queue: queue.Queue[T | _Failure] = queue.Queue(maxsize=depth)
        self.stopping = threading.Event()
        self._failure: _Failure | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                item: T | _Failure = self._make()
            except Stopped:
                return
            except BaseException as exc:  # handed to the consumer, which raises it where it would have happened
                item = _Failure(exc)
            while not self.stopping.is_set():
                try:
                    self._queue.put(item, timeout=POLL_SECONDS)
                    break
                except queue.Full:
                    continue
            if isinstance(item, _Failure):
                return

    def next(self) -> T:
        """The next item; raises what `make` raised for it (and again on every later call)."""
        while self._failure is None:
            try:
                item = self._queue.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("background data loading stopped without a result or an error") from None
                continue
            if not isinstance(item, _Failure):
                return item
            self._failure = item
        error = self._failure.error
        raised = background_error(error, "background data loading")
        raise raised from (None if raised is error else error)

    def close(self) -> None:
        """Stop the thread and wait for it (it finishes the item in hand, or stops waiting at once)."""
        self.stopping.set()
        self._thread.join(JOIN_SECONDS)
        if self._thread.is_alive():
            raise RuntimeError(f"data loading thread {self._thread.name} did not stop within {JOIN_SECONDS:.0f}s")
