"""What torch.compile did in this process: a report a person can act on, written after the first step and kept
current over the run (compile_watch.py: a later recompile rewrites it, and it is written a last time at exit).

Everything comes from what torch keeps anyway, so collecting it costs nothing while compiling:

- ``torch._dynamo.utils.calculate_time_spent()``: cumulative compile phases (dynamo's frame compiles, the AOT
  autograd backend, inductor, the backward graphs compiled at the first backward), for the total and its split;
- ``get_compilation_metrics()``: one record per frame compile (name, file and line, times, graph size, guards, the
  failed guard of a recompile) and one per lazily compiled backward graph (matched to its frame by compile id);
- ``counters``: graph breaks by reason, unique graphs, FX graph cache and AOT autograd cache hits and misses;
- dynamo's ``graph_breaks`` log, which alone says *where* a break is in user code: ``watch_graph_breaks``
  captures it (without printing it) from before the model is compiled.

Torch keeps the last 64 frame records (``torch._dynamo.utils.set_compilation_metrics_limit``); the totals and
counters are not limited. All of it is cumulative over the process.
"""

from __future__ import annotations

import ast
import functools
import json
import logging
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

_BREAK_LOCATION = re.compile(
    r"in user code at (?P<file>.*):(?P<line>\d+)\nGraph Break Reason: (?P<reason>.*?)(\nUser code traceback:|$)", re.S
)


class _GraphBreakLocations(logging.Handler):
    """Collects the user-code location and message of each graph break from dynamo's ``graph_breaks`` log."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.breaks: list[tuple[str, str]] = []  # (file:line, dynamo's message)

    def emit(self, record: logging.LogRecord) -> None:
        match = _BREAK_LOCATION.search(record.getMessage())
        if match:
            self.breaks.append((f"{match['file']}:{match['line']}", match["reason"]))


_watch: _GraphBreakLocations | None = None
_saved_logger_state: tuple[int, bool] = (logging.NOTSET, True)


def _graph_break_logger() -> logging.Logger | None:
    try:
        from torch._dynamo.symbolic_convert import graph_break_log
    except ImportError:  # another torch: breaks are still counted, without their locations
        return None
    return graph_break_log


def watch_graph_breaks() -> None:
    """Record where graph breaks happen from now on (idempotent). Dynamo writes one debug record per break; unless
    the user asked for that log (``TORCH_LOGS=graph_breaks``), it is captured here and kept out of the log."""
    global _watch, _saved_logger_state
    log = _graph_break_logger()
    if log is None or _watch is not None:
        return
    _watch = _GraphBreakLocations()
    _saved_logger_state = (log.level, log.propagate)
    if not log.isEnabledFor(logging.DEBUG):
        log.setLevel(logging.DEBUG)
        log.propagate = False
    log.addHandler(_watch)


def stop_watching_graph_breaks() -> None:
    """Detach what ``watch_graph_breaks`` attached and forget the breaks it recorded."""
    global _watch
    log = _graph_break_logger()
    if log is None or _watch is None:
        return
    log.removeHandler(_watch)
    log.setLevel(_saved_logger_state[0])
    log.propagate = _saved_logger_state[1]
    _watch = None


@dataclass
class FrameCompile:
    """One frame compiled by dynamo (a block's forward, a resume function after a graph break, the loss, ...)."""

    compile_id: str  # "<frame>/<recompile>": "0/1" is frame 0's first recompile
    name: str
    qualname: str  # with its class: "TransformerBlock.forward"; the name the profiler tables give its graphs
    location: str  # file:first line of the compiled function
    total_s: float  # dynamo + AOT + inductor, including this frame's backward graph
    dynamo_s: float  # bytecode tracing, guards
    aot_autograd_s: float  # joint graph, partitioning (and backends other than inductor)
    inductor_s: float  # lowering, code generation, C++/Triton compilation
    backward_s: float  # the backward graph, compiled at the first backward (part of aot_autograd_s and inductor_s)
    graph_ops: int
    guards: int
    graph_breaks: int  # breaks dynamo had seen in the process when this frame finished
    recompile_reason: str | None = None  # the guard that failed, for a recompile
    failure: str | None = None  # why the compile failed (the frame then ran eagerly)
    step: int | None = None  # the training step after which the report first saw it (None outside a run)


@dataclass
class GraphBreak:
    reason: str  # the first line of dynamo's message
    count: int
    locations: list[str]  # user code, file:line (empty when the break log could not be watched)
    detail: str  # dynamo's whole message: explanation and hints


@dataclass
class CompileReport:
    """What torch.compile did in this process so far (see the module doc)."""

    compile_time_s: float
    time_split_s: dict[str, float]  # dynamo, aot_autograd, inductor: they add up to compile_time_s
    frames_compiled: int
    graphs: int
    frames: list[FrameCompile] = field(default_factory=list)
    graph_breaks: list[GraphBreak] = field(default_factory=list)
    recompiles: list[dict] = field(default_factory=list)  # frame, location, compile_id, reason, step
    cache: dict[str, dict[str, int]] = field(default_factory=dict)  # fx_graph / aot_autograd: hit, miss, bypass
    portable_cache: dict | None = None  # what compile.cache loaded before the first step: from, artifacts
    torch_version: str = torch.__version__
    through_step: int | None = None  # the last training step the report covers
    final: bool = False  # written when the training loop was left (done, preempted or failed): nothing follows

    @property
    def graph_break_count(self) -> int:
        return sum(b.count for b in self.graph_breaks)

    @property
    def recompile_reasons(self) -> list[str]:
        return [r["reason"] for r in self.recompiles]

    def format(self, path: Path | None = None) -> str:
        """One summary line (naming the report's `path`); a second naming the first graph break and recompile
        when there are any."""
        split = ", ".join(f"{name} {seconds:.1f}" for name, seconds in self.time_split_s.items())
        fx = self.cache.get("fx_graph", {})
        lines = [
            f"compile: {self.compile_time_s:.1f} s ({split}), {self.frames_compiled} frame(s) compiled, "
            f"{self.graphs} graph(s), {self.graph_break_count} graph break(s), {len(self.recompiles)} recompile(s), "
            f"FX graph cache {fx.get('hit', 0)} hit / {fx.get('miss', 0)} miss"
            + (f" ({sum(self.portable_cache['artifacts'].values())} artifact(s) loaded)" if self.portable_cache else "")
            + (f"; report: {path}" if path else "")
        ]
        firsts = []
        if self.graph_breaks:
            first = self.graph_breaks[0]
            where = f" at {first.locations[0]}" if first.locations else ""
            firsts.append(f"graph break x{first.count}: {first.reason}{where}")
        if self.recompiles:
            first = self.recompiles[0]
            firsts.append(f"recompile of {first['frame']} ({first['location']}): {first['reason']}")
        if firsts:
            lines.append("  " + "; ".join(firsts) + " (all of them in the report)")
        return "\n".join(lines)

    def to_json(self) -> dict:
        """The report as JSON data, seconds rounded to milliseconds."""
        document = _rounded(asdict(self))
        document["graph_break_count"] = self.graph_break_count
        return document


def _rounded(value):
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_rounded(item) for item in value]
    return value


def _seconds(value) -> float:
    return float(value or 0.0)


def _frames(metrics) -> list[FrameCompile]:
    frames: dict[str, FrameCompile] = {}
    backward: dict[str, list] = {}
    for m in metrics:
        compile_id = str(m.compile_id)
        if m.entire_frame_compile_time_s is None and m.fail_type is None:
            backward.setdefault(compile_id, []).append(m)
            continue
        total, backend, inductor = (
            _seconds(m.entire_frame_compile_time_s), _seconds(m.backend_compile_time_s),
            _seconds(m.inductor_compile_time_s),
        )
        frames[compile_id] = FrameCompile(
            compile_id=compile_id,
            name=str(m.co_name),
            qualname=qualified_name(str(m.co_filename), int(m.co_firstlineno or 0), str(m.co_name)),
            location=f"{m.co_filename}:{m.co_firstlineno}",
            total_s=total,
            dynamo_s=total - backend,
            aot_autograd_s=backend - inductor,
            inductor_s=inductor,
            backward_s=0.0,
            graph_ops=int(m.graph_op_count or 0),
            guards=int(m.guard_count or 0),
            graph_breaks=int(getattr(m, "num_graph_breaks", 0) or 0),
            recompile_reason=getattr(m, "recompile_reason", None) or None,
            failure=f"{m.fail_type}: {m.fail_reason}" if m.fail_type else None,
        )
    for compile_id, records in backward.items():
        frame = frames.get(compile_id)
        if frame is None:  # its frame's record fell out of torch's limited history
            continue
        for m in records:
            seconds = (m.duration_us or 0) / 1e6
            inductor = _seconds(m.inductor_compile_time_s)
            frame.backward_s += seconds
            frame.total_s += seconds
            frame.inductor_s += inductor
            frame.aot_autograd_s += seconds - inductor
    return list(frames.values())


def _graph_breaks(counted: dict[str, int]) -> list[GraphBreak]:
    logged = _watch.breaks if _watch is not None else []
    breaks = []
    for detail, count in sorted(counted.items(), key=lambda item: -item[1]):
        reason = detail.strip().splitlines()[0] if detail.strip() else detail
        # dict.fromkeys: each location once, in the order the breaks happened.
        where = list(dict.fromkeys(location for location, message in logged if reason in message))
        breaks.append(GraphBreak(reason=reason, count=int(count), locations=where, detail=detail))
    return breaks


def collect_compile_report() -> CompileReport:
    """Summarise torch's compile times, metrics and counters (cumulative over the process)."""
    from torch._dynamo.utils import calculate_time_spent, counters, get_compilation_metrics

    times = calculate_time_spent()
    frame_s, backend_s = times.get("entire_frame_compile", 0.0), times.get("backend_compile", 0.0)
    inductor_s, backward_s = times.get("inductor_compile", 0.0), times.get("entire_backward_compile", 0.0)
    frames = _frames(get_compilation_metrics())
    inductor_counts, aot_counts = counters["inductor"], counters["aot_autograd"]
    return CompileReport(
        compile_time_s=frame_s + backward_s,
        time_split_s={
            "dynamo": frame_s - backend_s,
            "aot_autograd": backend_s + backward_s - inductor_s,
            "inductor": inductor_s,
        },
        frames_compiled=sum(1 for f in frames if f.failure is None),
        graphs=int(counters["stats"]["unique_graphs"]),
        frames=frames,
        graph_breaks=_graph_breaks(dict(counters["graph_break"])),
        recompiles=[
            {"frame": f.qualname, "location": f.location, "compile_id": f.compile_id, "reason": f.recompile_reason,
             "step": None}
            for f in frames
            if f.recompile_reason
        ],
        cache={
            "fx_graph": {kind: int(inductor_counts[f"fxgraph_cache_{kind}"]) for kind in ("hit", "miss", "bypass")},
            "aot_autograd": {kind: int(aot_counts[f"autograd_cache_{kind}"]) for kind in ("hit", "miss", "bypass")},
        },
    )


def compiled_frame_names() -> dict[str, str]:
    """``compile_id`` -> qualified name of every frame torch still keeps a record of (the last 64)."""
    from torch._dynamo.utils import get_compilation_metrics

    return {
        str(m.compile_id): qualified_name(str(m.co_filename), int(m.co_firstlineno or 0), str(m.co_name))
        for m in get_compilation_metrics()
        if m.co_name is not None
    }


def qualified_name(filename: str, first_line: int, name: str) -> str:
    """``Class.method`` for a method defined at ``filename:first_line`` (dynamo records only the bare name, and
    every block's method is ``forward``); ``name`` itself when the source cannot say more."""
    return _definitions(filename).get((first_line, name), name)


@functools.lru_cache(maxsize=None)
def _definitions(filename: str) -> dict[tuple[int, str], str]:
    """(first line, name) -> qualified name of each function in a source file, read once per process."""
    try:
        tree = ast.parse(Path(filename).read_text())
    except (OSError, SyntaxError, ValueError):
        return {}
    found: dict[tuple[int, str], str] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qualname = f"{prefix}{child.name}"
                # A code object's first line is its first decorator's.
                for line in {child.lineno, *(decorator.lineno for decorator in child.decorator_list)}:
                    found[(line, child.name)] = qualname
                visit(child, f"{qualname}.<locals>.")

    visit(tree, "")
    return found


def report_file(run_dir: Path, rank: int) -> Path:
    """``compile_report.json`` for rank 0, ``compile_report_rank<N>.json`` for the others."""
    return Path(run_dir) / ("compile_report.json" if rank == 0 else f"compile_report_rank{rank}.json")


def save_compile_report(report: CompileReport, run_dir: Path, rank: int) -> Path:
    """Write `report` as this rank's JSON file, replacing the previous one at once (a reader, or a run killed
    mid-write, never leaves half a file)."""
    path = report_file(run_dir, rank)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(report.to_json(), indent=1) + "\n")
    partial.replace(path)
    return path
