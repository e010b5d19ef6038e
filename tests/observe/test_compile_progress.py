"""The first step of a compiled run is announced, reported while it lasts, and its end is logged."""

from __future__ import annotations

import logging
import threading
import time

from dtrain.observe.compile_progress import compile_progress


def test_a_long_first_step_reports_progress_until_it_ends(caplog):
    with caplog.at_level(logging.INFO, logger="dtrain"):
        with compile_progress(every_s=0.05):
            time.sleep(0.3)
        lines_at_exit = len(caplog.messages)
        time.sleep(0.15)  # the reporter stopped with the step: no line after it
    messages = caplog.messages
    assert messages[0].startswith("compile: the first step compiles the model")
    assert sum("still compiling the first step" in m for m in messages) >= 2
    assert messages[-1].startswith("compile: first step done in")
    assert len(messages) == lines_at_exit
    assert not any(t.name == "dtrain-compile-progress" for t in threading.enumerate())
