"""Typed, user-facing errors. Each carries one line that names the key or file and what would be valid.

The CLI entry point prints `error: <message>` for these and exits without a traceback (set DTRAIN_TRACEBACK=1
to see one); anything else is a bug and keeps its traceback.
"""


class DtrainError(Exception):
    """Base of every error that is the user's to fix. Its message is one actionable line."""

    exit_code = 1


class ConfigError(DtrainError):
    """A config key, value, file or combination is invalid (raised before any run directory or process group)."""

    exit_code = 2


class DataError(DtrainError):
    """A dataset, file or tokenizer cannot be used as configured."""

    exit_code = 2


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when the message is empty), for one-line errors
    that quote what a library raised."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
