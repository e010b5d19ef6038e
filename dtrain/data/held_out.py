"""Validation on the user's own conversations: a fixed fraction of a chat dataset's rows, chosen by position (a hash
of it, so the same rows every run, on every rank and after a resume), is read by validation and never by training.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import xxhash

from dtrain.data.chat_source import ChatRows

def held_out(position: int, fraction: float) -> bool:
    return xxhash.xxh64_intdigest(position.to_bytes(8, "little"), seed=0) / 2**64 < fraction if fraction else False


class HeldOutRows(ChatRows):
    """The rows of `rows` that are held out (`held`, validation's) or the others (training's)."""

    def __init__(self, rows: ChatRows, fraction: float, held: bool) -> None:
        self.inner, self.fraction, self.held = rows, fraction, held
        share = f"{fraction:.0%}" if held else f"{1 - fraction:.0%}"
        what = "held out for validation" if held else "not held out for validation"
        self.description = f"{rows.description} ({share} of its conversations, those {what})"

    def rows(self, start: int = 0) -> Iterator[tuple[int, str, Any]]:
        for position, where, row in self.inner.rows(start):
            if held_out(position, self.fraction) == self.held:
                yield position, where, row
