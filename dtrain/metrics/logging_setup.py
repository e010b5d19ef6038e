"""Configures the "dtrain" logger that every module of the trainer logs through.

With many ranks, identical lines from each would drown the output, so one rank logs at INFO and the others only
report warnings and errors. ``LOG_RANK`` picks the logging rank (default 0); ``LOG_RANK=all`` lets every rank log.
The trainer passes the local rank (the rank within a node), so each node has its logging process, matching the
output filter run_train.sh gives torchrun.
Each line carries its rank, so interleaved output from several ranks stays readable.
"""

from __future__ import annotations

import logging
import os

from dtrain.errors import ConfigError

LOGGER_NAME = "dtrain"
LOG_RANK_ENV = "LOG_RANK"


class _DtrainHandler(logging.StreamHandler):
    """The handler setup_logging installs; its type lets a second call replace it instead of adding another."""


def _resolve_log_rank(log_rank: int | str | None) -> int | str:
    """The rank that logs at INFO: the argument, else $LOG_RANK, else 0. "all" means every rank."""
    value = os.environ.get(LOG_RANK_ENV, "0") if log_rank is None else log_rank
    if isinstance(value, int):
        return value
    text = str(value).strip().lower()
    if text == "all":
        return "all"
    if text.isdigit():
        return int(text)
    raise ConfigError(f"{LOG_RANK_ENV}={value!r} is not a rank; use a rank number (e.g. 0) or 'all'")


def setup_logging(rank: int, log_rank: int | str | None = None) -> logging.Logger:
    """Configure and return the "dtrain" logger for this process.

    ``log_rank`` is the rank that logs at INFO level (an int, or "all" for every rank); when left as None it comes
    from the LOG_RANK environment variable, default 0. Other ranks log WARNING and above. Lines go to stderr as
    ``[rank<r>]:<time> <LEVEL> <message>`` (as torchrun tags a worker's lines). Calling it again (e.g. after the
    rank becomes known) reconfigures the logger instead of duplicating its output.
    """
    chosen = _resolve_log_rank(log_rank)
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(logging.INFO if chosen == "all" or chosen == rank else logging.WARNING)
    for handler in [h for h in logger.handlers if isinstance(h, _DtrainHandler)]:
        logger.removeHandler(handler)
    handler = _DtrainHandler()
    # torchrun's --tee already starts every line with "[rank<r>]:"; a second tag would only repeat it. One process
    # writes the same tag, so that a log reads (and greps) alike with one process or many.
    tag = "" if "TORCHELASTIC_RUN_ID" in os.environ else f"[rank{rank}]:"
    handler.setFormatter(logging.Formatter(f"{tag}%(asctime)s %(levelname)s %(message)s", datefmt="%Y-%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    # The root logger may carry handlers of its own (a library's basicConfig); without this each line prints twice.
    logger.propagate = False
    return logger
