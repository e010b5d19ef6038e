"""Hooks: what the training loop runs besides the step, registered at set-up with a cadence (as Levanter's hooks).

A hook after a step runs when `step % every == 0`, or only after the run's first step; context managers wrap the
whole loop (profiler, memory snapshot) or only its first step. Every kind runs in the order it was registered, so
the registration reads as what happens, and adding a concern registers a hook instead of editing the loop.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch


@dataclass
class StepEnd:
    """A finished step as its hooks see it. `preempted` is set by the preemption hook, for the hooks after it and
    for the loop, which then stops."""

    step: int
    metrics: dict[str, torch.Tensor]
    tokens_seen: int
    first: bool  # the first step this process ran
    last: bool  # step == training.steps
    preempted: bool = False


@dataclass(frozen=True)
class AfterStep:
    run: Callable[[StepEnd], None]
    every: int = 1
    first_only: bool = False

    def due(self, end: StepEnd) -> bool:
        return end.first if self.first_only else end.step % self.every == 0


@dataclass
class Entered:
    """What a context manager around the loop yielded, for the hooks that use it once the loop runs."""

    value: Any = None


class Hooks:
    """The hooks of one training loop, each kind run in the order registered.

    A loop runs `with hooks.running():` around its steps, `with hooks.around_step(first)` around each step and
    `hooks.after_step(end)` after it.
    """

    def __init__(self) -> None:
        self._starts: list[Callable[[], None]] = []
        self._around_loop: list[tuple[Callable[[], contextlib.AbstractContextManager], Entered]] = []
        self._around_first_step: list[Callable[[], contextlib.AbstractContextManager]] = []
        self._after_step: list[AfterStep] = []
        self._after_discarded: list[Callable[[StepEnd], None]] = []
        self._at_end: list[Callable[[], None]] = []
        self._closes: list[Callable[[], None]] = []

    # -- registering ----------------------------------------------------------------------------------------------
    def on_start(self, run: Callable[[], None]) -> None:
        """Run `run` when the loop starts, before the context managers around it are entered."""
        self._starts.append(run)

    def around_loop(self, make: Callable[[], contextlib.AbstractContextManager]) -> Entered:
        """Enter the context manager `make()` returns (when the loop starts) around the whole loop and the end
        hooks; what it yields is then in the returned `Entered`."""
        entered = Entered()
        self._around_loop.append((make, entered))
        return entered

    def around_first_step(self, make: Callable[[], contextlib.AbstractContextManager]) -> None:
        """Run the run's first step inside the context manager `make()` returns."""
        self._around_first_step.append(make)

    def add(self, run: Callable[[StepEnd], None], every: int = 1) -> None:
        """Run `run` after each step divisible by `every`."""
        self._after_step.append(AfterStep(run, every=every))

    def after_first_step(self, run: Callable[[StepEnd], None]) -> None:
        """Run `run` once, after the first step this process runs."""
        self._after_step.append(AfterStep(run, first_only=True))

    def after_discarded_step(self, run: Callable[[StepEnd], None]) -> None:
        """Run `run` after a step that the replica groups discarded (fault tolerance): the state is still that of
        the last step done, and only what must not wait for the next done step runs (a preemption signal)."""
        self._after_discarded.append(run)

    def at_end(self, run: Callable[[], None]) -> None:
        """Run `run` once the loop is done (not when it fails), inside the context managers around it."""
        self._at_end.append(run)

    def on_close(self, run: Callable[[], None]) -> None:
        """Run `run` when the loop is left, done or failed."""
        self._closes.append(run)

    # -- running --------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Start hooks, then the context managers around the loop; on leaving, the end hooks and, in any case,
        the close hooks."""
        for start in self._starts:
            start()
        try:
            with contextlib.ExitStack() as stack:
                for make, entered in self._around_loop:
                    entered.value = stack.enter_context(make())
                yield
                for end in self._at_end:
                    end()
        finally:
            for close in self._closes:
                close()

    @contextlib.contextmanager
    def around_step(self, first: bool) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if first:
                for make in self._around_first_step:
                    stack.enter_context(make())
            yield

    def after_step(self, end: StepEnd) -> None:
        for hook in self._after_step:
            if hook.due(end):
                hook.run(end)

    def after_discarded(self, end: StepEnd) -> None:
        for hook in self._after_discarded:
            hook(end)
