"""The fault soak's short version (scripts/soak.py): a 1- and a 2-process run, each killed with kill -9 a few times
at random moments and restarted by the same command until done; its loss curve equals an uninterrupted run's bit
for bit, and no process outlives any of its runs. `python scripts/soak.py --kills 20 ...` is the long one."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.torch_independent]

REPO = Path(__file__).resolve().parents[2]
SOAK = [sys.executable, "scripts/soak.py"]


def run_soak(*args: str, timeout: float) -> subprocess.CompletedProcess:
    """The soak, ended with SIGTERM on a timeout (it then kills the run it is soaking on its way out)."""
    process = subprocess.Popen([*SOAK, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=30)
        pytest.fail(f"the soak took over {timeout} s:\n{stdout[-3000:]}\n{stderr[-2000:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.mark.slow
@pytest.mark.parametrize("nproc, kills", [(1, 2), pytest.param(2, 1, marks=pytest.mark.multiprocess)])
def test_a_run_killed_at_random_moments_ends_as_an_uninterrupted_one(tmp_path, nproc, kills):
    result = run_soak("--nproc", str(nproc), "--kills", str(kills), "--steps", "12", "--interval", "2", "--seed", "0",
                      "--work-dir", str(tmp_path / "soak"), timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert f"| {nproc} | {kills} |" in result.stdout  # every kill was made
    # Each kill ended the run, leaving no process behind, or the run went on (it needed no more of a killed data
    # loader worker's documents).
    assert result.stdout.count("all gone") + result.stdout.count("the run went on") == kills
    assert "soak passed" in result.stdout


def test_a_bad_argument_is_one_line():
    result = subprocess.run([*SOAK, "--kills", "-1"], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["error: --kills -1 is below 0 (see --help)"]
