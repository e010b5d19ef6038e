"""The pieces of parallelize/torch_compat.py, each checked directly on 2 gloo ranks (CI runs them under torch 2.11
and 2.13; on 2.11 each guards a failure that torch would otherwise cause)."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining.schedules import _batch_p2p, _wait_batch_p2p
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from dist_harness import run_world
from dtrain.parallelize.torch_compat import PipelineStageWithoutSelfP2P, clip_grads_with_norm_

pytestmark = pytest.mark.multiprocess


def clipped_gradients(rank: int, mesh) -> dict:
    """Clip a Partial, a Shard and a Replicate gradient together to max_norm 1; return them whole, and the norm."""

    def param_with_grad(placement, local_grad):
        param = torch.nn.Parameter(DTensor.from_local(torch.zeros(4), mesh, [Replicate()], run_check=False))
        param.grad = DTensor.from_local(local_grad, mesh, [placement], run_check=False)
        return param

    # Partial: the ranks' pieces sum to 3 per element, as sequence-parallel norm weights' gradients do.
    params = [
        param_with_grad(Partial(), torch.full((4,), float(rank + 1))),
        param_with_grad(Shard(0), torch.full((2,), 4.0)),
        param_with_grad(Replicate(), torch.full((4,), 2.0)),
    ]
    total_norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
    clip_grads_with_norm_(params, 1.0, total_norm)
    return {"norm": total_norm.full_tensor().item(), "grads": [p.grad.full_tensor() for p in params]}


def v_stage_warmup_peers(rank: int) -> dict:
    """Under a V placement on 2 ranks, rank r holds stages r and 3 - r, so stages 1 and 2 share rank 1. Build this
    rank's two stages, list the group ranks their warm-up sends and receives address, and run that warm-up."""
    group = dist.group.WORLD
    v_placement = {0: 0, 1: 1, 2: 1, 3: 0}
    stages = []
    for index in (rank, 3 - rank):
        stage = PipelineStageWithoutSelfP2P(torch.nn.Linear(2, 2), index, 4, torch.device("cpu"), group=group)
        stage.stage_index_to_group_rank = v_placement
        stages.append(stage)
    ops = [op for stage in stages for op in stage._get_init_p2p_neighbors_ops()]
    _wait_batch_p2p(_batch_p2p(ops))
    return {"peers": sorted({op.group_peer for op in ops}), "ops": len(ops)}


def run_checks(rank: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (world_size,))
    result = {"clip": clipped_gradients(rank, mesh), "warmup": v_stage_warmup_peers(rank)}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, result["warmup"])
    return {**result, "warmup_per_rank": everyone}


@pytest.fixture(scope="module")
def report():
    return run_world(2, run_checks)


def test_clipping_scales_partial_gradients_like_the_others(report):
    # Whole gradients: Partial 3 (x4), Shard 4 (x4), Replicate 2 (x4): norm sqrt(4 * (9 + 16 + 4)).
    expected_norm = (4 * (9 + 16 + 4)) ** 0.5
    assert report["clip"]["norm"] == pytest.approx(expected_norm)
    scale = 1.0 / (expected_norm + 1e-6)
    for grad, value in zip(report["clip"]["grads"], (3.0, 4.0, 2.0)):
        torch.testing.assert_close(grad, torch.full((4,), value * scale))


def test_v_placed_stages_warm_up_only_with_the_other_rank(report):
    rank0, rank1 = report["warmup_per_rank"]
    # Rank 0 (stages 0 and 3) talks to rank 1 only; rank 1 (stages 1 and 2) to rank 0 only, never to itself.
    assert rank0["peers"] == [1] and rank1["peers"] == [0]
    # Stage 0: next only; stage 3: previous only; stages 1 and 2 each drop their pair with the other.
    assert rank0["ops"] == 4 and rank1["ops"] == 4
