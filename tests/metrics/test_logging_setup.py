import logging

import pytest

from dtrain.errors import ConfigError
from dtrain.metrics.logging_setup import setup_logging


# Every test uses the dtrain_logger fixture (conftest.py): setup_logging changes process-wide logger state, and
# the fixture restores it afterwards.
def _format(logger, message):
    (handler,) = [h for h in logger.handlers if type(h).__name__ == "_DtrainHandler"]
    return handler.format(logging.LogRecord("dtrain", logging.INFO, __file__, 1, message, None, None))


def test_rank0_logs_info_by_default(monkeypatch, dtrain_logger):
    monkeypatch.delenv("LOG_RANK", raising=False)
    assert setup_logging(0).getEffectiveLevel() == logging.INFO
    assert setup_logging(1).getEffectiveLevel() == logging.WARNING


def test_log_rank_env_picks_the_logging_rank(monkeypatch, dtrain_logger):
    monkeypatch.setenv("LOG_RANK", "2")
    assert setup_logging(0).level == logging.WARNING
    assert setup_logging(2).level == logging.INFO


def test_log_rank_all_logs_everywhere(monkeypatch, dtrain_logger):
    monkeypatch.setenv("LOG_RANK", "all")
    assert setup_logging(3).level == logging.INFO


def test_explicit_argument_wins_over_env(monkeypatch, dtrain_logger):
    monkeypatch.setenv("LOG_RANK", "all")
    assert setup_logging(3, log_rank=0).level == logging.WARNING


def test_invalid_log_rank_is_a_config_error(monkeypatch, dtrain_logger):
    monkeypatch.setenv("LOG_RANK", "first")
    with pytest.raises(ConfigError, match="LOG_RANK='first'"):
        setup_logging(0)


def test_lines_carry_the_rank_and_repeated_setup_does_not_duplicate(dtrain_logger):
    setup_logging(1, log_rank=1)
    logger = setup_logging(1, log_rank=1)
    assert _format(logger, "hello").startswith("[rank1]:")  # as torchrun tags a worker's lines
    assert _format(logger, "hello").endswith(" INFO hello")
    assert logger.propagate is False
