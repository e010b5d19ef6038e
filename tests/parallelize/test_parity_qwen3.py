"""The Qwen3 family on 2 ranks (FSDP2, DDP, TP, TP+SP with AC, tied embeddings, compile and document masking):
parity with one Qwen3 process, in one world. QK-norm under TP runs on this rank's heads (its weight's gradient a partial sum),
and head_dim is not dim / n_heads, which the Llama layouts never exercise. Qwen3's HSDP, FSDP x TP and pipeline
layouts run in the 4-rank and pipeline worlds beside Llama's."""

import pytest

from parity_layouts import Layout, parity_tests

QWEN3 = dict(family="qwen3")
TP_SP = dict(tp=2, dp_shard=1)
LAYOUTS = [
    Layout("qwen3_fsdp", dict(dp_shard=2), microbatches=2, **QWEN3),
    Layout("qwen3_ddp", dict(dp_replicate=2, dp_shard=1), **QWEN3),
    Layout("qwen3_tp", dict(tp=2, dp_shard=1, sequence_parallel=False), **QWEN3),
    Layout("qwen3_tp_sp_ac_selective_op", TP_SP, dict(ac_mode="selective", selective_ac_option="op"), **QWEN3),
    Layout("qwen3_tp_sp_tied_embeddings", TP_SP, tie_word_embeddings=True, **QWEN3),
    Layout("qwen3_tp_sp_compile", TP_SP, dict(compile_model=True, compile_backend="aot_eager"), **QWEN3),
    Layout("qwen3_tp_sp_block_causal", TP_SP, dict(attention_mask="block_causal"), **QWEN3),
]

pytestmark = pytest.mark.multiprocess


report, test_layout_matches_single_process = parity_tests(2, LAYOUTS)


def test_qk_norm_weights_are_replicated_over_tp(report):
    assert "layers.1.attention.k_norm.weight" in report["qwen3_tp"]["param_names"]
    assert report["qwen3_tp"]["placements"]["layers.0.attention.q_norm.weight"] == "(Replicate(),)"
    assert report["qwen3_tp"]["placements"]["layers.0.attention.wq.weight"] == "(Shard(dim=0),)"
