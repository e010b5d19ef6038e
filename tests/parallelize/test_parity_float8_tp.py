"""float8 (emulated, torchao) with tensor parallel: torchao's float8 TP styles in the real plan, alone (2 ranks)
and under FSDP2 with float8 all-gathers (2 x 2 on 4 ranks).

Two checks, because float8 rounding is a step function. One block's feed-forward, given the same input, computes
the same outputs and weight gradients as one process to fp32 precision: the casts see the same tensors and scales.
A whole run cannot agree that closely: a row-parallel linear sums its two halves in another order than one matmul
(an fp32-ulp difference), and float8 rounding amplifies that to float8's own noise level, so whole runs agree
within parity_layouts' FLOAT8_DRIFT_LOSS_RTOL.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dtrain.parallelize import ParallelDims, build_mesh, get_family

from dist_harness import run_world
from parity_converters import float8_training
from parity_layouts import ARGS, SEQ_LEN, Layout, build_parallel_model, parity_tests

pytest.importorskip("torchao.float8")
pytestmark = pytest.mark.multiprocess

FSDP_TP_SP = dict(dp_shard=2, tp=2)
FLOAT8_ALL_GATHER = dict(enable_fsdp_float8_all_gather=True, precompute_float8_dynamic_scale_for_fsdp=True)
LAYOUTS = [
    Layout("fsdp_tp_sp_float8_all_gather", FSDP_TP_SP, float8=FLOAT8_ALL_GATHER),
    Layout("fsdp_tp_float8", {**FSDP_TP_SP, "sequence_parallel": False}, float8={}),
    Layout("fsdp_tp_sp_float8_rowwise", FSDP_TP_SP, float8=dict(recipe_name="rowwise")),
]

report, test_float8_tp_run_tracks_one_float8_process = parity_tests(4, LAYOUTS)


def _relative(value: torch.Tensor, expected: torch.Tensor) -> float:
    return ((value - expected).abs().max() / expected.abs().max()).item()


def _gather_sequence(local: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts, dim=1)


def feed_forward_against_one_process(rank: int, world_size: int) -> dict:
    """For TP with and without SP: the first block's feed-forward output and weight gradients against one
    process's, as relative differences, and the styles the float8 plan chose."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, SEQ_LEN, ARGS.dim, generator=generator)
    out_grad = torch.randn(2, SEQ_LEN, ARGS.dim, generator=generator)
    single = build_parallel_model(ARGS, ParallelDims(1), None, converter=float8_training({}, ParallelDims(1)))
    single_ffn = single.layers["0"].feed_forward
    expected = single_ffn(x)
    expected.backward(out_grad)
    high_precision = build_parallel_model(ARGS, ParallelDims(1), None).layers["0"].feed_forward(x)
    report = {"float8_vs_fp32": _relative(expected, high_precision)}
    for sp in (True, False):
        dims = ParallelDims(world_size, tp=2, dp_shard=1, sequence_parallel=sp)
        model = build_parallel_model(ARGS, dims, build_mesh(dims, "cpu"), converter=float8_training({}, dims))
        ffn = model.layers["0"].feed_forward
        local = (lambda t: t.chunk(world_size, dim=1)[rank]) if sp else (lambda t: t)
        out = ffn(local(x))
        out.backward(local(out_grad))
        name = "tp_sp" if sp else "tp"
        report[name] = {
            "output": _relative(_gather_sequence(out) if sp else out, expected),
            **{
                w: _relative(getattr(ffn, w).weight.grad.full_tensor(), getattr(single_ffn, w).weight.grad)
                for w in ("w1", "w2", "w3")
            },
        }
        report[name + "_styles"] = {
            path: type(style).__name__ for path, style in _applied_plan(dims).items() if "feed_forward" in path
        }
    return report


def _applied_plan(dims: ParallelDims) -> dict:
    """The plan the float8 TP swap makes for a float8 model on this (gloo) TP mesh."""
    from dtrain.parallelize.float8_tp import float8_tp_plan

    spec = get_family("llama3")
    with torch.device("meta"):
        model = spec.model.model_cls(ARGS)
    float8_training({}, dims).convert(model)
    plan = spec.tp_plan(sequence_parallel=dims.sequence_parallel_enabled, loss_parallel=True)
    return float8_tp_plan(plan, model, build_mesh(dims, "cpu")["tp"])


@pytest.fixture(scope="module")
def feed_forward_report() -> dict:
    return run_world(2, feed_forward_against_one_process)


@pytest.mark.parametrize("layout", ["tp_sp", "tp"])
def test_float8_tp_feed_forward_matches_one_process(feed_forward_report, layout):
    # Same input, same float8 casts: fp32 precision (the row-parallel sum is the only difference), 1000x closer
    # than the float8 feed-forward is to the fp32 one (so the check would see float8 values cast differently).
    assert max(feed_forward_report[layout].values()) <= 1e-5
    assert feed_forward_report["float8_vs_fp32"] > 1e-2


def test_gloo_keeps_float8_off_the_wire_only_where_a_gather_would_carry_it(feed_forward_report):
    # Column-parallel linears take a replicated input (no collective): torchao's style casts it. Under SP the
    # gather of the FFN input and the row-parallel output's backward gather would move float8, which gloo cannot;
    # those stay torch's styles, and the float8 linear casts after the high-precision gather.
    assert feed_forward_report["tp_sp_styles"] == {
        "layers.*.feed_forward": "PrepareModuleInput",
        "layers.*.feed_forward.w1": "Float8ColwiseParallel",
        "layers.*.feed_forward.w3": "Float8ColwiseParallel",
        "layers.*.feed_forward.w2": "RowwiseParallel",
    }
    assert feed_forward_report["tp_styles"] == {
        "layers.*.feed_forward.w1": "Float8ColwiseParallel",
        "layers.*.feed_forward.w3": "Float8ColwiseParallel",
        "layers.*.feed_forward.w2": "Float8RowwiseParallel",
    }
