"""Fixtures of the compile-report tests."""

from __future__ import annotations

import pytest
import torch

from dtrain.observe.compile_report import stop_watching_graph_breaks, watch_graph_breaks


@pytest.fixture
def fresh_dynamo():
    """The report is cumulative over the process: start from nothing, and leave nothing behind."""
    def reset():
        torch._dynamo.reset()
        torch._dynamo.utils.clear_compilation_metrics()
        torch._dynamo.utils.counters.clear()

    reset()
    watch_graph_breaks()
    yield
    stop_watching_graph_breaks()
    reset()
