"""Qwen3-MoE under FSDP2 and expert parallel on 2 ranks (also with full AC and compiled), with the auxiliary
load-balancing loss (each rank's microbatch is one of one process's, so the loss terms agree): parity with one
process (fp32, 1e-5)."""

import pytest

from parity_layouts import Layout, parity_tests

pytestmark = pytest.mark.multiprocess

LAYOUTS = [
    Layout("moe_fsdp", dict(dp_shard=2), family="qwen3_moe"),
    Layout("moe_ep2", dict(dp_shard=2, ep=2), family="qwen3_moe"),
    Layout("moe_ep2_ac_full", dict(dp_shard=2, ep=2), dict(ac_mode="full"), family="qwen3_moe"),
    # MoE blocks compile with graph breaks (host-read token counts, the experts' own FSDP unit): see compile.py.
    Layout("moe_ep2_compile", dict(dp_shard=2, ep=2), dict(compile_model=True, compile_backend="aot_eager"),
           family="qwen3_moe"),
]

report, test_layout_matches_single_process = parity_tests(2, LAYOUTS)


def test_experts_are_split_over_the_ep_ranks(report):
    assert "Shard(dim=0)" in report["moe_ep2"]["placements"].get("layers.0.moe.experts.w1", "")
