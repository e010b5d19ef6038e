"""ANSI colours for the console metrics line, as torchtitan prints it, and when they may be used.

Colour codes are for a person at a terminal: in a file or a pipe (a log collector, `| tee`, torchrun's per-rank
log files) they are noise, so the line is coloured only when every handler it reaches writes to a terminal.
"""

from __future__ import annotations

import logging

RESET = "\033[39m"
# One colour per field of the line (torchtitan's palette: step red, loss green, grad_norm orange, memory turquoise,
# tps blue, tflops cyan, mfu magenta); fields without an entry keep the terminal's colour.
FIELD_COLORS = {
    "step": "\033[31m",
    "loss": "\033[32m",
    "grad_norm": "\033[38;2;255;165;0m",
    "lr": "\033[33m",
    "tps": "\033[34m",
    "tflops": "\033[36m",
    "mfu": "\033[35m",
    "mem": "\033[38;2;54;234;195m",
}


def colored(field: str, text: str) -> str:
    code = FIELD_COLORS.get(field)
    return f"{code}{text}{RESET}" if code else text


def console_is_terminal(log: logging.Logger) -> bool:
    """Whether every handler a record of `log` reaches (following propagation) writes to a terminal."""
    handlers: list[logging.Handler] = []
    current: logging.Logger | None = log
    while current is not None:
        handlers += current.handlers
        current = current.parent if current.propagate else None
    return bool(handlers) and all(_is_terminal(getattr(h, "stream", None)) for h in handlers)


def _is_terminal(stream) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
