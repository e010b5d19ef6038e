"""Per-block torch.compile with TP+SP and a TP'd embedding: parity with one process (regression test).

With torch's own RowwiseParallel on the embedding (its output is redistributed asynchronously), the compiled
blocks' backward fails with ``'Tensor' object has no attribute '_local_tensor'`` (torch 2.13). The plan's
SyncOutputRowwiseParallel must keep the embedding vocab-sharded *and* train exactly. The failure lives in
dynamo/AOTAutograd, so the fast ``aot_eager`` backend reproduces it; inductor adds 10 s per layout on this CPU.
"""

import pytest

from dist_harness import run_world
from parity_layouts import Layout, assert_matches_single_process, run_layouts

COMPILE = dict(compile_model=True, compile_backend="aot_eager")
LAYOUTS = [
    Layout("tp_sp_compile", dict(tp=2, dp_shard=1), COMPILE),
    Layout("tp_sp_compile_sac_op", dict(tp=2, dp_shard=1), {**COMPILE, "ac_mode": "selective", "selective_ac_option": "op"}),
]

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.fixture(scope="module")
def report():
    return run_world(2, run_layouts, LAYOUTS, timeout_s=300)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_compiled_tp_layout_matches_single_process(report, layout):
    assert_matches_single_process(report, layout)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_identical_blocks_compile_once_without_breaks(report, layout):
    compiled = report[layout.name]["compile"]
    assert compiled.frames_compiled == 1
    assert compiled.graph_breaks == []
    assert compiled.recompile_reasons == []


def test_embedding_stays_vocab_sharded_under_compile(report):
    assert report["tp_sp_compile"]["placements"]["tok_embeddings.weight"] == "(Shard(dim=0),)"
