"""FSDP2 and DDP on 2 ranks, with each activation-checkpointing mode: parity with one process, and memory."""

import pytest

from parity_layouts import Layout, parity_tests

FSDP = dict(dp_shard=2)
DDP = dict(dp_replicate=2, dp_shard=1)
LAYOUTS = [
    Layout("fsdp", FSDP, microbatches=2),
    Layout("fsdp_ac_full", FSDP, dict(ac_mode="full")),
    Layout("fsdp_ac_selective_op", FSDP, dict(ac_mode="selective", selective_ac_option="op")),
    Layout("fsdp_ac_every_2nd", FSDP, dict(ac_mode="selective", selective_ac_option="2")),
    Layout("fsdp_reshard_always", FSDP, dict(reshard_after_forward="always")),
    Layout("fsdp_reshard_never_cpu_offload", FSDP, dict(reshard_after_forward="never", cpu_offload=True)),
    Layout("fsdp_tied_embeddings", FSDP, tie_word_embeddings=True),
    Layout("ddp", DDP, microbatches=2),
    Layout("ddp_ac_full", DDP, dict(ac_mode="full")),
    Layout("ddp_ac_selective_op", DDP, dict(ac_mode="selective", selective_ac_option="op")),
]

pytestmark = pytest.mark.multiprocess


report, test_layout_matches_single_process = parity_tests(2, LAYOUTS)


def test_fsdp_holds_half_of_params_grads_and_optimizer_state(report):
    single, fsdp = report["reference"][("llama3", False)]["memory"], report["fsdp"]["memory"]
    assert fsdp.param_bytes == pytest.approx(single.param_bytes / 2, rel=0.01)
    assert fsdp.grad_bytes == pytest.approx(single.grad_bytes / 2, rel=0.01)
    assert fsdp.optimizer_bytes == pytest.approx(single.optimizer_bytes / 2, rel=0.01)
    assert report["ddp"]["memory"] == single


def test_fsdp_parameters_are_dp_sharded(report):
    assert report["fsdp"]["placements"]["layers.0.attention.wq.weight"] == "(Shard(dim=0),)"
    assert report["ddp"]["placements"]["layers.0.attention.wq.weight"] == "plain"
