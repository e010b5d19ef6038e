"""metrics.disable_color_printing: the console metrics line is coloured only when it goes to a terminal."""

import io
import logging
from pathlib import Path

import pytest
import torch

from dtrain.metrics.console_color import FIELD_COLORS, RESET
from dtrain.metrics.logger import MetricsLogger

CPU = torch.device("cpu")


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture
def console():
    """Replace the "dtrain" logger's handlers by one whose stream is chosen per test; restored afterwards."""
    logger = logging.getLogger("dtrain")
    saved = (logger.level, list(logger.handlers), logger.propagate)
    logger.setLevel(logging.INFO)
    logger.propagate = False

    def attach(*streams):
        logger.handlers[:] = [logging.StreamHandler(stream) for stream in streams]
        return streams

    yield attach
    logger.setLevel(saved[0])
    logger.handlers[:] = saved[1]
    logger.propagate = saved[2]


def log_one_step(cfg) -> None:
    cfg.metrics.enable_tensorboard = False
    with MetricsLogger(cfg.metrics, cfg.job.dump_folder, 100, 0, 1, 1e6, CPU, torch.float32) as ml:
        ml.log(1, {"loss": torch.tensor(2.5), "grad_norm": torch.tensor(1.0), "lr": 1e-3}, 64)


def step_line(stream) -> str:
    return next(line for line in stream.getvalue().splitlines() if "loss" in line)


def test_terminal_gets_a_coloured_line(cfg, console):
    (terminal,) = console(Terminal())
    log_one_step(cfg)
    line = step_line(terminal)
    assert f"{FIELD_COLORS['loss']}loss 2.5000{RESET}" in line
    assert f"{FIELD_COLORS['step']}step   1/100{RESET}" in line


def test_disable_color_printing_keeps_a_terminal_plain(cfg, console):
    (terminal,) = console(Terminal())
    cfg.metrics.disable_color_printing = True
    log_one_step(cfg)
    assert "\033[" not in step_line(terminal) and "loss 2.5000" in step_line(terminal)


def test_pipes_and_files_stay_plain(cfg, console):
    # A pipe alone, and a terminal that also feeds a file (colour codes would end up in the file).
    for streams in ((io.StringIO(),), (Terminal(), io.StringIO())):
        outputs = console(*streams)
        log_one_step(cfg)
        for stream in outputs:
            assert "\033[" not in stream.getvalue()
    assert "\033[" not in (Path(cfg.job.dump_folder) / "metrics.jsonl").read_text()
