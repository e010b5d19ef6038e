"""torchtitan v0.2.2's Llama 3 debug TOML (tests/config/torchtitan_v0_2_2/) trains through `./run_train.sh`, as a
torchtitan user would start it (CONFIG_FILE), with flags only for what this machine lacks and for test speed."""

import pytest
from run_train_helpers import REPO, read_metrics, run_train

pytestmark = pytest.mark.slow

TORCHTITAN_DEBUG = REPO / "tests" / "config" / "torchtitan_v0_2_2" / "llama3_debug_model.toml"


def test_torchtitan_debug_config_trains(tmp_path):
    result = run_train(
        # No local C4 copy or torchtitan test tokenizer here: the flags replace them before validation.
        "--training.dataset", "builtin", "--model.hf_assets_path", "",
        "--training.steps", "4", "--training.seq_len", "64", "--training.local_batch_size", "2",
        "--job.dump_folder", str(tmp_path),
        CONFIG_FILE=str(TORCHTITAN_DEBUG),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # the file's metrics.log_freq = 1
    assert records[-1]["loss"] < records[0]["loss"]
    assert 'description = "Llama 3 debug training"' in (tmp_path / "config.toml").read_text()
