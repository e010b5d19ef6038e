"""Resharding: a checkpoint saved under one layout continues under another (model, optimizer and data position
reshard through DCP), with losses within 1e-5 of the run that never stopped; HF weights load into any layout."""

from __future__ import annotations

import pytest
import torch
from checkpoint_helpers import TINY_ARGS, make_cfg, manager_for, tiny_state, train
from dist_harness import run_world
from reshard_worlds import SAVED_STEP, STEPS, train_then_continue_elsewhere

from dtrain.checkpoint.dcp_io import model_state_dict
from dtrain.checkpoint.hf_io import save_hf
from dtrain.models.llama3.hf_adapter import Llama3HFAdapter
from dtrain.models.llama3 import Transformer

pytestmark = pytest.mark.multiprocess


def assert_close(values, expected, rtol=1e-5):
    assert len(values) == len(expected)
    assert all(abs(v - e) <= rtol * abs(e) for v, e in zip(values, expected)), (values, expected)


def continue_in_one_process(saved: str, tmp_path, global_batch: int) -> list[float]:
    cfg = make_cfg(tmp_path / "single", steps=STEPS, initial_load_path=saved, initial_load_model_only=False)
    cfg.training.local_batch_size = global_batch
    state = tiny_state(cfg)
    assert manager_for(cfg, state).restore_at_startup().step == SAVED_STEP
    return train(state, None, STEPS, cfg)


def write_hf(root) -> None:
    torch.manual_seed(4)
    save_hf(model_state_dict([Transformer(TINY_ARGS)]), root / "hf", Llama3HFAdapter(TINY_ARGS), torch.float32)


def test_fsdp2_checkpoint_saved_async_continues_under_tp_and_in_one_process(tmp_path):
    write_hf(tmp_path)
    report = run_world(
        2, train_then_continue_elsewhere, str(tmp_path), {"dp_shard": 2}, {"dp_shard": 1, "tp": 2}, 2, "async"
    )
    assert report["start"] == SAVED_STEP and report["hf"] == [True, True]
    assert_close(report["second"], report["first"][SAVED_STEP:])
    assert_close(continue_in_one_process(report["saved"], tmp_path, 2), report["first"][SAVED_STEP:])


@pytest.mark.slow
def test_fsdp2_tp_checkpoint_continues_under_fsdp2_over_four_ranks(tmp_path):
    write_hf(tmp_path)
    report = run_world(
        4, train_then_continue_elsewhere, str(tmp_path), {"dp_shard": 2, "tp": 2}, {"dp_shard": 4}, 4, timeout_s=400
    )
    assert report["start"] == SAVED_STEP and report["hf"] == [True, True]
    assert_close(report["second"], report["first"][SAVED_STEP:])
