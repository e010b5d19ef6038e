"""Session-wide test settings: one shared inductor cache, quiet torchao, the CUDA marker's skip, the CI run of each
test file (torch_runs.py), and the check that no test leaves a process behind."""

import os
import signal
import sys
import tempfile
import time
import uuid

import pytest

# Every cold compile costs 5–30 s on a small CPU; sharing one cache across the session (and its subprocesses,
# which inherit the environment) pays that once per graph.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "dtrain_inductor_cache"))
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
# Tests load scripts/*.py by path; each imports scripts/_repo_env.py first (a no-op in this environment).
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

# Every process a test starts (torchrun, workers, forkserver children, their children) inherits this session's id
# in its environment, so the session's end finds any that are still running, wherever they were re-parented.
# Ids accumulate: a pytest run by a test marks its processes with its own id and with the outer session's.
SESSIONS_ENV = "DTRAIN_TEST_SESSIONS"
# Processes that are ending (a worker whose launcher just died) get this long before they count as left behind.
LEFTOVER_GRACE_SECONDS = 5.0
# Helpers of pytest itself, started from it and ending with it: multiprocessing's forkserver (dist_harness.py) and
# resource tracker. Only the helper is exempt: its children (a forkserver's ranks) are the tests' processes.
# Children of pytest itself that live until it exits, by design: multiprocessing's helpers, and the addr2line
# processes torch keeps open to symbolize C++ frames once a CUDA memory snapshot has been dumped (seen on an H200).
_PYTEST_HELPERS = (
    b"from multiprocessing.forkserver import main",
    b"from multiprocessing.resource_tracker import main",
    b"addr2line ",
)
_session_id = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
_leftovers: list[str] = []  # the session-end check's lines, for the terminal summary


def pytest_sessionstart(session):
    outer = os.environ.get(SESSIONS_ENV)
    os.environ[SESSIONS_ENV] = f"{outer},{_session_id}" if outer else _session_id


def pytest_collection_modifyitems(config, items):
    import torch

    from torch_runs import run_of

    default_only = pytest.mark.torch_independent  # CI's second run (torch 2.11) leaves these out: torch_runs.py
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if run_of(item.path) == "default torch only":
            item.add_marker(default_only)
        if skip is not None and "cuda" in item.keywords:
            item.add_marker(skip)


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError:  # ended meanwhile, or another user's
        return None


def _parent(pid: int) -> int | None:
    stat = _read(f"/proc/{pid}/stat")
    return int(stat.rsplit(b")", 1)[1].split()[1]) if stat else None


def _marked_processes() -> dict[int, str]:
    """{pid: command line} of the live processes that carry this session's id, pytest and its helpers aside.

    A process's environ is the one it started with (so not pytest's own); a zombie's reads empty."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        environ = _read(f"/proc/{name}/environ") or b""
        marks = [v for v in environ.split(b"\0") if v.startswith(f"{SESSIONS_ENV}=".encode())]
        if not marks or _session_id.encode() not in marks[0].split(b"=", 1)[1].split(b","):
            continue
        cmdline = _read(f"/proc/{name}/cmdline") or b""
        if _parent(int(name)) == os.getpid() and any(helper in cmdline for helper in _PYTEST_HELPERS):
            continue
        found[int(name)] = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()
    return found


def _stop_compile_workers() -> None:
    """Inductor's compile-worker pool lives until the interpreter exits: end it now, as its exit hook would."""
    if "torch._inductor.async_compile" in sys.modules:
        sys.modules["torch._inductor.async_compile"].shutdown_compile_workers()


@pytest.hookimpl(trylast=True)  # after session-scoped fixtures are torn down
def pytest_sessionfinish(session, exitstatus):
    """Fail the session if processes the tests started still run; they are killed, and named at the end."""
    if not os.path.isdir("/proc"):
        return
    _stop_compile_workers()
    deadline = time.monotonic() + LEFTOVER_GRACE_SECONDS
    while (left := _marked_processes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not left:
        return
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    listed = "; ".join(f"pid {pid}: {cmdline}" for pid, cmdline in sorted(left.items()))
    _leftovers.append(f"error: {len(left)} process(es) started by the tests outlived them (now killed): {listed}")
    if session.exitstatus == pytest.ExitCode.OK:  # an interruption or an internal error keeps its own code
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    for line in _leftovers:
        terminalreporter.write_line(line, red=True)
