"""FSDP2 and DDP on 2 ranks, with each activation-checkpointing mode (the memory budget through compile's
partitioner), FSDP2 with document masking, FSDP2 and DDP with float8, and FSDP2 with MX: parity with one process,
and memory."""

import pytest

from dtrain.parallelize.torch_compat import MXFP8_TRAINING_SUPPORTED

from parity_layouts import Layout, max_relative_diff, parity_tests

FSDP = dict(dp_shard=2)
DDP = dict(dp_replicate=2, dp_shard=1)
FLOAT8_ALL_GATHER = dict(enable_fsdp_float8_all_gather=True, precompute_float8_dynamic_scale_for_fsdp=True)
LAYOUTS = [
    Layout("fsdp", FSDP, microbatches=2),
    Layout("fsdp_ac_full", FSDP, dict(ac_mode="full")),
    Layout("fsdp_ac_selective_op", FSDP, dict(ac_mode="selective", selective_ac_option="op")),
    Layout("fsdp_ac_every_2nd", FSDP, dict(ac_mode="selective", selective_ac_option="2")),
    Layout("fsdp_reshard_always", FSDP, dict(reshard_after_forward="always")),
    Layout("fsdp_reshard_never_cpu_offload", FSDP, dict(reshard_after_forward="never", cpu_offload=True)),
    Layout("fsdp_tied_embeddings", FSDP, tie_word_embeddings=True),
    Layout("fsdp_block_causal", FSDP, dict(attention_mask="block_causal"), microbatches=2),
    # float8 (emulated on CPU) with float8 weight all-gathers and the scale precompute after each step, against one
    # process training the same float8 model.
    Layout("fsdp_float8_all_gather", FSDP, float8=FLOAT8_ALL_GATHER),
    # MXFP8 (emulated) under FSDP2; torchao's MX training needs torch 2.13.
    *([Layout("fsdp_mx", FSDP, mx=dict(recipe_name="mxfp8_emulated_rceil"))] if MXFP8_TRAINING_SUPPORTED else []),
    Layout("ddp", DDP, microbatches=2),
    Layout("ddp_float8", DDP, float8={}),
    Layout("ddp_ac_full", DDP, dict(ac_mode="full")),
    Layout("ddp_ac_selective_op", DDP, dict(ac_mode="selective", selective_ac_option="op")),
    # Last: torch's activation memory budget is process-wide, so the layouts after it would compile under it too.
    Layout(
        "fsdp_ac_memory_budget",
        FSDP,
        dict(
            ac_mode="memory_budget", memory_budget=0.0, compile_model=True,
            compile_backend="aot_eager_decomp_partition",
        ),
    ),
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


def test_document_masking_changes_what_is_learned(report):
    # Else the block_causal layouts would prove nothing: their data must hold documents that the mask separates.
    causal, masked = report["reference"][("llama3", False)], report["reference"][("llama3", False, "block_causal")]
    assert max_relative_diff(masked["losses"], causal["losses"]) > 1e-3
