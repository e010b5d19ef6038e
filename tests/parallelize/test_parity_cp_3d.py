"""A 3-D layout with context parallel on 8 ranks: FSDP2 2 × CP 2 × TP+SP 2, for Llama 3 and Qwen3 (parity with one
process, fp32, 1e-5). Eight processes on the test machine's cores: one world, two layouts."""

import pytest

from parity_layouts import Layout, parity_tests

FSDP_CP_TP = dict(dp_shard=2, cp=2, tp=2)
LAYOUTS = [
    Layout("fsdp_cp_tp", FSDP_CP_TP),
    Layout("qwen3_fsdp_cp_tp", FSDP_CP_TP, family="qwen3"),
]

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


report, test_layout_matches_single_process = parity_tests(8, LAYOUTS)
