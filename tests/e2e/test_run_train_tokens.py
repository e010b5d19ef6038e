"""End to end on a pre-tokenized dataset: scripts/tokenize_dataset.py writes it, ./run_train.sh trains on it with
`--training.dataset tokens`; FSDP2 on 2 processes reproduces the one-process losses, and a checkpoint saved at
dp=2 resumes at dp=1 on the same samples with the same losses (fp32 compute, compared at 1e-5)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from run_train_helpers import FP32, REPO, TINY, read_metrics, run_train, user_env

from dtrain.data.sources import BuiltinSource

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

SAVED = 3


@pytest.fixture(scope="module")
def tokens_dir(tmp_path_factory):
    """About 40,000 byte tokens: the first 60 files of the built-in corpus, cut to 700 characters, as JSONL."""
    text_dir = tmp_path_factory.mktemp("text")
    documents = BuiltinSource().documents(0)
    with open(text_dir / "docs.jsonl", "w") as f:
        for _, (_, text) in zip(range(60), documents):
            f.write(json.dumps({"text": text[:700]}) + "\n")
    out = tmp_path_factory.mktemp("tokens") / "data"
    result = subprocess.run(
        [sys.executable, "scripts/tokenize_dataset.py", "--input", str(text_dir), "--output", str(out),
         "--workers", "0"],
        cwd=REPO, env=user_env(), capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return out


def train(tokens_dir, run_dir, nproc: str, *extra: str):
    dp = int(nproc)
    result = run_train(
        *TINY, *FP32, "--training.dataset", "tokens", "--training.dataset_path", str(tokens_dir),
        "--training.global_batch_size", "4", "--training.local_batch_size", str(4 // dp),
        "--checkpoint.enable", "--checkpoint.interval", str(SAVED), "--job.dump_folder", str(run_dir), *extra,
        NPROC=nproc,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    return output, {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


@pytest.fixture(scope="module")
def single_process(tokens_dir, tmp_path_factory):
    return train(tokens_dir, tmp_path_factory.mktemp("single"), "1")


def test_fsdp2_on_a_tokens_dataset_matches_one_process(tokens_dir, single_process, tmp_path):
    output, losses = train(tokens_dir, tmp_path / "fsdp2", "2")
    assert "pre-tokenized dataset" in output
    assert sorted(losses) == list(range(1, 9))
    assert losses == pytest.approx(single_process[1], rel=1e-5)

    # Saved at dp=2, resumed at dp=1: the same samples follow, so the same losses.
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "fsdp2" / "checkpoint" / f"step-{SAVED}", resumed_dir / "checkpoint" / f"step-{SAVED}")
    output, resumed = train(tokens_dir, resumed_dir, "1")
    assert "data position carries over from 2 to 1 data-parallel rank(s)" in output
    assert sorted(resumed) == list(range(SAVED + 1, 9))
    assert resumed == pytest.approx({step: single_process[1][step] for step in resumed}, rel=1e-5)


def test_a_folder_that_is_no_tokens_dataset_is_refused_in_one_line_before_anything_is_written(tmp_path):
    run_dir = tmp_path / "run"
    result = run_train(*TINY, "--training.dataset", "tokens", "--training.dataset_path", str(tmp_path),
                       "--job.dump_folder", str(run_dir))
    assert result.returncode == 2
    errors = [line for line in result.stderr.strip().splitlines() if not line.startswith("[rank0]")]
    assert len(errors) == 1 and "has no manifest.json: not a pre-tokenized dataset" in errors[0], result.stderr[-2000:]
    assert not run_dir.exists()
