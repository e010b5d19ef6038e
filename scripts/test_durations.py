"""Where the test suite's time goes, from pytest's JUnit XML report: seconds by test file and by kind.

    ./scripts/test.sh --junitxml=/tmp/suite.xml          # any pytest run that writes a report
    python scripts/test_durations.py /tmp/suite.xml      # the table (--top N files; default 40)

A test's time is its setup, call and teardown (a module fixture's training run counts in its first test). A file's
kind comes from its folder or from what it calls (./run_train.sh, a gloo world, torch.compile): multi-process
worlds and end-to-end CLI runs are where the time is.
"""

from __future__ import annotations

import _repo_env  # noqa: F401  (first: re-runs this script in the repository's .venv when needed)

import argparse
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The kind of a test file: by its folder first, then by what its source calls (checked in this order).
KINDS_BY_PATH = (
    ("docs pages", ("tests/docs/",)),
    ("reference suite", ("tests/reference/",)),
    ("fault tolerance groups", ("tests/fault_tolerance/",)),
)
KINDS_BY_CALL = (
    ("end-to-end CLI runs", ("run_train(", "start_train(", "start_two_process_run(", "run_train.sh")),
    ("compile", ("compile",)),
    ("multi-process worlds", ("run_world(", "parity_tests(")),
)


def kind_of(path: str) -> str:
    for kind, marks in KINDS_BY_PATH:
        if any(mark in path for mark in marks):
            return kind
    source = (REPO / path).read_text() if (REPO / path).is_file() else ""
    return next((kind for kind, calls in KINDS_BY_CALL if any(call in source for call in calls)), "in-process")


def file_times(report: str) -> dict[str, float]:
    """{test file: seconds} of every test case in the JUnit report."""
    times: dict[str, float] = defaultdict(float)
    for case in ElementTree.parse(report).iter("testcase"):
        parts = case.get("classname", "").split(".")  # package.module, or package.module.Class
        module = next((i for i, part in enumerate(parts) if part.startswith("test_")), len(parts) - 1)
        times["/".join(parts[: module + 1]) + ".py"] += float(case.get("time", 0))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", help="pytest's --junitxml file")
    parser.add_argument("--top", type=int, default=40, help="how many of the slowest files to list")
    opts = parser.parse_args()
    times = file_times(opts.report)
    total = sum(times.values())
    by_kind: dict[str, float] = defaultdict(float)
    for path, seconds in times.items():
        by_kind[kind_of(path)] += seconds
    print(f"total {total:.0f} s in {len(times)} files")
    print("\nby kind:")
    for kind, seconds in sorted(by_kind.items(), key=lambda item: -item[1]):
        print(f"  {seconds:7.0f} s  {100 * seconds / total:4.1f}%  {kind}")
    print(f"\nthe {opts.top} slowest files:")
    for path, seconds in sorted(times.items(), key=lambda item: -item[1])[: opts.top]:
        print(f"  {seconds:7.0f} s  {path}  ({kind_of(path)})")


if __name__ == "__main__":
    main()
