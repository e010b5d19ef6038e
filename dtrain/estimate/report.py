"""The estimate as a person reads it: per-rank memory by kind (one column per pipeline stage) against the device's
memory, the communication per step, the step time, and one verdict line."""

from __future__ import annotations

from dtrain.estimate.estimator import Estimate, StageEstimate

GIB = 2**30


def gib(value: float) -> str:
    return f"{value / GIB:,.2f}"


def _table(header: list[str], rows: list[list[str]], left: tuple[int, ...] = (0,)) -> list[str]:
    """Aligned columns: those in `left` (the words) flush left, the others (numbers) flush right."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    def line(row: list[str]) -> str:
        cells = [cell.ljust(w) if i in left else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        return "  ".join(cells).rstrip()
    return [line(header), *(line(row) for row in rows)]


def stage_label(stage: StageEstimate) -> str:
    return f"stage {stage.stage} (rank {stage.rank})"


def memory_rows(result: Estimate) -> list[list[str]]:
    """One row per kind of memory (kinds no stage holds left out), then the total and the device's memory."""
    stages = [s.memory for s in result.stages]
    kinds = [
        ("params", [m.params for m in stages]),
        ("grads", [m.grads for m in stages]),
        ("DDP grad buckets", [m.grad_buckets for m in stages]),
        ("optimizer state", [m.optimizer for m in stages]),
        ("activations", [m.activations for m in stages]),
        ("gathered params (FSDP)", [m.gathered for m in stages]),
        ("batches", [m.batches for m in stages]),
        ("optimizer step temporaries", [m.optimizer_step for m in stages]),
    ]
    always = ("params", "grads", "optimizer state", "activations", "batches")
    rows = [[name, *map(gib, values)] for name, values in kinds if name in always or any(values)]
    rows.append(["total", *(gib(m.total) for m in stages)])
    rows.append([f"device memory ({result.hardware.name})", *([gib(result.memory_budget_bytes)] * len(stages))])
    return rows


def verdict(result: Estimate) -> str:
    """One line: whether the most loaded rank fits the device, and by how much."""
    busiest, budget = result.busiest, result.memory_budget_bytes
    total = busiest.memory.total
    where = f"{stage_label(busiest)} needs {gib(total)} GiB"
    if result.fits:
        spare = gib(budget - total)
        return f"verdict: fits: {where} of the {result.hardware.name}'s {gib(budget)} GiB ({spare} GiB spare)"
    return (f"verdict: DOES NOT FIT: {where}, {gib(total - budget)} GiB more than the {result.hardware.name}'s "
            f"{gib(budget)} GiB")


def format_report(result: Estimate, dtype: str) -> str:
    """The estimate as the lines a person reads: the layout, the memory table, communication, time, verdict."""
    lines = [result.description, ""]
    lines += _table(["memory per rank (GiB)", *map(stage_label, result.stages)], memory_rows(result))
    if any(s.memory.optimizer_step for s in result.stages):
        lines.append("(optimizer step temporaries come after backward: the total has the larger of them and "
                     "activations + gathered params)")
    busiest = result.busiest
    if busiest.collectives:
        rows = [[c.name, f"{c.dim} ({c.group_size})", f"{c.bytes / 1e9:,.2f}",
                 f"{result.comm_time_s[c.name] * 1e3:,.1f}", "overlapped" if c.overlapped else "exposed"]
                for c in busiest.collectives]
        header = [f"communication per step, {stage_label(busiest)}", "over", "GB", "ms", ""]
        lines += ["", *_table(header, rows, left=(0, 1, 4))]
    lines += [
        "",
        f"step {result.step_time_s:,.3f} s: compute {result.compute_time_s * 1e3:,.1f} ms, exposed comm "
        f"{result.exposed_comm_s * 1e3:,.1f} ms, pipeline bubble {100 * result.bubble_fraction:.1f}%; "
        f"{result.tokens_per_s_per_device:,.0f} tokens/s/device; MFU {100 * result.mfu(dtype):.1f}%",
    ]
    lines += [f"note: {note}" for note in result.notes]
    lines.append(verdict(result))
    return "\n".join(lines)
