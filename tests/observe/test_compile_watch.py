"""The compile report follows the whole run: a compile after the first step (validation without grad, another
batch shape) is logged in one line with its reason and dated in the report, and the report is final at exit, also
when the loop fails."""

import json
import logging

import pytest
import torch

from dtrain.observe.compile_report import report_file
from dtrain.observe.compile_watch import CompileWatch
from dtrain.run.hooks import Hooks
from tests.e2e.run_train_helpers import run_train
from tests.observe.test_compile_study import TINY_MODEL


def block(x):
    return torch.tanh(x * 2).sum()


def read_report(run_dir):
    return json.loads(report_file(run_dir, 0).read_text())


def test_compiles_after_the_first_step_are_logged_and_dated_in_the_report(fresh_dynamo, tmp_path, caplog):
    # backend eager: dynamo alone, well under a second; dynamic=False: a new shape fails a size guard; fullgraph
    # as the trainer compiles (dynamo counts frames only without it).
    compiled = torch.compile(block, backend="eager", dynamic=False, fullgraph=True)
    watch = CompileWatch(tmp_path, rank=0, compile_cache=None)
    compiled(torch.randn(4, 8, requires_grad=True))
    watch.first_step(1)
    with caplog.at_level(logging.INFO, logger="dtrain"):
        compiled(torch.randn(4, 8, requires_grad=True))
        watch.after_step(2)  # nothing compiled: nothing logged, nothing written
        assert read_report(tmp_path)["through_step"] == 1
        compiled(torch.randn(3, 8, requires_grad=True))  # a short batch
        watch.after_step(3)
        with torch.no_grad():  # validation: grad mode is part of the guards
            compiled(torch.randn(4, 8))
        watch.after_step(4)
        watch.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compile: step ")]
    assert len(lines) == 2, lines
    assert lines[0].startswith("compile: step 3 recompiled block (") and "size mismatch at index 0" in lines[0]
    assert lines[1].startswith("compile: step 4 recompiled block (") and "grad_mode" in lines[1]
    assert lines[1].endswith(f"; report: {report_file(tmp_path, 0)}")
    report = read_report(tmp_path)
    assert (report["final"], report["through_step"]) == (True, 4)
    assert [(r["compile_id"], r["step"]) for r in report["recompiles"]] == [("0/1", 3), ("0/2", 4)]
    assert [frame["step"] for frame in report["frames"]] == [1, 3, 4]
    (final,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compile, final: ")]
    assert "2 recompile(s)" in final and "compile: " not in final.splitlines()[0]


def test_the_report_is_written_and_final_when_the_loop_fails(fresh_dynamo, tmp_path):
    compiled = torch.compile(block, backend="eager", dynamic=False)
    watch = CompileWatch(tmp_path, rank=0, compile_cache=None)
    hooks = Hooks()
    hooks.on_close(watch.close)
    with pytest.raises(RuntimeError, match="preempted mid-step"):
        with hooks.running():
            compiled(torch.randn(4, 8))
            watch.first_step(1)
            assert read_report(tmp_path)["final"] is False
            compiled(torch.randn(5, 8))  # compiled in a step that never finishes
            raise RuntimeError("preempted mid-step")
    report = read_report(tmp_path)
    assert (report["final"], report["through_step"]) == (True, 1)
    assert [(r["compile_id"], r["step"]) for r in report["recompiles"]] == [("0/1", None)]
    assert not list(tmp_path.glob("*.partial"))


@pytest.mark.slow
def test_a_trainer_run_reports_validations_recompile_and_names_its_graphs_in_the_profiler_tables(tmp_path):
    run_dir = tmp_path / "run"
    result = run_train(
        *TINY_MODEL, "--compile.enable", "--compile.components", "model,loss", "--training.steps", "3",
        "--validation.enable", "--validation.freq", "2", "--validation.steps", "1", "--validation.seq_len", "32",
        "--validation.local_batch_size", "2", "--profiling.enable_profiling", "--profiling.profile_freq", "3",
        "--profiling.profiler_warmup", "1", "--profiling.top_ops", "40", "--job.dump_folder", str(run_dir),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stdout + result.stderr
    # Validation at step 2 runs the compiled block and loss without grad: each recompiles, once, said at once.
    recompiled = [line for line in log.splitlines() if " INFO compile: step 2 recompiled " in line]
    assert [line.split(" recompiled ")[1].split(" (")[0] for line in recompiled] == [
        "TransformerBlock.forward", "cross_entropy_sum"], recompiled
    assert all("GLOBAL_STATE changed: grad_mode" in line for line in recompiled)
    assert " INFO compile, final: " in log
    report = read_report(run_dir)
    assert (report["final"], report["through_step"]) == (True, 3)
    assert [(r["frame"], r["step"]) for r in report["recompiles"]] == [
        ("TransformerBlock.forward", 2), ("cross_entropy_sum", 2)]
    tables = json.loads((run_dir / "profile_traces" / "iteration_3" / "rank0_top_ops.json").read_text())
    names = {row["name"] for row in tables["tables"][0]["rows"]}
    block, loss = "TransformerBlock.forward [0/0]", "cross_entropy_sum [1/0]"
    assert {f"CompiledFunction {block}", f"CompiledFunctionBackward {block}", f"CompiledFunction {loss}"} <= names
    assert not names & {"CompiledFunction", "CompiledFunctionBackward"}
    assert all(tables["phases"]["phases_us"][phase] > 0 for phase in ("forward", "backward", "optimizer"))
    assert "step time by phase over 1 recorded step(s)" in log
