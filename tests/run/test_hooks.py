"""Loop hooks: each kind runs in the order registered, after-step hooks on their cadence, the context managers
around the loop close after the end hooks, and the close hooks run whether the loop ends or fails."""

from __future__ import annotations

import contextlib

import pytest

from dtrain.run.hooks import Hooks, StepEnd


def run(hooks: Hooks, steps: int, fail_at: int | None = None) -> None:
    with hooks.running():
        for step in range(1, steps + 1):
            with hooks.around_step(first=step == 1):
                if step == fail_at:
                    raise RuntimeError("step failed")
            hooks.after_step(StepEnd(step, {}, 0, first=step == 1, last=step == steps))


def recording_hooks(seen: list) -> Hooks:
    @contextlib.contextmanager
    def around(name):
        seen.append(f"enter {name}")
        yield name
        seen.append(f"exit {name}")

    hooks = Hooks()
    hooks.on_start(lambda: seen.append("start"))
    outer = hooks.around_loop(lambda: around("outer"))
    hooks.around_first_step(lambda: around("first step"))
    hooks.add(lambda end: seen.append(f"every {end.step}"))
    hooks.after_first_step(lambda end: seen.append(f"first {end.step}"))
    hooks.add(lambda end: seen.append(f"third {end.step} in {outer.value}"), every=3)
    hooks.at_end(lambda: seen.append("end"))
    hooks.on_close(lambda: seen.append("close"))
    return hooks


def test_hooks_run_in_registration_order_on_their_cadence():
    seen = []
    run(recording_hooks(seen), steps=3)
    assert seen == [
        "start", "enter outer", "enter first step", "exit first step", "every 1", "first 1", "every 2", "every 3",
        "third 3 in outer", "end", "exit outer", "close",
    ]


def test_a_failing_loop_skips_the_end_hooks_and_still_closes():
    seen = []
    with pytest.raises(RuntimeError, match="step failed"):
        run(recording_hooks(seen), steps=3, fail_at=2)
    assert seen == ["start", "enter outer", "enter first step", "exit first step", "every 1", "first 1", "close"]
