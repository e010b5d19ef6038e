"""A config field's declaration: its default, its one-line doc (shown by --help) and what values are valid."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def opt(default: Any, doc: str, choices: tuple | None = None, minimum: float | None = None) -> Any:
    """A config field: its default, its one-line doc, and optionally its valid choices or lower bound."""
    meta = {"doc": doc, "choices": choices, "minimum": minimum}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)
