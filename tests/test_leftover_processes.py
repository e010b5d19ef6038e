"""The session-end check of tests/conftest.py: a process a test leaves running fails the session (exit 1) and is
killed, named by pid and command line; pytest's own helpers (the forkserver dist_harness.py uses) and a process
that is just ending do not count."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# Run in a pytest of its own: one test leaks `sleep 60`, the others leave what must not count.
LEAKING_TESTS = '''
import multiprocessing
import os
import subprocess
import time


def test_uses_a_forkserver():  # the forkserver (and its resource tracker) live on until pytest ends
    process = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(0,))
    process.start()
    process.join()


def test_leaves_a_process_that_is_ending():
    subprocess.Popen(["sleep", "0.5"])


def test_leaks_a_process():
    leaked = subprocess.Popen(["sleep", "60"])
    with open(os.environ["LEAKED_PID_FILE"], "w") as file:
        file.write(str(leaked.pid))
'''


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_process_left_running_fails_the_session_and_is_killed(tmp_path):
    (tmp_path / "test_leaks.py").write_text(LEAKING_TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    pid_file = tmp_path / "leaked_pid"
    # As CI runs the suite (-p no:cacheprovider), with this suite's conftest as a plugin.
    env = {**os.environ, "PYTHONPATH": str(TESTS), "LEAKED_PID_FILE": str(pid_file)}
    session = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "conftest", "-q", "-c",
         str(tmp_path / "pytest.ini"), str(tmp_path / "test_leaks.py")],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    leaked = None
    try:
        output, _ = session.communicate(timeout=120)
        leaked = int(pid_file.read_text())
        assert session.returncode == 1, output
        assert "3 passed" in output, output
        (line,) = [line for line in output.splitlines() if "outlived them" in line]
        assert line == (
            f"error: 1 process(es) started by the tests outlived them (now killed): pid {leaked}: sleep 60"
        ), output
        assert not alive(leaked)
    finally:
        if session.poll() is None:
            os.killpg(session.pid, signal.SIGKILL)
            session.wait()
        if leaked is not None and alive(leaked):
            os.kill(leaked, signal.SIGKILL)
