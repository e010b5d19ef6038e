"""Context parallel on 2 ranks: every sequence split over the ranks (head-tail or plain chunks), alone, with
FSDP's sharding over dp_shard × cp, with activation checkpointing, with compile and with document masking (the
masked path), with float8 linears; Llama 3 and Qwen3. Each layout reproduces the single-process run (fp32, 1e-5)."""

import pytest

from parity_layouts import Layout, parity_tests

CP = dict(cp=2, dp_shard=1)
LAYOUTS = [
    Layout("cp", CP, microbatches=2),
    Layout("cp_no_load_balancer", CP, dict(cp_load_balancer="none")),
    Layout("cp_ac_full", CP, dict(ac_mode="full")),
    Layout("cp_ac_selective_op", CP, dict(ac_mode="selective", selective_ac_option="op")),
    Layout("cp_compile", CP, dict(compile_model=True, compile_backend="aot_eager")),
    Layout("qwen3_cp", CP, family="qwen3"),
    Layout("qwen3_cp_tied", CP, tie_word_embeddings=True, family="qwen3"),
    Layout("cp_block_causal", CP, dict(attention_mask="block_causal"), microbatches=2),
    Layout("cp_no_load_balancer_block_causal", CP, dict(cp_load_balancer="none", attention_mask="block_causal")),
    Layout("qwen3_cp_block_causal", CP, dict(attention_mask="block_causal"), family="qwen3"),
    # float8 linears see each rank's part of the sequence. Rowwise scales are per token, so they are the same as
    # one process's; tensorwise scales would come from each rank's part (as on GPUs, where torchtitan does the
    # same), which one process cannot reproduce.
    Layout("cp_float8_rowwise", CP, float8=dict(recipe_name="rowwise")),
]

pytestmark = pytest.mark.multiprocess


report, test_layout_matches_single_process = parity_tests(2, LAYOUTS)


def test_parameters_are_sharded_over_the_cp_ranks(report):
    assert report["cp"]["placements"]["layers.0.attention.wq.weight"] == "(Shard(dim=0),)"
    single = report["reference"][("llama3", False)]["memory"]
    assert report["cp"]["memory"].param_bytes < 0.6 * single.param_bytes
