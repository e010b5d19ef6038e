"""scripts/test_durations.py: a JUnit report's seconds summed by test file and told apart by kind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from test_durations import file_times, kind_of  # noqa: E402

REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.e2e.test_run_train_cli" name="test_a" time="2.5" />
<testcase classname="tests.e2e.test_run_train_cli" name="test_b[x]" time="1.5" />
<testcase classname="tests.step.test_lr_schedule.TestWarmup" name="test_c" time="0.25" />
<testcase classname="tests.docs.test_doc_commands" name="test_d" time="7" />
</testsuite></testsuites>"""


def test_seconds_by_file_and_kind(tmp_path):
    report = tmp_path / "report.xml"
    report.write_text(REPORT)
    assert file_times(str(report)) == {
        "tests/e2e/test_run_train_cli.py": 4.0, "tests/step/test_lr_schedule.py": 0.25,
        "tests/docs/test_doc_commands.py": 7.0,
    }
    assert kind_of("tests/e2e/test_run_train_cli.py") == "end-to-end CLI runs"  # it calls ./run_train.sh
    assert kind_of("tests/parallelize/test_parity_tp.py") == "multi-process worlds"
    assert kind_of("tests/step/test_lr_schedule.py") == "in-process"
    table = subprocess.run([sys.executable, "scripts/test_durations.py", str(report), "--top", "1"], cwd=REPO,
                           capture_output=True, text=True, timeout=60, check=True).stdout
    assert table.startswith("total 11 s in 3 files")
    assert "7 s  tests/docs/test_doc_commands.py  (docs pages)" in table
    assert "test_lr_schedule" not in table.split("slowest")[1]  # --top 1
