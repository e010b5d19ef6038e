"""The key table of docs/migrating-from-torchtitan.md: every torchtitan v0.2.2 key and what it is in dtrain.

Generated from ``torchtitan_keys.py``, ``torchtitan_comparison.py`` and the schema by scripts/gen_config_docs.py,
between the markers below; a test fails when the committed doc and the code disagree.
"""

from __future__ import annotations

from dtrain.config.fields import config_fields
from dtrain.config.reference import splice_between
from dtrain.config.torchtitan_comparison import (
    DEFAULT_DIFFERENCES,
    MEANING_DIFFERENCES,
    PROVEN_SAME,
    TESTED_SAME,
    TORCHTITAN_V0_2_2_KEYS,
)
from dtrain.config.torchtitan_keys import ANY, TORCHTITAN_ONLY
from dtrain.config.toml_io import toml_value

BEGIN_MARKER = "<!-- BEGIN GENERATED TORCHTITAN KEY TABLE (scripts/gen_config_docs.py) -->"
END_MARKER = "<!-- END GENERATED TORCHTITAN KEY TABLE -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def key_status(key: str) -> tuple[str, str]:
    """(status, notes) of a torchtitan key: same, differs, renamed, accepted (no effect) or accepted/refused by
    value."""
    if key in MEANING_DIFFERENCES:
        return "same name, differs", MEANING_DIFFERENCES[key]
    if key in config_fields():
        tested = PROVEN_SAME.get(key) or TESTED_SAME.get(key)
        notes = [f"tested: {tested}"] if tested else []
        if key in DEFAULT_DIFFERENCES:
            theirs, ours = DEFAULT_DIFFERENCES[key]
            default = config_fields()[key].default
            shown = "unset" if default is None else f"`{toml_value(default)}`"
            theirs = theirs if theirs.startswith("unset") else f"`{theirs}`"
            notes.append(f"default differs: torchtitan {theirs}, dtrain {shown} ({ours})")
        return "same", "; ".join(notes)
    meaning = TORCHTITAN_ONLY[key]
    if meaning.alias is not None:
        return "renamed", f"sets `{meaning.alias}`"
    if ANY in meaning.inert:
        return "accepted, no effect", meaning.reason
    values = ", ".join(f"`{toml_value(v)}`" for v in meaning.inert)
    return "accepted as " + values + " (no effect); other values refused", meaning.reason


def format_torchtitan_table() -> str:
    lines = ["| torchtitan key | in dtrain | notes |", "|---|---|---|"]
    for key in TORCHTITAN_V0_2_2_KEYS:
        status, notes = key_status(key)
        lines.append(f"| `{key}` | {_cell(status)} | {_cell(notes)} |")
    return "\n".join(lines) + "\n"


def splice_torchtitan_table(document: str) -> str:
    return splice_between(document, BEGIN_MARKER, END_MARKER, format_torchtitan_table())
