"""Resharding expert parallel: a Qwen3-MoE checkpoint saved with its experts split over 2 ranks continues with
them whole on every rank (FSDP2 only), and the reverse, with losses within 1e-5 of the run that never stopped. The
experts' weights and optimizer moments (DTensors on the (efsdp, ep) mesh) and the loss-free balancing biases
(buffers) go through DCP."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from checkpoint_helpers import TINY_QWEN3_ARGS, make_cfg, manager_for, train
from dist_harness import run_world
from reshard_worlds import layout_state

pytestmark = pytest.mark.multiprocess

MOE_ARGS = replace(
    TINY_QWEN3_ARGS, moe_num_experts=4, moe_top_k=2, moe_hidden_dim=32, moe_aux_loss_coeff=0.0,
    moe_load_balance_bias=True,
)
STEPS, SAVED_STEP, BATCH = 6, 4, 4
EP2, FSDP2 = {"dp_shard": 2, "ep": 2}, {"dp_shard": 2}


def run(cfg, degrees: dict, rank: int, world_size: int) -> tuple[list[float], int]:
    state = layout_state(cfg, degrees, world_size, BATCH, MOE_ARGS)
    manager = manager_for(cfg, state, rank, world_size, model_args=MOE_ARGS)
    start = manager.restore_at_startup().step
    losses = train(state, manager, STEPS, cfg)
    manager.close()
    return losses, start


def save_then_continue_elsewhere(rank: int, world_size: int, root: str) -> dict:
    reports = {}
    for name, first, second in (("ep2_to_fsdp2", EP2, FSDP2), ("fsdp2_to_ep2", FSDP2, EP2)):
        folder = Path(root) / name
        first_losses, _ = run(make_cfg(folder / "first", steps=STEPS, family="qwen3"), first, rank, world_size)
        saved = folder / "first" / "checkpoint" / f"step-{SAVED_STEP}"
        cfg = make_cfg(folder / "second", steps=STEPS, family="qwen3", initial_load_path=str(saved),
                       initial_load_model_only=False)
        second_losses, start = run(cfg, second, rank, world_size)
        reports[name] = {"first": first_losses, "second": second_losses, "start": start}
    return reports


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict:
    return run_world(2, save_then_continue_elsewhere, str(tmp_path_factory.mktemp("reshard_ep")))


@pytest.mark.parametrize("name", ["ep2_to_fsdp2", "fsdp2_to_ep2"])
def test_moe_checkpoint_continues_under_the_other_expert_layout(reports, name):
    report = reports[name]
    assert report["start"] == SAVED_STEP
    expected = report["first"][SAVED_STEP:]
    assert len(report["second"]) == len(expected)
    assert all(abs(v - e) <= 1e-5 * abs(e) for v, e in zip(report["second"], expected)), (report["second"], expected)
