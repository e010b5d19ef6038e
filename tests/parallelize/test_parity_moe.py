"""Qwen3-MoE with its auxiliary load-balancing loss under FSDP2 and expert parallel on 2 ranks (also with full and
op-level AC, and compiled), with context parallel, and under tensor parallel with and without sequence parallel;
DeepSeek-V3 (shared experts split over tp) under TP: parity with one process (fp32, 1e-5), the auxiliary loss
included. The loss takes its statistics over the data-parallel microbatch (models/moe.py), so every layout runs
one process's 2 microbatches per step: each rank holds its part of the same 4 sequences."""

import pytest

from parity_layouts import Layout, parity_tests

pytestmark = pytest.mark.multiprocess

LAYOUTS = [
    Layout("moe_fsdp", dict(dp_shard=2), microbatches=2, family="qwen3_moe"),
    Layout("moe_ep2", dict(dp_shard=2, ep=2), microbatches=2, family="qwen3_moe"),
    # Recomputation repeats the counts' all-reduce (on every rank alike).
    Layout("moe_ep2_ac_full", dict(dp_shard=2, ep=2), dict(ac_mode="full"), microbatches=2, family="qwen3_moe"),
    # Op-level AC keeps the all-to-alls' and grouped matmuls' outputs; the experts' FSDP unit runs inside the block.
    Layout("moe_ep2_ac_op", dict(dp_shard=2, ep=2), dict(ac_mode="selective", selective_ac_option="op"),
           microbatches=2, family="qwen3_moe"),
    # MoE blocks compile with graph breaks (host-read token counts, the experts' own FSDP unit): see compile.py.
    Layout("moe_ep2_compile", dict(dp_shard=2, ep=2), dict(compile_model=True, compile_backend="aot_eager"),
           microbatches=2, family="qwen3_moe"),
    # Each cp rank routes its part of every sequence: the counts are summed over cp as over dp.
    Layout("moe_cp2_ep2", dict(dp_shard=1, cp=2, ep=2), microbatches=2, family="qwen3_moe"),
    # TP ranks route the same tokens and are outside the counts' reduction: nothing is counted twice.
    Layout("moe_tp2", dict(dp_shard=1, tp=2), microbatches=2, family="qwen3_moe"),
    Layout("moe_tp2_no_sp", dict(dp_shard=1, tp=2, sequence_parallel=False), microbatches=2, family="qwen3_moe"),
    Layout("deepseek_v3_tp2", dict(dp_shard=1, tp=2), family="deepseek_v3"),
]

report, test_layout_matches_single_process = parity_tests(2, LAYOUTS)


def test_experts_are_split_over_the_ep_ranks(report):
    assert "Shard(dim=0)" in report["moe_ep2"]["placements"].get("layers.0.moe.experts.w1", "")


def test_tensor_parallel_keeps_routed_experts_whole(report):
    assert report["moe_tp2"]["placements"]["layers.0.moe.experts.w1"] == "(Replicate(),)"
