"""End to end: ./run_train.sh on a mixture logs each source's loss and tokens (metrics.jsonl and one console line
per logged step), and they add up to the step's."""

from __future__ import annotations

import math

import pytest
from run_train_helpers import FP32, TINY, read_metrics, run_train

pytestmark = [pytest.mark.slow, pytest.mark.torch_independent]

NAMES = ("builtin", "synthetic")


def test_a_mixture_run_logs_every_source_s_loss_and_tokens(tmp_path):
    result = run_train(
        *TINY, *FP32, "--training.steps", "3", "--training.dataset", "mixture",
        "--training.dataset_mixture", "builtin 0.7,synthetic 0.3", "--job.dump_folder", str(tmp_path),
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    records = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        tokens = [record[f"tokens/{name}"] for name in NAMES]
        assert sum(tokens) == 4 * 64  # every label of a packed window counts
        assert sum(record[f"token_share/{name}"] for name in NAMES) == pytest.approx(1.0)
        weighted = sum(record[f"loss/{name}"] * count for name, count in zip(NAMES, tokens) if count)
        assert math.isclose(weighted / sum(tokens), record["loss"], rel_tol=1e-5)
        assert sum(record[f"tokens_seen/{name}"] for name in NAMES) == record["tokens_seen"]
    sources_lines = [line for line in output.splitlines() if "INFO sources  builtin loss " in line]
    assert len(sources_lines) == 3 and all(" synthetic loss " in line for line in sources_lines)
