"""What a profiler window's events say beyond operator names: which compiled graph ran, and in which phase of the
step (forward, backward, optimizer) the time went.

``name_compiled_graphs`` renames, in place, inductor's ``## Call CompiledFxGraph <cache key> ##`` events and the
``CompiledFunction`` / ``CompiledFunctionBackward`` wrappers after the compile report's frame
(``TransformerBlock.forward [0/0]``): dynamo's ``Torch-Compiled Region: <compile id>`` ties a forward to its
frame, and a backward event's autograd sequence number ties it to its forward. Identical blocks share one
compiled frame, so their rows add up over the blocks. The phase split sorts each recorded step's CPU time into
backward (the autograd engine's outermost events), optimizer (``Optimizer.step#`` / ``zero_grad#``), forward (the
other top-level events that end before a backward starts) and other. What the renamed rows and the phases mean
to a reader: docs/profiling.md, "Profiler" ("Compiled graphs", "The phase split").
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.autograd.profiler_util import FunctionEvent

REGION = "Torch-Compiled Region: "
FX_GRAPH_CALL = "## Call CompiledFxGraph "
FORWARD_WRAPPER = "CompiledFunction"
BACKWARD_WRAPPER = "CompiledFunctionBackward"
ENGINE = "autograd::engine::evaluate_function: "
OPTIMIZER = ("Optimizer.step#", "Optimizer.zero_grad#")
STEP = "ProfilerStep"  # the profiler's events name every step span "ProfilerStep*", the trace "ProfilerStep#<n>"
PHASES = ("forward", "backward", "optimizer", "other")


def name_compiled_graphs(events: list[FunctionEvent], frame_names: dict[str, str]) -> int:
    """Rename the compiled-graph events of a window (see the module doc) with `frame_names` (compile id ->
    qualified name: ``compile_report.compiled_frame_names()``); returns how many graph calls were named."""
    forward_regions: dict[tuple[int, int], str] = {}  # (thread, autograd sequence number) -> compile id
    for event in events:
        if event.name == FORWARD_WRAPPER and event.cpu_parent is not None and event.cpu_parent.name.startswith(REGION):
            forward_regions[(event.thread, event.sequence_nr)] = event.cpu_parent.name.removeprefix(REGION)
    # All found before any is renamed: finding one walks up through names that renaming changes.
    graphs = [(event, _graph_of(event, forward_regions)) for event in events]
    named = 0
    for event, graph in graphs:
        if graph is None:
            continue
        compile_id, phase = graph
        label = f"{frame_names.get(compile_id, 'frame')} [{compile_id}]"
        if event.name.startswith(FX_GRAPH_CALL):
            event.name = f"{FX_GRAPH_CALL}{label} {phase} ##"
            named += 1
        elif event.name in (FORWARD_WRAPPER, BACKWARD_WRAPPER, ENGINE + BACKWARD_WRAPPER):
            event.name = f"{event.name} {label}"
    return named


def _graph_of(event: FunctionEvent, forward_regions: dict[tuple[int, int], str]) -> tuple[str, str] | None:
    """(compile id, forward or backward) of a compiled-graph event, or None for any other event."""
    if not (event.name.startswith(FX_GRAPH_CALL) or event.name in (FORWARD_WRAPPER, BACKWARD_WRAPPER,
                                                                    ENGINE + BACKWARD_WRAPPER)):
        return None
    node: FunctionEvent | None = event
    while node is not None:
        if node.name.startswith(REGION):
            return node.name.removeprefix(REGION), "forward"
        if node.name in (BACKWARD_WRAPPER, ENGINE + BACKWARD_WRAPPER):
            compile_id = forward_regions.get((node.fwd_thread, node.sequence_nr))
            return (compile_id, "backward") if compile_id is not None else None
        node = node.cpu_parent
    return None


@dataclass(frozen=True)
class PhaseSplit:
    """CPU time of the window's recorded steps by phase (microseconds, summed over the steps)."""

    steps: int
    total_us: float
    phases_us: dict[str, float]  # forward, backward, optimizer, other: they add up to total_us


def phase_split(events: list[FunctionEvent]) -> PhaseSplit:
    """Split each ``ProfilerStep`` span of `events` into forward, backward, optimizer and other (module doc)."""
    steps = [event for event in events if event.name.startswith(STEP)]
    backward = [event for event in events if event.name.startswith(ENGINE) and not _inside(event, ENGINE)]
    optimizer = [event for event in events if event.name.startswith(OPTIMIZER) and not _inside(event, OPTIMIZER)]
    phases = dict.fromkeys(PHASES, 0.0)
    total = 0.0
    for step in steps:
        step_backward = [event for event in backward if _starts_in(event, step)]
        step_optimizer = [event for event in optimizer if _starts_in(event, step)]
        last_backward_start = max((event.time_range.start for event in step_backward), default=None)
        counted = {id(event) for event in step_backward + step_optimizer}
        forward = [
            event for event in step.cpu_children
            if id(event) not in counted and last_backward_start is not None
            and event.time_range.end <= last_backward_start
        ]
        spent = {
            "forward": sum(event.cpu_time_total for event in forward),
            "backward": sum(event.cpu_time_total for event in step_backward),
            "optimizer": sum(event.cpu_time_total for event in step_optimizer),
        }
        # On CUDA the backward runs on another thread while the main thread waits: it replaces that wait.
        spent["other"] = max(0.0, step.cpu_time_total - sum(spent.values()))
        for phase, microseconds in spent.items():
            phases[phase] += microseconds
        total += sum(spent.values())
    return PhaseSplit(len(steps), total, phases)


def _starts_in(event: FunctionEvent, step: FunctionEvent) -> bool:
    return step.time_range.start <= event.time_range.start < step.time_range.end


def _inside(event: FunctionEvent, prefixes: str | tuple[str, ...]) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(prefixes):
            return True
        parent = parent.cpu_parent
    return False


def format_phase_split(split: PhaseSplit) -> str:
    """The split as a markdown table under its title."""
    rows = [["phase", "CPU ms", "% of steps"]]
    for phase, microseconds in split.phases_us.items():
        share = 100 * microseconds / split.total_us if split.total_us else 0.0
        rows.append([phase, f"{microseconds / 1000:.3f}", f"{share:.1f}"])
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["| " + " | ".join(cell.ljust(width) for cell, width in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "| " + " | ".join("-" * width for width in widths) + " |")
    title = f"step time by phase over {split.steps} recorded step(s) (total {split.total_us / 1000:.3f} ms)"
    return "\n".join([title, *lines])
