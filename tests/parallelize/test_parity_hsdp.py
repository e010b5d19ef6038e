"""HSDP (2 replicas x 2 shards) with each activation-checkpointing mode, and data-parallel replicas of a TP
model (2 replicas x TP 2), and HSDP over context-parallel ranks (2 replicas x CP 2), on 4 ranks, for Llama 3 (and
HSDP for Qwen3): parity with one process."""

import pytest

from parity_layouts import Layout, parity_tests

HSDP = dict(dp_replicate=2, dp_shard=2)
LAYOUTS = [
    Layout("hsdp", HSDP),
    Layout("hsdp_ac_full", HSDP, dict(ac_mode="full")),
    Layout("hsdp_ac_selective_op", HSDP, dict(ac_mode="selective", selective_ac_option="op")),
    Layout("replicate_x_tp", dict(dp_replicate=2, dp_shard=1, tp=2)),
    Layout("qwen3_hsdp", HSDP, family="qwen3"),
    Layout("hsdp_cp", dict(dp_replicate=2, dp_shard=1, cp=2)),
]

pytestmark = pytest.mark.multiprocess


report, test_layout_matches_single_process = parity_tests(4, LAYOUTS)


def test_hsdp_shards_within_replicas(report):
    assert report["hsdp"]["placements"]["layers.0.attention.wq.weight"] == "(Replicate(), Shard(dim=0))"
    single, hsdp = report["reference"][("llama3", False)]["memory"], report["hsdp"]["memory"]
    assert hsdp.param_bytes == pytest.approx(single.param_bytes / 2, rel=0.01)
