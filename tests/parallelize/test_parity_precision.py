"""The compute dtype is a property of the run: in bf16, FSDP2 (its mixed-precision policy), DDP and TP+SP (the
forward under autocast, with fp32 master weights) on 2 ranks train like one bf16 process, within bf16 rounding;
and one process really computes in bf16 (its losses leave the fp32 ones)."""

import pytest

from parity_layouts import BF16_LOSS_RTOL, Layout, assert_matches_single_process, max_relative_diff, parity_tests

BF16 = dict(param_dtype="bfloat16")
LAYOUTS = [
    Layout("fsdp_bf16", dict(dp_shard=2), BF16),
    Layout("ddp_bf16", dict(dp_replicate=2, dp_shard=1), BF16, microbatches=2),
    Layout(
        "ddp_bf16_reduce_bf16", dict(dp_replicate=2, dp_shard=1), dict(BF16, reduce_dtype="bfloat16"), microbatches=2
    ),
    Layout("tp_sp_bf16", dict(dp_shard=1, tp=2), BF16),
    Layout("fsdp_fp32", dict(dp_shard=2)),
]

pytestmark = pytest.mark.multiprocess

report, _ = parity_tests(2, LAYOUTS)


@pytest.mark.parametrize("layout", LAYOUTS[:-1], ids=lambda layout: layout.name)
def test_bf16_layout_computes_in_bf16_and_matches_the_bf16_single_process(report, layout):
    assert report[layout.name]["matmul_dtypes"] == {"torch.bfloat16"}
    assert_matches_single_process(report, layout, loss_rtol=BF16_LOSS_RTOL)


def test_one_process_computes_in_the_runs_dtype(report):
    bf16, fp32 = report["reference"][("llama3", False, "bfloat16")], report["reference"][("llama3", False)]
    assert max_relative_diff(bf16["losses"], fp32["losses"]) > 1e-4


def test_ddp_reduces_gradients_in_the_reduce_dtype(report):
    """The same DDP run with bf16 instead of fp32 all-reduces: the rounding of the reduced gradients shows."""
    assert max_relative_diff(report["ddp_bf16_reduce_bf16"]["losses"], report["ddp_bf16"]["losses"]) > 1e-6


def test_fp32_layouts_still_match_to_fp32_precision(report):
    assert report["fsdp_fp32"]["matmul_dtypes"] == {"torch.float32"}
    assert_matches_single_process(report, LAYOUTS[-1])
