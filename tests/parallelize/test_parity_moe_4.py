"""Qwen3-MoE with loss-free load balancing on 4 ranks: FSDP2, expert parallel over 2 and 4 ranks (experts FSDP-sharded
over the rest), with context parallel, with activation checkpointing, with tensor parallel and with HSDP; Qwen3-MoE
with its auxiliary loss (statistics over the data-parallel microbatch, so 2 microbatches per step as one process)
under EP 4 x FSDP 4, EP 2 x TP 2 and HSDP x EP 2;
DeepSeek-V3 (latent attention, group-limited sigmoid routing, shared experts) with expert parallel over 2 and 4,
with tensor parallel and with HSDP: parity with one process (fp32, 1e-5). The per-expert biases move by the token
counts of all ranks, so every layout routes like one process."""

import pytest

from parity_layouts import Layout, parity_tests

pytestmark = pytest.mark.multiprocess

MODEL = "qwen3_moe_bias"
LAYOUTS = [
    Layout("moe_fsdp4", dict(dp_shard=4), family=MODEL),
    Layout("moe_ep2_fsdp4", dict(dp_shard=4, ep=2), family=MODEL),
    Layout("moe_ep4_fsdp4", dict(dp_shard=4, ep=4), family=MODEL),
    Layout("moe_ep4_ac_every_2nd", dict(dp_shard=4, ep=4), dict(ac_mode="selective", selective_ac_option="2"),
           family=MODEL),
    Layout("moe_cp2_ep2", dict(dp_shard=2, cp=2, ep=2), family=MODEL),
    Layout("deepseek_v3_ep2_fsdp4", dict(dp_shard=4, ep=2), family="deepseek_v3"),
    Layout("deepseek_v3_ep4_fsdp4", dict(dp_shard=4, ep=4), family="deepseek_v3"),
    Layout("moe_ep2_tp2", dict(dp_shard=2, tp=2, ep=2), family=MODEL),
    Layout("deepseek_v3_ep2_tp2", dict(dp_shard=2, tp=2, ep=2), family="deepseek_v3"),
    Layout("moe_hsdp_ep2", dict(dp_replicate=2, dp_shard=2, ep=2), family=MODEL),
    Layout("deepseek_v3_hsdp_ep2", dict(dp_replicate=2, dp_shard=2, ep=2), family="deepseek_v3"),
    Layout("moe_aux_ep4_fsdp4", dict(dp_shard=4, ep=4), microbatches=2, family="qwen3_moe"),
    Layout("moe_aux_ep2_tp2", dict(dp_shard=2, tp=2, ep=2), microbatches=2, family="qwen3_moe"),
    Layout("moe_aux_hsdp_ep2", dict(dp_replicate=2, dp_shard=2, ep=2), microbatches=2, family="qwen3_moe"),
]

report, test_layout_matches_single_process = parity_tests(4, LAYOUTS)


def test_experts_are_fsdp_sharded_over_what_ep_leaves(report):
    # ep 2 of 4 ranks: each expert's weights also sharded over the other 2 (efsdp), so a quarter per rank.
    placements = report["moe_ep2_fsdp4"]["placements"]["layers.0.moe.experts.w1"]
    assert placements == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    # ep 4 of 4: a whole quarter of the experts per rank (the efsdp dimension has one rank).
    assert report["moe_ep4_fsdp4"]["placements"]["layers.0.moe.experts.w1"].endswith("Shard(dim=0))")


def test_hsdp_replicates_the_expert_shards(report):
    # (dp_replicate, efsdp, ep) = (2, 1, 2): replicated over the replicas, a half of the experts per rank (FSDP's
    # shard over the one efsdp rank is a trivial one).
    placements = report["moe_hsdp_ep2"]["placements"]["layers.0.moe.experts.w1"]
    assert placements.startswith("(Replicate(), ") and placements.endswith(", Shard(dim=0))")
