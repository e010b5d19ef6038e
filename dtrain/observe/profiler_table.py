"""The top-k operator table of a profiler window: which operators the recorded steps spent their time in.

The rows are the profiler's own aggregation (``key_averages``, grouped by input shape when shapes are recorded),
sorted by self time: the time spent in an operator itself, not in the operators it calls, so the rows add up to
the window's total. On CUDA there is a second table sorted by self CUDA time (the kernels an operator launched).
Compiled graphs are rows of their own, named by profiler_events.py (which frame, forward or backward), and the
tables are followed by the window's split into forward, backward, optimizer and other time. Each table is written
as text (markdown, readable in a terminal) and as JSON for scripts.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from torch.autograd.profiler_util import EventList

from dtrain.observe.profiler_events import PhaseSplit, format_phase_split

# Input shapes longer than this are cut in the text table (the JSON keeps them whole).
SHAPES_WIDTH = 60


@dataclass(frozen=True)
class OperatorRow:
    """One operator (or one operator and input shapes) summed over the recorded steps of a window."""

    name: str
    calls: int
    self_cpu_us: float
    cpu_total_us: float
    self_device_us: float
    input_shapes: str


@dataclass(frozen=True)
class OperatorTable:
    """The ``top`` operators of a window by ``sort_key`` (``self_cpu_us`` or ``self_device_us``)."""

    title: str
    sort_key: str
    total_us: float  # the sort key summed over all operators: the 100% of the share column
    rows: list[OperatorRow]


def operator_tables(events: EventList, top: int, with_device: bool, with_shapes: bool) -> list[OperatorTable]:
    """The top-``top`` tables of ``events`` (a profiler's ``key_averages()``): by self CUDA time when
    ``with_device``, then by self CPU time. ``with_shapes`` shows the input shapes the events were grouped by."""
    rows = [
        OperatorRow(
            name=event.key,
            calls=event.count,
            self_cpu_us=event.self_cpu_time_total,
            cpu_total_us=event.cpu_time_total,
            self_device_us=event.self_device_time_total if with_device else 0.0,
            input_shapes=str(event.input_shapes) if with_shapes else "",
        )
        for event in events
    ]
    sort_keys = [("self_device_us", "self CUDA time")] if with_device else []
    sort_keys.append(("self_cpu_us", "self CPU time"))
    tables = []
    for key, label in sort_keys:
        ranked = sorted(rows, key=lambda row: getattr(row, key), reverse=True)
        total = sum(getattr(row, key) for row in rows)
        tables.append(OperatorTable(f"top {top} operators by {label}", key, total, ranked[:top]))
    return tables


def format_table(table: OperatorTable, with_device: bool, with_shapes: bool) -> str:
    """``table`` as an aligned markdown table under its title, times in milliseconds."""
    header = ["operator", "calls", "self CPU ms", "CPU total ms"]
    if with_device:
        header.append("self CUDA ms")
    header.append("% of total")
    if with_shapes:
        header.append("input shapes")
    lines = [header]
    for row in table.rows:
        share = 100 * getattr(row, table.sort_key) / table.total_us if table.total_us else 0.0
        line = [row.name, str(row.calls), _ms(row.self_cpu_us), _ms(row.cpu_total_us)]
        if with_device:
            line.append(_ms(row.self_device_us))
        line.append(f"{share:.1f}")
        if with_shapes:
            line.append(_cut(row.input_shapes, SHAPES_WIDTH))
        lines.append(line)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = [_markdown_row(lines[0], widths), _markdown_row(["-" * w for w in widths], widths)]
    text += [_markdown_row(line, widths) for line in lines[1:]]
    total = f"{table.title} (total {_ms(table.total_us)} ms)"
    return "\n".join([total, *text])


def write_tables(
    tables: list[OperatorTable], split: PhaseSplit, folder: Path, rank: int, with_device: bool, with_shapes: bool,
    steps: int,
) -> Path:
    """Write ``rank<r>_top_ops.txt`` and ``rank<r>_top_ops.json`` into ``folder``: the tables, then the phase
    split; returns the text file's path."""
    text = "\n\n".join([*(format_table(table, with_device, with_shapes) for table in tables),
                         format_phase_split(split)])
    path = folder / f"rank{rank}_top_ops.txt"
    note = f"times are summed over the window's {steps} recorded step(s); % is the share of the sorted column"
    path.write_text(f"{note}\n\n{text}\n")
    document = {
        "recorded_steps": steps,
        "tables": [
            {"title": t.title, "sort_key": t.sort_key, "total_us": t.total_us, "rows": [asdict(r) for r in t.rows]}
            for t in tables
        ],
        "phases": {"total_us": split.total_us, "phases_us": split.phases_us},
    }
    (folder / f"rank{rank}_top_ops.json").write_text(json.dumps(document, indent=1))
    return path


def _ms(microseconds: float) -> str:
    return f"{microseconds / 1000:.3f}"


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _markdown_row(cells: list[str], widths: list[int]) -> str:
    return "| " + " | ".join(cell.ljust(width) for cell, width in zip(cells, widths)) + " |"
