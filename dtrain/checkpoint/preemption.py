"""Preemption: SIGTERM (schedulers, torchrun), SIGUSR1 (SLURM's --signal) or SIGINT (Ctrl-C) → finish the step,
save, exit 0. A second Ctrl-C (or SIGTERM) exits at once, for when saving hangs.

The signal handler only sets a flag. The loop asks `should_stop(step)` once per step; in a multi-process run the
ranks all-reduce their flags (MAX) so that every rank stops after the same step, even when the signal reached
them at different times. The all-reduce runs on its own gloo group with `async_op`, and its result is read one
check later, so asking never waits for the device or for slower ranks: a stop takes effect one check late.
"""

from __future__ import annotations

import logging
import signal
from typing import Iterable

import torch
import torch.distributed as dist

logger = logging.getLogger("dtrain")
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class PreemptionWatcher:
    """Polled once per step; `should_stop(step)` turns True (on all ranks at the same step) after a signal.

    A second signal of the same kind gets the default action (SIGTERM and SIGINT: exit now), for when saving hangs.
    Construct it in the main thread, on every rank at the same point (it creates a process group), and `close()`
    it at the end to restore the previous handlers.
    """

    def __init__(self, world_size: int = 1, check_every: int = 1, signals: Iterable[int] = PREEMPTION_SIGNALS):
        if check_every < 1:
            raise ValueError(f"check_every must be >= 1, got {check_every}")
        self.check_every = check_every
        self.received: str | None = None
        self._stop = False
        self._group = dist.new_group(backend="gloo") if world_size > 1 else None
        self._in_flight: tuple[dist.Work, torch.Tensor] | None = None
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in signals}

    def _on_signal(self, signum: int, frame) -> None:
        self.received = signal.Signals(signum).name
        signal.signal(signum, signal.SIG_DFL)

    def should_stop(self, step: int) -> bool:
        """Whether to save and stop after `step`. Call exactly once per step on every rank."""
        if self._stop:
            return True
        if self._group is None:
            stop = self.received is not None
        elif step % self.check_every:
            return False
        else:
            stop = False
            if self._in_flight is not None:
                work, flag = self._in_flight
                work.wait()
                stop = bool(flag.item())
            flag = torch.tensor([int(self.received is not None)], dtype=torch.int32)
            self._in_flight = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True), flag)
        if stop:
            self._stop = True
            source = self.received or "another rank"
            logger.warning(f"preemption: {source} received; saving after step {step} and exiting")
        return stop

    def close(self) -> None:
        """Finish the last flag exchange and put the previous signal handlers back."""
        if self._in_flight is not None:
            self._in_flight[0].wait()
            self._in_flight = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
