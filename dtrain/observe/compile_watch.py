"""The compile report over a whole run, not only its first step.

Steps after the first can compile again: validation's forward runs without grad (a global-state guard fails), a
short last batch has another shape, an MoE layer sees new token counts. ``CompileWatch`` writes the report after
the first step, rewrites it after any later step that compiled (logging one line per new compile: a recompile
with the guard that failed), and writes it a last time, marked ``final``, when the training loop is left: done,
preempted or failed.

The check after each step reads one number that dynamo keeps anyway (its total compile time): no device read, no
file, unless that number moved.
"""

from __future__ import annotations

import logging
from pathlib import Path

from dtrain.observe.compile_cache import PortableCompileCache
from dtrain.observe.compile_report import (
    CompileReport,
    FrameCompile,
    collect_compile_report,
    report_file,
    save_compile_report,
    stop_watching_graph_breaks,
)

logger = logging.getLogger("dtrain")


def compile_time_so_far_ns() -> float:
    """Dynamo's running total of time spent compiling frames and backward graphs: it moves with every compile
    (a recompile, a lazily compiled backward, a failed attempt), whether or not ``fullgraph`` is set."""
    from torch._dynamo.utils import cumulative_time_spent_ns

    return cumulative_time_spent_ns.get("entire_frame_compile", 0) + cumulative_time_spent_ns.get(
        "entire_backward_compile", 0
    )


class CompileWatch:
    """Keeps this rank's ``compile_report.json`` current over the run (see the module doc)."""

    def __init__(self, run_dir: Path, rank: int, compile_cache: PortableCompileCache | None) -> None:
        self.run_dir, self.rank, self.compile_cache = run_dir, rank, compile_cache
        self.path = report_file(run_dir, rank)
        self.first_seen: dict[str, int | None] = {}  # compile id -> the step after which the report first saw it
        self.compile_ns_seen = 0.0
        self.step: int | None = None  # the last finished step
        self.compiled_after_first_step = False

    def first_step(self, step: int) -> CompileReport:
        """Write the report of everything the first step compiled; returns it for the summary line."""
        self.step, self.compile_ns_seen = step, compile_time_so_far_ns()
        report, _ = self._write(final=False)
        return report

    def after_step(self, step: int) -> None:
        """After every step: when it compiled, rewrite the report and log each new compile."""
        self.step = step
        compile_ns = compile_time_so_far_ns()
        if compile_ns == self.compile_ns_seen:
            return
        self.compile_ns_seen, self.compiled_after_first_step = compile_ns, True
        _, new = self._write(final=False)
        for frame in new:
            logger.info(self._compile_line(frame))

    def close(self) -> None:
        """The final report, when the loop is left in any way (frames first seen here, in a step that did not
        finish, have no step); a summary line if anything compiled after the first step. Never raises: the
        loop's own error, if any, is the one to see."""
        stop_watching_graph_breaks()
        compiled_since = self.compile_ns_seen != compile_time_so_far_ns()
        try:
            report, _ = self._write(final=True)
        except Exception as error:  # torch's records or the disk: a warning, never an error that hides the loop's
            logger.warning(f"compile: the final report was not written to {self.path}: {error}")
            return
        if self.compiled_after_first_step or compiled_since:
            logger.info("compile, final:" + report.format(self.path).removeprefix("compile:"))

    def _write(self, final: bool) -> tuple[CompileReport, list[FrameCompile]]:
        """Collect, date each frame by the step after which it was first seen, write; returns the report and its
        frames new since the last write."""
        report = collect_compile_report()
        report.portable_cache = self.compile_cache.loaded if self.compile_cache is not None else None
        report.through_step, report.final = self.step, final
        new_at = None if final else self.step
        new = [frame for frame in report.frames if frame.compile_id not in self.first_seen]
        for frame in report.frames:
            frame.step = self.first_seen.setdefault(frame.compile_id, new_at)
        for recompile in report.recompiles:
            recompile["step"] = self.first_seen[recompile["compile_id"]]
        save_compile_report(report, self.run_dir, self.rank)
        return report, new

    def _compile_line(self, frame: FrameCompile) -> str:
        verb = "recompiled" if frame.recompile_reason else "compiled"
        why = f": {frame.recompile_reason}" if frame.recompile_reason else ""
        failed = f"; failed, runs eagerly: {frame.failure}" if frame.failure else ""
        return (
            f"compile: step {frame.step} {verb} {frame.qualname} ({frame.location}) as {frame.compile_id}{why}"
            f"{failed}; report: {self.path}"
        )
