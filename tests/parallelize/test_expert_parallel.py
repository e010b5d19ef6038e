"""Expert parallel's token exchange on one MoE layer (2 and 4 ranks): every rank's outputs and every expert's
gradient equal one process's, for uneven loads (some experts get no tokens from some ranks); the reorder between
the two all-to-alls on its own."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from dtrain.models.moe import MoE, MoEArgs
from dtrain.parallelize.expert_parallel import ExpertParallel, _by_expert_order

from dist_harness import run_world

pytestmark = pytest.mark.multiprocess

DIM, TOKENS = 16, 12
CONFIGS = {
    "softmax_top2": MoEArgs(num_experts=8, top_k=2, hidden_dim=24, route_norm=True),
    "sigmoid_groups_bias_shared": MoEArgs(
        num_experts=8, top_k=3, hidden_dim=24, num_shared_experts=1, score_func="sigmoid", route_norm=True,
        route_scale=2.5, num_expert_groups=4, num_limited_groups=2, load_balance_bias=True,
    ),
}


def _moe(args: MoEArgs) -> MoE:
    torch.manual_seed(0)
    moe = MoE(args, DIM)
    moe.init_weights(0.5, 0.5)
    if moe.expert_bias is not None:
        moe.expert_bias.copy_(torch.linspace(-0.1, 0.1, args.num_experts))
    return moe


def _rank_tokens(rank: int) -> torch.Tensor:
    # Different tokens per rank, skewed so that the ranks send each other uneven (and some empty) groups.
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randn(2, TOKENS // 2, DIM, generator=generator) + rank


def _relative(value: torch.Tensor, expected: torch.Tensor) -> float:
    return ((value - expected).abs().max() / expected.abs().max()).item()


def compare_with_one_process(rank: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    report = {}
    for name, args in CONFIGS.items():
        x = _rank_tokens(rank)
        reference = _moe(args)
        expected = reference(x)
        expected.square().sum().backward()

        sharded = _moe(args)
        ExpertParallel()._apply(sharded.experts, mesh)
        out = sharded(x)
        out.square().sum().backward()

        # Expert gradients sum over the ranks' tokens, scaled by 1/ep (for FSDP's mean over the other ranks):
        # the mean of the ranks' reference gradients.
        grads = {}
        for w in ("w1", "w2", "w3"):
            mean = getattr(reference.experts, w).grad / world_size
            dist.all_reduce(mean)
            grads[w] = _relative(getattr(sharded.experts, w).grad.full_tensor(), mean)
        report[name] = {
            "output": _relative(out, expected),
            "gate_grad": _relative(sharded.router.gate.weight.grad, reference.router.gate.weight.grad),
            **grads,
            "placement": str(sharded.experts.w1.placements),
            "local_experts": sharded.experts.w1.to_local().shape[0],
        }
    return report


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"ep{n}")
def report(request):
    return request.param, run_world(request.param, compare_with_one_process)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_expert_parallel_layer_matches_one_process(report, config):
    world_size, result = report
    result = result[config]
    assert result["placement"] == "(Shard(dim=0),)"
    assert result["local_experts"] == 8 // world_size
    # fp32: the expert math is per row, the same rows in the same order within each expert.
    assert result["output"] <= 1e-6
    assert max(result["w1"], result["w2"], result["w3"]) <= 1e-6
    assert result["gate_grad"] <= 1e-6


def test_by_expert_order_regroups_rows_by_local_expert():
    # Rows from 2 source ranks for 3 local experts: counts[s, j]; row labels are (source, expert, index).
    counts = torch.tensor([[2, 0, 1], [1, 3, 0]])
    received = [(s, j, i) for s in range(2) for j in range(3) for i in range(int(counts[s, j]))]
    order = _by_expert_order(counts, len(received))
    regrouped = [received[k] for k in order.tolist()]
    assert regrouped == sorted(received, key=lambda row: (row[1], row[0], row[2]))


@pytest.mark.parametrize(
    "model, degrees, message",
    [
        ("qwen3", dict(world_size=2, ep=2), "expert_parallel_degree=2 needs a model with MoE layers; this one has"),
        ("qwen3_moe", dict(world_size=3, ep=3), "expert_parallel_degree=3 does not divide the model's 8 experts"),
        ("deepseek_v3_shared33", dict(world_size=2, dp_shard=1, tp=2),
         "tensor_parallel_degree=2 does not divide the MoE shared experts' hidden size=33"),
    ],
)
def test_moe_layouts_refused_before_launch(model, degrees, message):
    from dtrain.parallelize import ParallelDims, ParallelismError
    from parity_layouts import FAMILY_ARGS, family_spec

    # One shared expert as wide as a routed one (33), which tp=2 cannot split.
    shared33 = model == "deepseek_v3_shared33"
    family = "deepseek_v3" if shared33 else model
    args = replace(FAMILY_ARGS[family], moe_hidden_dim=33) if shared33 else FAMILY_ARGS[family]
    with pytest.raises(ParallelismError, match=message):
        family_spec(family).check_shapes(ParallelDims(**degrees), args, 16)
