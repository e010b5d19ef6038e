"""Per-block torch.compile (inductor) under FSDP2, with a structured compile trace: parity with one process."""

import glob
import os

import pytest

from dist_harness import run_world
from parity_layouts import Layout, assert_matches_single_process, run_layouts

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("compile_trace"))


@pytest.fixture(scope="module")
def layout(trace_dir):
    options = dict(compile_model=True, compile_backend="inductor", compile_trace_dir=trace_dir)
    return Layout("fsdp_compile", dict(dp_shard=2), options, microbatches=2)


@pytest.fixture(scope="module")
def report(layout):
    return run_world(2, run_layouts, [layout], timeout_s=300)


def test_compiled_fsdp_matches_single_process(report, layout):
    assert_matches_single_process(report, layout)


def test_identical_blocks_compile_once_without_breaks(report, layout):
    compiled = report[layout.name]["compile"]
    assert compiled.frames_compiled == 1
    assert compiled.graph_breaks == []
    assert compiled.recompile_reasons == []
    assert compiled.compile_time_s > 0
    assert "1 frame(s) compiled" in compiled.format()


def test_trace_written_per_rank_for_tlparse(report, trace_dir):
    files = sorted(glob.glob(os.path.join(trace_dir, "dedicated_log_torch_trace_rank_*.log")))
    assert [os.path.basename(f).split("_")[5] for f in files] == ["0", "1"]
    with open(files[0]) as trace:
        text = trace.read()
    assert '"dynamo_start"' in text and '"compilation_metrics"' in text
