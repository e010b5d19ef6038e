"""Import torchao without the log lines that tell a dtrain user nothing.

Two kinds: torchao's warning at import that it skips its C++ extensions because TORCHAO_FORCE_SKIP_LOADING_SO_FILES
is set (scripts/setup_env.sh sets it: those kernels are built against one torch release, and dtrain calls none of
them), and torch 2.13's deprecation warnings when torchao registers its enums with pytree (torchao's to fix, not
the user's). Both are raised to ERROR for the import only; any other warning of the import still shows.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

_QUIETED = ("torchao", "torch.utils._pytree")


@contextmanager
def quiet_torchao_import() -> Iterator[None]:
    """Run the `import torchao...` statements of the block with torchao's and pytree's warnings silenced."""
    loggers = [logging.getLogger(name) for name in _QUIETED]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
