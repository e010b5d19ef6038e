"""The compile report: graph breaks with their user-code location, recompiles with the failed guard, the JSON file
per rank, and the trainer's report and one-prefix log line after the first step."""

import inspect
import json

import pytest
import torch

from dtrain.observe.compile_report import (
    collect_compile_report,
    report_file,
    save_compile_report,
)
from tests.e2e.run_train_helpers import FP32, run_train

REPORT_KEYS = {"compile_time_s", "time_split_s", "frames_compiled", "graphs", "frames", "graph_breaks",
               "recompiles", "cache", "portable_cache", "torch_version", "graph_break_count", "through_step", "final"}


def breaks_once(x):
    y = x.sin()
    print("a deliberate graph break")
    return (y * 2).sum()


BREAK_LINE = inspect.getsourcelines(breaks_once)[1] + 2


def test_a_graph_break_and_a_shape_recompile_are_reported_with_where_and_why(fresh_dynamo, tmp_path, capsys):
    # backend eager: dynamo alone, so the test compiles in well under a second.
    compiled = torch.compile(breaks_once, backend="eager", fullgraph=False, dynamic=False)
    compiled(torch.randn(4, 8))
    compiled(torch.randn(5, 8))  # dynamic=False: a new shape fails a size guard
    report = collect_compile_report()
    assert report.graph_break_count == 2  # once per compile of the frame
    (graph_break,) = report.graph_breaks
    assert graph_break.reason == "Failed to trace builtin operator"
    assert graph_break.locations == [f"{__file__}:{BREAK_LINE}"]
    assert "print" in graph_break.detail
    first = report.recompiles[0]
    assert first["frame"] == "breaks_once" and first["compile_id"] == "0/1"
    assert "size mismatch at index 0. expected 4, actual 5" in first["reason"]
    summary = report.format()
    assert summary.startswith("compile: ") and "compile: compile:" not in summary
    assert "2 graph break(s)" in summary and f"at {__file__}:{BREAK_LINE}" in summary
    assert len(summary.splitlines()) == 2
    assert "Graph break in user code" not in capsys.readouterr().err  # captured for the report, not printed

    save_compile_report(report, tmp_path, rank=1)
    document = json.loads(report_file(tmp_path, 1).read_text())
    assert report_file(tmp_path, 1).name == "compile_report_rank1.json"
    assert report_file(tmp_path, 0).name == "compile_report.json"
    assert set(document) == REPORT_KEYS
    assert document["graph_break_count"] == 2 and len(document["recompiles"]) >= 1


def test_fullgraph_turns_the_same_break_into_an_error(fresh_dynamo):
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(breaks_once, backend="eager", fullgraph=True)(torch.randn(4, 8))


@pytest.mark.slow
def test_the_trainer_writes_the_report_logs_it_once_and_dumps_inductor_code_of_the_first_step(tmp_path):
    run_dir = tmp_path / "run"
    result = run_train(
        "--model.args.n_layers", "2", "--model.args.dim", "64", "--model.args.n_heads", "4",
        "--model.args.n_kv_heads", "2", "--training.seq_len", "16", "--training.local_batch_size", "2",
        "--training.steps", "2", "--metrics.log_freq", "1", *FP32, "--compile.enable",
        "--compile.debug_dir", "compile_debug", "--job.dump_folder", str(run_dir),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    log = result.stdout + result.stderr
    (line,) = [line for line in log.splitlines() if " INFO compile: " in line and "report:" in line]
    assert "compile: compile:" not in line and f"report: {run_dir / 'compile_report.json'}" in line
    assert "0 graph break(s), 0 recompile(s)" in line
    report = json.loads((run_dir / "compile_report.json").read_text())
    assert set(report) == REPORT_KEYS
    # One frame for both identical blocks (compiled once), one for the loss.
    assert sorted(frame["name"] for frame in report["frames"]) == ["cross_entropy_sum", "forward"]
    assert report["frames_compiled"] == 2 and report["graph_breaks"] == [] and report["recompiles"] == []
    assert set(report["time_split_s"]) == {"dynamo", "aot_autograd", "inductor"}
    assert sum(report["time_split_s"].values()) == pytest.approx(report["compile_time_s"], abs=0.01)
    # A frame found in the AOT autograd cache loads forward and backward at once: no backward compile of its own.
    assert all(frame["total_s"] > 0 and frame["backward_s"] >= 0 for frame in report["frames"])
    # compile.debug_dir: inductor generated (no cache hit skipped it) and wrote the code of every graph.
    assert report["cache"]["fx_graph"]["hit"] == 0
    code = run_dir / "compile_debug" / "rank0" / "torchinductor"
    graphs = sorted(folder.name for folder in code.iterdir())
    assert len(graphs) == 4 and sum("backward" in name for name in graphs) == 2, graphs
    assert f"compile: inductor's code of 4 graph(s) compiled in this run's first step is in {code}" in log
    assert "debug trace:" not in log and "dynamo_pgo" not in log  # torch's lines per graph stay out of the log
    for folder in code.iterdir():
        assert {"output_code.py", "fx_graph_readable.py", "ir_post_fusion.txt"} <= {p.name for p in folder.iterdir()}
