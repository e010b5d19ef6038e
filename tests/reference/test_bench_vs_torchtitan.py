"""scripts/bench_vs_torchtitan.py's CPU dry run, so that the GPU benchmark never rots: both sides run from one seed
on the same batches (torchtitan's side: its components, torchtitan_train_loop.py), the table has a row per side
with every column filled, and the losses agree in fp32 to 1e-5; and its reading of torchtitan's console line."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
from run_train_helpers import REPO, user_env

pytestmark = pytest.mark.slow


def _bench_module(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "scripts"))  # where the script and its neighbour bench_layouts live
    return importlib.import_module("bench_vs_torchtitan")


def test_the_dry_run_prints_both_sides_with_agreeing_losses(tmp_path):
    report = tmp_path / "report.md"
    command = [sys.executable, "scripts/bench_vs_torchtitan.py", "--dry_run", "--shapes", "debug", "--variants",
               "eager", "--rounds", "1", "--steps", "3", "--warmup", "1", "--output", str(report)]
    result = subprocess.run(command, cwd=REPO, env=user_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = report.read_text().splitlines()
    assert lines[0].startswith("date: ") and "torchtitan 0.2.2" in lines[1]
    assert lines[2] == "command: `python scripts/bench_vs_torchtitan.py " + " ".join(command[2:]) + "`"
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines if line.startswith("| debug")]
    assert [row[:3] for row in rows] == [["debug", "eager", "torchtitan"], ["debug", "eager", "dtrain"]]
    torchtitan, dtrain = rows
    assert all(cell for cell in dtrain) and all(cell for cell in torchtitan[:10])
    assert float(dtrain[9]) <= 1e-5  # the largest relative loss difference of any step
    assert "(" in dtrain[10] and "%" in dtrain[11]  # the estimate beside the measurement, with its error


def test_torchtitans_console_line_is_read_without_its_colours(monkeypatch):
    bench = _bench_module(monkeypatch)
    line = ("\x1b[31mstep:  2  \x1b[32mloss:  7.54321  \x1b[33mgrad_norm:  1.2345  \x1b[36mmemory: 12.34GiB(15.60%)  "
            "\x1b[34mtps: 12,345  \x1b[36mtflops: 100.00  \x1b[35mmfu: 10.11%\x1b[39m")
    match = bench.TORCHTITAN_LINE.search(bench.ANSI.sub("", line))
    assert match.groups() == ("2", "7.54321", "12.34", "12,345")
