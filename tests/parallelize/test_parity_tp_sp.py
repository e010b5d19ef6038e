"""Tensor + sequence parallel on 2 ranks, with each activation-checkpointing mode, gradient accumulation, tied
embeddings and document masking: parity with one process."""

import pytest

from parity_layouts import Layout, parity_tests

TP_SP = dict(tp=2, dp_shard=1)
LAYOUTS = [
    Layout("tp_sp", TP_SP, microbatches=2),
    Layout("tp_sp_ac_full", TP_SP, dict(ac_mode="full")),
    Layout("tp_sp_ac_selective_op", TP_SP, dict(ac_mode="selective", selective_ac_option="op")),
    Layout("tp_sp_tied_embeddings", TP_SP, tie_word_embeddings=True),
    Layout("tp_sp_block_causal", TP_SP, dict(attention_mask="block_causal")),
]

pytestmark = pytest.mark.multiprocess


report, test_layout_matches_single_process = parity_tests(2, LAYOUTS)


def test_tp_splits_the_matrices(report):
    single, tp = report["reference"][("llama3", False)]["memory"], report["tp_sp"]["memory"]
    assert report["tp_sp"]["placements"]["norm.weight"] == "(Replicate(),)"
    # Everything but the (replicated) norm weights is halved.
    assert single.param_bytes / 2 < tp.param_bytes < single.param_bytes / 2 * 1.01
