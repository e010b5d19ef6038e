"""Qwen3-MoE under FSDP2 and expert parallel on 2 ranks (also with full and op-level AC, and compiled), and under tensor parallel
with and without sequence parallel, with the auxiliary load-balancing loss (each rank's microbatch is one of one
process's, so the loss terms agree); DeepSeek-V3 (shared experts split over tp) under TP: parity with one process
(fp32, 1e-5)."""

import pytest

from parity_layouts import Layout, parity_tests

pytestmark = pytest.mark.multiprocess

LAYOUTS = [
    Layout("moe_fsdp", dict(dp_shard=2), family="qwen3_moe"),
    Layout("moe_ep2", dict(dp_shard=2, ep=2), family="qwen3_moe"),
    Layout("moe_ep2_ac_full", dict(dp_shard=2, ep=2), dict(ac_mode="full"), family="qwen3_moe"),
    # Op-level AC keeps the all-to-alls' and grouped matmuls' outputs; the experts' FSDP unit runs inside the block.
    Layout("moe_ep2_ac_op", dict(dp_shard=2, ep=2), dict(ac_mode="selective", selective_ac_option="op"),
           family="qwen3_moe"),
    # MoE blocks compile with graph breaks (host-read token counts, the experts' own FSDP unit): see compile.py.
    Layout("moe_ep2_compile", dict(dp_shard=2, ep=2), dict(compile_model=True, compile_backend="aot_eager"),
           family="qwen3_moe"),
    # TP ranks see the same batch: two microbatches per step, as one process, so the auxiliary losses agree.
    Layout("moe_tp2", dict(dp_shard=1, tp=2), microbatches=2, family="qwen3_moe"),
    Layout("moe_tp2_no_sp", dict(dp_shard=1, tp=2, sequence_parallel=False), microbatches=2, family="qwen3_moe"),
    Layout("deepseek_v3_tp2", dict(dp_shard=1, tp=2), family="deepseek_v3"),
]

report, test_layout_matches_single_process = parity_tests(2, LAYOUTS)


def test_experts_are_split_over_the_ep_ranks(report):
    assert "Shard(dim=0)" in report["moe_ep2"]["placements"].get("layers.0.moe.experts.w1", "")


def test_tensor_parallel_keeps_routed_experts_whole(report):
    assert report["moe_tp2"]["placements"]["layers.0.moe.experts.w1"] == "(Replicate(),)"
