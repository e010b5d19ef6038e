"""torch.compile per transformer block, a structured compile trace for tlparse, and a short compile report.

Each block is compiled in place (``nn.Module.compile``), so parameter names do not change. The blocks are
identical modules, so dynamo compiles the first one and reuses its graph for the rest: compile time does not
grow with depth. The report says whether that held (one frame compiled, no recompiles, no graph breaks).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

from torch import nn

from dtrain.models.moe import MoE

_trace_handler: logging.Handler | None = None


def apply_compile(blocks: nn.ModuleDict, backend: str = "inductor") -> None:
    """Compile every block in place with ``fullgraph=True``: a graph break inside a block is an error, not a
    silent slowdown. Blocks with an MoE layer are the exception: sizing the expert-parallel all-to-alls and the
    per-expert loop read token counts on the host, and the experts are an FSDP unit of their own inside the
    block, whose hooks dynamo does not trace; those blocks compile into the graphs between such breaks."""
    for block in blocks.values():
        has_moe = any(isinstance(module, MoE) for module in block.modules())
        block.compile(backend=backend, fullgraph=not has_moe)


def start_compile_trace(trace_dir: str) -> None:
    """Write torch's structured compile log (what ``TORCH_TRACE=<dir>`` writes) into ``trace_dir``.

    One ``dedicated_log_torch_trace_rank_<r>_*.log`` file per rank; ``tlparse <file>`` renders it as HTML with
    every graph, guard, recompile and graph break. Setting the ``TORCH_TRACE`` variable would have to happen
    before torch is imported; this attaches the same handler at run time instead.
    """
    global _trace_handler
    from torch._logging._internal import LazyTraceHandler, TorchLogsFormatter, trace_log

    stop_compile_trace()
    handler = LazyTraceHandler(trace_dir)
    handler.setFormatter(TorchLogsFormatter(trace=True))
    trace_log.setLevel(logging.DEBUG)
    trace_log.addHandler(handler)
    _trace_handler = handler


def stop_compile_trace() -> None:
    """Detach (and flush) the handler that ``start_compile_trace`` attached, if any."""
    global _trace_handler
    from torch._logging._internal import trace_log

    if _trace_handler is not None:
        trace_log.removeHandler(_trace_handler)
        _trace_handler.close()
        _trace_handler = None


@dataclass
class CompileReport:
    """What torch.compile did in this process so far."""

    compile_time_s: float
    frames_compiled: int
    graphs: int
    graph_breaks: dict[str, int] = field(default_factory=dict)
    recompile_reasons: list[str] = field(default_factory=list)

    def format(self) -> str:
        """A one-line summary, then one line per graph break reason and per recompile."""
        lines = [
            f"compile: {self.compile_time_s:.1f} s, {self.frames_compiled} frame(s) compiled, {self.graphs} graph(s), "
            f"{sum(self.graph_breaks.values())} graph break(s), {len(self.recompile_reasons)} recompile(s)"
        ]
        lines += [f"  graph break x{count}: {reason}" for reason, count in self.graph_breaks.items()]
        lines += [f"  recompile: {reason}" for reason in self.recompile_reasons]
        return "\n".join(lines)


def compile_report() -> CompileReport:
    """Summarise dynamo's counters and per-frame compilation metrics (cumulative over the process)."""
    from torch._dynamo.utils import calculate_time_spent, counters, get_compilation_metrics

    metrics = get_compilation_metrics()
    times = calculate_time_spent()
    breaks = Counter({str(reason): int(count) for reason, count in counters["graph_break"].items()})
    return CompileReport(
        compile_time_s=float(times.get("total_wall_time", 0.0)),
        # One entry per dynamo frame compile, and one without guards per AOT backward compile: count the former.
        frames_compiled=sum(1 for m in metrics if getattr(m, "is_forward", True) and getattr(m, "has_guarded_code", True)),
        graphs=int(counters["stats"]["unique_graphs"]),
        graph_breaks=dict(breaks),
        recompile_reasons=[m.recompile_reason for m in metrics if getattr(m, "recompile_reason", None)],
    )
