"""scripts/download_hf_assets.py: its command line only (tests never reach the network)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "download_hf_assets.py"


def load_script():
    spec = importlib.util.spec_from_file_location("download_hf_assets", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help_runs_and_documents_both_modes():
    result = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    for flag in ("--repo_id", "--assets", "--hf_token", "--local_dir", "--dataset", "--num_shards", "--split"):
        assert flag in result.stdout


def test_arguments_are_validated_before_any_download():
    script = load_script()
    args = script.parse_args(["--repo_id", "meta-llama/Llama-3.1-8B", "--assets", "tokenizer"])
    assert args.assets == ["tokenizer"] and args.local_dir is None
    assert script.parse_args(["--dataset", "c4", "--num_shards", "2"]).num_shards == 2
    validation = script.parse_args(["--dataset", "c4", "--split", "validation", "--num_shards", "8"])
    assert (validation.split, validation.num_shards) == ("validation", 8)
    for bad in (
        ["--dataset", "c4", "--num_shards", "0"],
        ["--dataset", "c4", "--split", "validation", "--num_shards", "9"],  # C4 has 8 validation shards
        ["--dataset", "c4", "--split", "test"],
        ["--repo_id", "x/y", "--dataset", "c4"],
        [],
    ):
        with pytest.raises(SystemExit) as info:
            script.parse_args(bad)
        assert info.value.code == 2
