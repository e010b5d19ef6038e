"""Worker processes that tokenize the document stream ahead of the packer (`training.dataloader.num_workers > 0`).

Packing is sequential, so workers only tokenize (the expensive part): groups of DOCUMENTS_PER_GROUP documents are
dealt out round-robin and read back in the same order, so the packer sees the stream it would tokenize itself,
whatever the number of workers (docs/data.md, "Background loading"). A new command (a rewind) restarts a worker
under a new generation number; results of an older one are dropped.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import signal
import threading
import traceback
from collections.abc import Iterator
from typing import Any

import numpy as np

from dtrain.data.background import BackgroundError, Stopped, background_error
from dtrain.data.packing import document_passes, document_tokens
from dtrain.data.sources import DocumentSource
from dtrain.data.tokenizer import Tokenizer
from dtrain.errors import DataError, first_line

# Documents per message: enough to amortize pickling and the pipe, few enough to keep the first batch quick.
DOCUMENTS_PER_GROUP = 16
# How often a blocked worker or reader looks for a new command, a stop request or a dead peer.
POLL_SECONDS = 0.1
# How long a worker may take to stop on request before it is terminated.
STOP_SECONDS = 2.0


def _sendable_error(exc: BaseException, index: int) -> BaseException:
    """`exc` as it can cross to the parent: picklable, with the worker's traceback as a note (the CLI shows notes
    only with DTRAIN_TRACEBACK=1)."""
    error = background_error(exc, f"data loader worker {index}")
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # an exception type that does not survive pickling: keep its text only
        error = BackgroundError(f"data loader worker {index} failed: {type(exc).__name__}: {first_line(exc)}")
    if hasattr(error, "add_note"):  # Python >= 3.11
        error.add_note(f"in data loader worker {index}:\n{''.join(traceback.format_exception(exc))}")
    return error


def _worker_main(index: int, workers: int, source: DocumentSource, tokenizer: Tokenizer, commands, results) -> None:
    # Exiting must not wait for the parent to read what is still buffered for it.
    results.cancel_join_thread()
    # Ctrl-C reaches the whole process group; the parent stops the workers itself, and a traceback per worker
    # would bury its own message.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    command = _next_command(commands, parent, block=True)
    while command is not None:
        command = _tokenize(index, workers, source, tokenizer, command, commands, results, parent)


def _next_command(commands, parent: int, block: bool) -> Any:
    """The next command: (generation, epoch, start), None to stop, or `_NO_COMMAND` when none came (block=False).
    A worker whose parent is gone stops."""
    while True:
        if os.getppid() != parent:
            return None
        try:
            return commands.get(timeout=POLL_SECONDS) if block else commands.get_nowait()
        except queue.Empty:
            if not block:
                return _NO_COMMAND


_NO_COMMAND = object()


def _tokenize(index, workers, source, tokenizer, command, commands, results, parent) -> Any:
    """Tokenize this worker's groups from the command's position on; returns the command that interrupts it."""
    generation, epoch, start = command
    group: list[tuple[int, int, np.ndarray]] = []
    try:
        for ordinal, (epoch, position, document) in enumerate(document_passes(source, epoch, start)):
            if (ordinal // DOCUMENTS_PER_GROUP) % workers != index:
                continue
            group.append((epoch, position, document_tokens(document, tokenizer, source.description)))
            if len(group) == DOCUMENTS_PER_GROUP:
                interrupt = _put(results, (generation, group, None), commands, parent)
                if interrupt is not _NO_COMMAND:
                    return interrupt
                group = []
    except Exception as exc:  # the parent raises it after the documents before it, where tokenizing here would
        interrupt = _put(results, (generation, group, _sendable_error(exc, index)), commands, parent)
        if interrupt is not _NO_COMMAND:
            return interrupt
    return _next_command(commands, parent, block=True)


def _put(results, item: Any, commands, parent: int) -> Any:
    """Queue `item`, waiting while the queue is full; a command that arrives meanwhile (or after) wins."""
    while True:
        try:
            results.put(item, timeout=POLL_SECONDS)
            return _next_command(commands, parent, block=False)
        except queue.Full:
            command = _next_command(commands, parent, block=False)
            if command is not _NO_COMMAND:
                return command


class TokenizerPool:
    """`num_workers` processes tokenizing `source` ahead of one reader (the loader's background thread)."""

    def __init__(self, source: DocumentSource, tokenizer: Tokenizer, num_workers: int, prefetch_factor: int):
        self.source, self.num_workers = source, num_workers
        # fork where the platform has it, as torch's DataLoader does: sources and tokenizers need not pickle, and
        # workers start in milliseconds. Workers never run torch ops, so forking a process that did is safe.
        methods = multiprocessing.get_all_start_methods()
        context = multiprocessing.get_context("fork" if "fork" in methods else None)
        self._commands = [context.Queue() for _ in range(num_workers)]
        self._results = [context.Queue(maxsize=prefetch_factor) for _ in range(num_workers)]
        for commands in self._commands:
            commands.cancel_join_thread()  # never wait at exit on a worker that died before reading its commands
        self._processes = [
            context.Process(
                target=_worker_main,
                args=(index, num_workers, source, tokenizer, self._commands[index], self._results[index]),
                name=f"dtrain-data-worker-{index}",
                daemon=True,  # multiprocessing terminates daemon workers at exit, whatever happened
            )
            for index in range(num_workers)
        ]
        for process in self._processes:
            process.start()
        self._generation = 0

    def stream(self, epoch: int, start: int, stopping: threading.Event) -> Iterator[tuple[int, int, np.ndarray]]:
        """The tokenized documents from (epoch, start) on, in source order (what a packer's `tokenized` gives).
        Raises Stopped when `stopping` is set while it waits for a worker."""
        self._generation += 1
        generation = self._generation
        for commands in self._commands:
            commands.put((generation, epoch, start))
        group = 0
        while True:
            documents, error = self._next_group(group % self.num_workers, generation, stopping)
            yield from documents
            if error is not None:
                raise error
            group += 1

    def _next_group(
        self, worker: int, generation: int, stopping: threading.Event
    ) -> tuple[list[tuple[int, int, np.ndarray]], BaseException | None]:
        """The next group of `worker`, and what the worker raised after its documents (None: nothing)."""
        while True:
            try:
                item_generation, documents, error = self._results[worker].get(timeout=POLL_SECONDS)
            except queue.Empty:
                if stopping.is_set():
                    raise Stopped from None
                process = self._processes[worker]
                if not process.is_alive():
                    raise DataError(
                        f"data loader worker {worker} exited unexpectedly (exit code {process.exitcode}; killed for "
                        "memory?); lower training.dataloader.num_workers or set it to 0"
                    ) from None
                continue
            if item_generation == generation:  # else it is work for a position the reader has left
                return documents, error

    def close(self) -> None:
        """Stop the workers: ask, then terminate those that do not stop within STOP_SECONDS."""
        for commands in self._commands:
            try:
                commands.put(None)
            except (OSError, ValueError):  # the queue is already closed
                pass
        for process in self._processes:
            process.join(STOP_SECONDS)
            if process.is_alive():
                process.terminate()
                process.join(STOP_SECONDS)
        for q in self._commands + self._results:
            q.close()
