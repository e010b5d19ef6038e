"""Tensor parallel on 2 ranks without sequence parallel (replicated activations), with each activation-
checkpointing mode and with loss parallel off: parity with one process."""

import pytest

from parity_layouts import Layout, parity_tests

TP = dict(tp=2, dp_shard=1, sequence_parallel=False)
LAYOUTS = [
    Layout("tp", TP),
    Layout("tp_ac_full", TP, dict(ac_mode="full")),
    Layout("tp_ac_selective_op", TP, dict(ac_mode="selective", selective_ac_option="op")),
    Layout("tp_no_loss_parallel", {**TP, "loss_parallel": False}),
]

pytestmark = pytest.mark.multiprocess


report, test_layout_matches_single_process = parity_tests(2, LAYOUTS)


def test_every_parameter_is_a_tp_dtensor(report):
    # Norms are replicated DTensors (ReplicateParallel), so one gradient norm and one FSDP group cover all.
    placements = report["tp"]["placements"]
    assert placements["tok_embeddings.weight"] == "(Shard(dim=0),)"
    assert placements["layers.0.attention.wq.weight"] == "(Shard(dim=0),)"
    assert placements["output.weight"] == "(Shard(dim=0),)"
    assert placements["norm.weight"] == "(Replicate(),)"
