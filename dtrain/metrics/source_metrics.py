"""A dataset mixture's per-source fields in the logged record, and their console line.

The step reports `loss/<name>` and `tokens/<name>` for each source (dtrain/step/source_loss.py), the loop adds
`tokens_seen/<name>` (each source's tokens so far, from the data loader). Here each source gets its share of the
step's label tokens, `token_share/<name>`, and a source that had no token in the step gets no loss (null in
metrics.jsonl, no TensorBoard point) rather than 0/0.

The console shows the sources on a line of their own under the step's line: the step's line keeps its columns
whatever the number of sources, and a blend of five still reads at a glance, e.g.
``sources  web loss 2.3100 share 70.0%  code loss 1.8700 share 20.0%  books loss - share 0.0%``.
"""

from __future__ import annotations

from typing import Any, Mapping

LOSS, TOKENS, SHARE, SEEN = "loss/", "tokens/", "token_share/", "tokens_seen/"


def source_names(values: Mapping[str, Any]) -> list[str]:
    """The sources whose step metrics `values` holds, in the order the step reported them."""
    return [key[len(TOKENS) :] for key in values if key.startswith(TOKENS)]


def source_fields(values: dict[str, Any]) -> dict[str, Any]:
    """Take the per-source fields out of `values` (read metrics) and return them grouped by source, with each
    source's share of the step's tokens; a loss without tokens becomes None."""
    names = source_names(values)
    step_tokens = sum(values[TOKENS + name] for name in names)
    fields: dict[str, Any] = {}
    for name in names:
        tokens = values.pop(TOKENS + name)
        loss = values.pop(LOSS + name, None)
        fields[LOSS + name] = loss if tokens > 0 else None
        fields[TOKENS + name] = int(tokens)
        fields[SHARE + name] = tokens / step_tokens if step_tokens > 0 else None
        if SEEN + name in values:
            fields[SEEN + name] = int(values.pop(SEEN + name))
    return fields


def format_sources_line(record: Mapping[str, Any]) -> str | None:
    """The console line of a record's sources (None without a mixture)."""
    names = source_names(record)
    if not names:
        return None
    parts = []
    for name in names:
        loss, share = record[LOSS + name], record[SHARE + name]
        loss_text = "-" if loss is None else f"{loss:.4f}"
        parts.append(f"{name} loss {loss_text} share {'-' if share is None else f'{share:.1%}'}")
    return "sources  " + "  ".join(parts)
