"""FSDP2 x TP+SP (2 x 2) on 4 ranks with each activation-checkpointing mode, and context parallel with FSDP2 or
TP+SP (2 x 2) (also under document masking), for Llama 3 and Qwen3: parity with one process."""

import pytest

from parity_layouts import Layout, parity_tests

FSDP_TP = dict(dp_shard=2, tp=2)
LAYOUTS = [
    Layout("fsdp_tp", FSDP_TP),
    Layout("fsdp_tp_ac_full", FSDP_TP, dict(ac_mode="full")),
    Layout("fsdp_tp_ac_selective_op", FSDP_TP, dict(ac_mode="selective", selective_ac_option="op")),
    Layout("qwen3_fsdp_tp", FSDP_TP, family="qwen3"),
    Layout("cp_fsdp", dict(cp=2, dp_shard=2)),
    Layout("cp_tp", dict(cp=2, dp_shard=1, tp=2)),
    Layout("qwen3_cp_fsdp", dict(cp=2, dp_shard=2), family="qwen3"),
    Layout("qwen3_cp_tp", dict(cp=2, dp_shard=1, tp=2), family="qwen3"),
    Layout("cp_tp_block_causal", dict(cp=2, dp_shard=1, tp=2), dict(attention_mask="block_causal")),
]

pytestmark = pytest.mark.multiprocess


report, test_layout_matches_single_process = parity_tests(4, LAYOUTS)


def test_parameters_are_2d_dtensors_at_a_quarter_of_the_memory(report):
    placements = report["fsdp_tp"]["placements"]["layers.0.attention.wq.weight"]
    assert "_StridedShard(dim=0" in placements and placements.endswith("Shard(dim=0))")
    single, fsdp_tp = report["reference"][("llama3", False)]["memory"], report["fsdp_tp"]["memory"]
    assert single.param_bytes / 4 <= fsdp_tp.param_bytes < single.param_bytes / 4 * 1.02
