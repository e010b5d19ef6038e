"""Every test file belongs to one of CI's runs (torch_runs.py), and the second run's selection,
`-m "not torch_independent"`, takes exactly the files the rule gives it."""

from __future__ import annotations

import subprocess
import sys

from torch_runs import TESTS, run_of

REPO = TESTS.parent


def test_every_test_file_belongs_to_a_run():
    unassigned = [str(p.relative_to(REPO)) for p in sorted(TESTS.rglob("test_*.py")) if run_of(p) is None]
    assert not unassigned, (
        f"no CI run for {unassigned}: add the directory to EVERY_TORCH or DEFAULT_TORCH_ONLY in tests/torch_runs.py"
    )


def test_a_new_directory_belongs_to_no_run_until_the_rule_names_it():
    assert run_of(TESTS / "a_new_area" / "test_x.py") is None
    assert run_of(TESTS / "parallelize" / "test_x.py") == "every torch"
    assert run_of(TESTS / "config" / "test_x.py") == "default torch only"
    assert run_of(TESTS / "test_x.py") == "default torch only"


def test_the_second_run_takes_every_torch_files_less_those_marked_torch_independent():
    files = {
        "tests/step/test_lr_schedule.py": True,  # every torch
        "tests/config/test_config_validate.py": False,  # a default-only directory
        "tests/checkpoint/test_checkpoint_e2e_lock.py": False,  # every torch's directory, marked by the file
    }
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m",
         "not torch_independent", *files],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert collected.returncode == 0, collected.stdout[-2000:] + collected.stderr[-2000:]
    taken = {line.split("::")[0] for line in collected.stdout.splitlines() if "::" in line}
    assert taken == {name for name, second_run in files.items() if second_run}
