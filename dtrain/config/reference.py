"""The Markdown field reference of docs/configuration.md, generated from the schema.

`scripts/gen_config_docs.py` writes it between the markers below; a test fails when the committed doc and the
schema disagree, so the reference cannot drift.
"""

from __future__ import annotations

from dtrain.config.fields import FieldSpec, config_fields, section_names
from dtrain.config.toml_io import toml_value

BEGIN_MARKER = "<!-- BEGIN GENERATED FIELD REFERENCE (scripts/gen_config_docs.py) -->"
END_MARKER = "<!-- END GENERATED FIELD REFERENCE -->"


def _cell(text: str) -> str:
    """Text that is safe inside a Markdown table cell."""
    return text.replace("|", "\\|")


def _description(spec: FieldSpec) -> str:
    parts = [spec.doc]
    if spec.choices:
        parts.append("One of " + ", ".join(f"`{c}`" for c in spec.choices) + ".")
    if spec.minimum is not None:
        parts.append(f"Minimum {spec.minimum:g}.")
    return _cell(" ".join(parts))


def format_reference_markdown() -> str:
    """One table per section: key, type, TOML default (or unset), and description with choices and minimum."""
    lines: list[str] = []
    specs = list(config_fields().values())
    for section in section_names():
        lines += [f"### `[{section}]`", "", "| Key | Type | Default | Description |", "|---|---|---|---|"]
        for spec in (s for s in specs if s.section == section):
            default = "unset" if spec.default is None else f"`{_cell(toml_value(spec.default))}`"
            lines.append(f"| `{spec.name}` | {_cell(spec.type_name)} | {default} | {_description(spec)} |")
        lines.append("")
    return "\n".join(lines)


def splice_between(document: str, begin: str, end: str, text: str) -> str:
    """`document` with what lies between the markers `begin` and `end` replaced by `text`."""
    start = document.index(begin) + len(begin)
    stop = document.index(end)
    return document[:start] + "\n\n" + text + "\n" + document[stop:]


def splice_reference(document: str) -> str:
    """`document` with the text between the markers replaced by the current reference."""
    return splice_between(document, BEGIN_MARKER, END_MARKER, format_reference_markdown())
