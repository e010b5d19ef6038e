"""Through ./run_train.sh with two FSDP ranks: checkpoint.last_save_in_hf writes the final weights as a Hugging Face
folder (sharded weights gathered by rank 0) that the repo's HF loader reads back to exactly the weights a full
save of the same step holds."""

from __future__ import annotations

import shutil

import pytest
import torch
from e2e_checkpoint_helpers import CHECKPOINTED, run_train
from run_train_helpers import FP32

from dtrain.checkpoint.dcp_io import read_full_weights
from dtrain.checkpoint.folders import read_record
from dtrain.checkpoint.hf_io import build_adapter, load_hf_weights
from dtrain.config import load_config
from dtrain.data import build_tokenizer
from dtrain.parallelize import get_family
from dtrain.run.prepare import model_args

# A CLI walkthrough: CI runs it under the default torch only; the HF save itself is test_checkpoint_last_save_hf.py's,
# which runs under both (tests/torch_runs.py).
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.torch_independent]


def test_two_rank_run_ends_with_a_hugging_face_folder_of_its_weights(tmp_path):
    run_dir = tmp_path / "run"
    args = [*CHECKPOINTED, *FP32, "--checkpoint.interval", "4", "--job.dump_folder", str(run_dir)]
    result = run_train(*args, "--checkpoint.last_save_in_hf", NPROC="2")
    assert result.returncode == 0, result.stderr[-3000:]
    final = run_dir / "checkpoint" / "step-8"
    assert read_record(final).kind == "hf" and (final / "config.json").is_file()
    hf_copy = shutil.copytree(final, tmp_path / "hf")

    # The same steps 5..8 again from step 4, ending in a full save of step 8 (resume is bit-identical).
    again = run_train(*args, "--checkpoint.load_step", "4", "--checkpoint.no_last_save_model_only", NPROC="2")
    assert again.returncode == 0, again.stderr[-3000:]
    assert read_record(final).kind == "full"

    cfg = load_config(["--config", str(run_dir / "config.toml")])
    family = get_family(cfg.model.name)
    args = model_args(cfg, family.model, build_tokenizer(cfg.model).vocab_size)
    model = family.model.model_cls(args)
    load_hf_weights([model], hf_copy, build_adapter(cfg.model.name, args))
    expected = read_full_weights(final)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
