"""Resharding, for every model family: a checkpoint saved under one layout continues under another (model,
optimizer and data position reshard through DCP), with losses within 1e-5 of the run that never stopped; HF
weights and torchtitan >= 0.3 checkpoints start a run under any layout with exactly their weights."""

from __future__ import annotations

import pytest
import torch
from checkpoint_helpers import FAMILY_ARGS, make_cfg, manager_for, tiny_model, tiny_state, train
from dist_harness import run_world
from reshard_worlds import FAMILIES, SAVED_STEP, STEPS, train_then_continue_elsewhere
from torchtitan_checkpoints import save_torchtitan_checkpoint

from dtrain.checkpoint.dcp_io import model_state_dict
from dtrain.checkpoint.hf_io import save_hf
from dtrain.parallelize import get_family

pytestmark = pytest.mark.multiprocess


def assert_close(values, expected, rtol=1e-5):
    assert len(values) == len(expected)
    assert all(abs(v - e) <= rtol * abs(e) for v, e in zip(values, expected)), (values, expected)


def continue_in_one_process(saved: str, family: str, tmp_path, global_batch: int) -> list[float]:
    cfg = make_cfg(tmp_path / family / "single", steps=STEPS, family=family, initial_load_path=saved,
                   initial_load_model_only=False)
    cfg.training.local_batch_size = global_batch
    state = tiny_state(cfg)
    assert manager_for(cfg, state).restore_at_startup().step == SAVED_STEP
    return train(state, None, STEPS, cfg)


def write_sources(root) -> None:
    """Per family, under <root>/<family>: the same weights (weights.pt) as HF safetensors (hf) and as a
    torchtitan >= 0.3 checkpoint (torchtitan)."""
    for family in FAMILIES:
        folder, args = root / family, FAMILY_ARGS[family]
        torch.manual_seed(4)
        weights = {k: v.detach().clone() for k, v in model_state_dict([tiny_model(family)]).items()}
        save_hf(weights, folder / "hf", get_family(family).model.hf_adapter(args), torch.float32)
        save_torchtitan_checkpoint(weights, family, args, folder / "torchtitan")
        torch.save(weights, folder / "weights.pt")


def assert_resharded(reports: dict, family: str) -> None:
    report = reports[family]
    assert report["start"] == SAVED_STEP and report["hf"] == [True, True]
    assert report["torchtitan"] == [True, True] and report["torchtitan_stages"]
    assert_close(report["second"], report["first"][SAVED_STEP:])


@pytest.fixture(scope="module")
def fsdp2_to_tp_reports(tmp_path_factory) -> dict:
    """One 2-rank world for every family: FSDP2 over 2 ranks (saving async), then TP over 2."""
    root = tmp_path_factory.mktemp("fsdp2_to_tp")
    write_sources(root)
    return run_world(2, train_then_continue_elsewhere, str(root), {"dp_shard": 2}, {"dp_shard": 1, "tp": 2}, 2, "async")


@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp2_checkpoint_saved_async_continues_under_tp_and_in_one_process(family, fsdp2_to_tp_reports, tmp_path):
    assert_resharded(fsdp2_to_tp_reports, family)
    report = fsdp2_to_tp_reports[family]
    assert_close(continue_in_one_process(report["saved"], family, tmp_path, 2), report["first"][SAVED_STEP:])


@pytest.mark.slow
def test_fsdp2_tp_checkpoint_continues_under_fsdp2_over_four_ranks(tmp_path):
    write_sources(tmp_path)
    reports = run_world(
        4, train_then_continue_elsewhere, str(tmp_path), {"dp_shard": 2, "tp": 2}, {"dp_shard": 4}, 4, timeout_s=400
    )
    for family in FAMILIES:
        assert_resharded(reports, family)
