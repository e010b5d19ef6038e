"""Fixtures for the metrics tests: a config whose run directory is a temporary folder, and a clean logger."""

import logging

import pytest

from dtrain.config.schema import JobConfig


@pytest.fixture
def cfg(tmp_path):
    config = JobConfig()
    config.job.dump_folder = str(tmp_path / "run")
    config.training.steps = 100
    config.metrics.log_freq = 10
    return config


class ListHandler(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def dtrain_logger():
    """The "dtrain" logger at INFO with a handler collecting messages; its prior state is restored afterwards.

    setup_logging changes process-wide logger state (level, handlers, propagate); restoring it keeps other test
    files that capture "dtrain" logs unaffected by the order tests run in.
    """
    logger = logging.getLogger("dtrain")
    saved = (logger.level, list(logger.handlers), logger.propagate)
    collector = ListHandler()
    logger.setLevel(logging.INFO)
    logger.addHandler(collector)
    yield collector
    logger.setLevel(saved[0])
    logger.handlers[:] = saved[1]
    logger.propagate = saved[2]
