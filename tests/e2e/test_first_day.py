"""docs/first-day.md runs as written: its bash blocks, in order, from the checkout, each checked for what the page
says it does."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from run_train_helpers import REPO, user_env

pytestmark = [pytest.mark.slow, pytest.mark.torch_independent]

PAGE = REPO / "docs" / "first-day.md"
FOLDERS = [REPO / "outputs" / "first_day", REPO / "outputs" / "first_day_profile"]


def page_blocks() -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", PAGE.read_text(), re.S | re.M)


def run_block(block: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=REPO, env=user_env(), capture_output=True,
                          text=True, timeout=300)


def test_the_first_day_page_runs_top_to_bottom():
    present = [str(f) for f in FOLDERS if f.exists()]
    assert not present, f"remove {present} first: the page writes there"
    train, watch, extend, generate, profile, plan, clean = page_blocks()
    try:
        outputs = {}
        for name, block in [("train", train), ("watch", watch), ("extend", extend), ("generate", generate),
                            ("profile", profile), ("plan", plan)]:
            done = run_block(block)
            assert done.returncode == 0, f"{name}: {block}\n{done.stderr[-3000:]}"
            outputs[name] = done.stdout + done.stderr
        assert '"step": 6' in outputs["watch"]
        assert ("checkpoint: resuming from outputs/first_day/checkpoint/step-6 (full training state) at step 6"
                in outputs["extend"]) and "step 9/9" in outputs["extend"]
        assert "ids: " in outputs["generate"] and "text: " in outputs["generate"]
        assert (FOLDERS[1] / "profile_traces" / "iteration_4" / "rank0_trace.json").is_file()
        assert "step time by phase" in outputs["profile"]
        assert "verdict: " in outputs["plan"]
        assert run_block(clean).returncode == 0 and not any(f.exists() for f in FOLDERS)
    finally:
        for folder in FOLDERS:
            shutil.rmtree(folder, ignore_errors=True)
