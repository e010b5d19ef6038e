"""Which of CI's two runs each test file belongs to (.ci/run): every file runs under the default torch (2.13); the
second run, under torch 2.11 (the GPU machines' version), takes only what torch's version can change.

A directory decides for its files; a file in a directory of the second run that tests dtrain's own process, file
and log handling (kill -9, locks, preemption walkthroughs) marks itself `torch_independent`. tests/conftest.py
marks every test of a default-only directory `torch_independent`, so the second run is
`-m "not torch_independent"`; tests/test_torch_runs.py fails for a test file that no rule assigns.
"""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent

# What torch's version can change: the models, parallel layouts, the step, precision, checkpoint I/O (DCP), compile
# and profiling, fault tolerance over torch's process groups, the reference suite against torchtitan,
# transformers and PEFT, evaluation (the harness's numbers from the sharded model's forward), and preference tuning
# (its layouts' parity and TRL's numbers).
EVERY_TORCH = (
    "checkpoint", "eval", "fault_tolerance", "models", "observe", "parallelize", "precision", "preference",
    "reference", "step",
)
# What it cannot: config parsing, data readers and tokenizers, the docs pages, the CLI walkthroughs (every layout of
# which has its in-process parity world above), the launcher, locks and run folders, metrics sinks, the estimator's
# arithmetic, the run's hooks and pre-flight; and the suite's own checks at the top of tests/.
DEFAULT_TORCH_ONLY = ("config", "data", "docs", "e2e", "estimate", "metrics", "reliability", "run", ".")


def run_of(path: Path) -> str | None:
    """"every torch" or "default torch only" for the test file at `path` (by its directory), None if no rule says
    or the file is not one of this suite's (a test's own scratch pytest session)."""
    if not path.resolve().is_relative_to(TESTS):
        return None
    folder = path.resolve().relative_to(TESTS).parent.as_posix()
    top = folder.split("/")[0]
    if top in EVERY_TORCH:
        return "every torch"
    if top in DEFAULT_TORCH_ONLY:
        return "default torch only"
    return None
