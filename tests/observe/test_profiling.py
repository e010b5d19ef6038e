import json
import logging
import pickle
import warnings
from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.autograd.profiler_util import FunctionEvent

from dtrain.config.schema_observe import Profiling
from dtrain.errors import ConfigError
from dtrain.observe.profiler_events import name_compiled_graphs
from dtrain.observe.profiler_table import OperatorRow, OperatorTable, format_table
from dtrain.observe.profiling import NoOpStepper, check_profiling_config, maybe_memory_snapshot, maybe_profile
from tests.e2e.run_train_helpers import run_train

CPU = torch.device("cpu")


def profiling_config(**fields) -> Profiling:
    return replace(Profiling(), **fields)


def run_matmul_steps(stepper, steps):
    x = torch.randn(16, 16)
    for _ in range(steps):
        x = torch.tanh(x @ x)
        stepper.step()


def trace_iterations(folder):
    return sorted(int(p.name.removeprefix("iteration_")) for p in folder.glob("iteration_*"))


def test_profiler_writes_traces_at_the_end_of_each_window(tmp_path):
    profiling = profiling_config(enable_profiling=True, profile_freq=3, profiler_warmup=1, profiler_active=1)
    with maybe_profile(profiling, tmp_path, rank=1) as profiler:
        run_matmul_steps(profiler, 7)
    traces = tmp_path / "profile_traces"
    assert trace_iterations(traces) == [3, 6]
    trace = json.loads((traces / "iteration_3" / "rank1_trace.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert "aten::mm" in names


def test_profiler_windows_stay_on_training_steps_after_resume(tmp_path):
    profiling = profiling_config(enable_profiling=True, profile_freq=3, profiler_warmup=1, profiler_active=1)
    with maybe_profile(profiling, tmp_path, rank=0, start_step=4) as profiler:
        run_matmul_steps(profiler, 4)  # training steps 5..8
    # Step 6 closes a window. Training ends with step 9's window open (recording, none of its steps run): no trace.
    assert trace_iterations(tmp_path / "profile_traces") == [6]


def test_profiler_options_reach_torch_profiler(tmp_path):
    profiling = profiling_config(enable_profiling=True, profile_freq=2, profiler_warmup=1, profiler_active=1)
    with maybe_profile(profiling, tmp_path, rank=0) as profiler:
        assert (profiler.profiler.record_shapes, profiler.profiler.with_stack) == (False, False)
        assert profiler.profiler.profile_memory is False
    asked = replace(profiling, record_shapes=True, with_stack=True, profile_memory=True)
    with maybe_profile(asked, tmp_path, rank=0) as profiler:
        assert (profiler.profiler.record_shapes, profiler.profiler.with_stack) == (True, True)
        assert profiler.profiler.profile_memory is True


def test_each_window_writes_its_top_operators_and_rank_0_logs_them(tmp_path, caplog):
    profiling = profiling_config(
        enable_profiling=True, profile_freq=3, profiler_warmup=1, profiler_active=1, record_shapes=True, top_ops=3
    )
    with caplog.at_level(logging.INFO, logger="dtrain.observe.profiling"):
        for rank in (0, 1):
            with maybe_profile(profiling, tmp_path, rank=rank) as profiler:
                run_matmul_steps(profiler, 6)
    for iteration in (3, 6):
        folder = tmp_path / "profile_traces" / f"iteration_{iteration}"
        for rank in (0, 1):
            assert (folder / f"rank{rank}_top_ops.txt").read_text().count("| operator ") == 1
        (table,) = json.loads((folder / "rank0_top_ops.json").read_text())["tables"]
        assert table["sort_key"] == "self_cpu_us" and len(table["rows"]) == 3
        self_times = [row["self_cpu_us"] for row in table["rows"]]
        assert self_times == sorted(self_times, reverse=True)
        # Besides the step itself the window ran aten::mm and aten::tanh once each (on [16, 16] inputs), and a
        # helper op or two: at least one of the two is in the top three.
        computed = [row for row in table["rows"] if row["name"] in ("aten::mm", "aten::tanh")]
        assert computed and all(row["calls"] == 1 and row["input_shapes"].startswith("[[16, 16]") for row in computed)
    logged = [r.getMessage() for r in caplog.records if "times summed over 1 step(s)" in r.getMessage()]
    assert len(logged) == 2  # rank 0's two windows; rank 1 writes its tables without logging them
    assert "top 3 operators by self CPU time" in logged[0] and "| input shapes" in logged[0]


def test_top_ops_zero_writes_no_table(tmp_path):
    profiling = profiling_config(enable_profiling=True, profile_freq=2, profiler_warmup=1, profiler_active=1, top_ops=0)
    with maybe_profile(profiling, tmp_path, rank=0) as profiler:
        run_matmul_steps(profiler, 2)
    assert [p.name for p in (tmp_path / "profile_traces" / "iteration_2").iterdir()] == ["rank0_trace.json"]


def test_operator_table_format():
    rows = [
        OperatorRow("aten::mm", 24, 120_512.0, 130_000.0, 0.0, "[[1024, 256], [256, 256]]"),
        OperatorRow("aten::add_", 3, 1_500.0, 1_500.0, 0.0, "[[256], [256], []]"),
    ]
    table = OperatorTable("top 2 operators by self CPU time", "self_cpu_us", 200_000.0, rows)
    assert format_table(table, with_device=False, with_shapes=True) == (
        "top 2 operators by self CPU time (total 200.000 ms)\n"
        "| operator   | calls | self CPU ms | CPU total ms | % of total | input shapes              |\n"
        "| ---------- | ----- | ----------- | ------------ | ---------- | ------------------------- |\n"
        "| aten::mm   | 24    | 120.512     | 130.000      | 60.3       | [[1024, 256], [256, 256]] |\n"
        "| aten::add_ | 3     | 1.500       | 1.500        | 0.8        | [[256], [256], []]        |"
    )
    assert "input shapes" not in format_table(table, with_device=False, with_shapes=False)


def test_profiler_warnings_go_to_the_rank_file_not_the_log(tmp_path, monkeypatch):
    # torch warns once per process that each window clears the previous one's events; let it warn again here.
    monkeypatch.setattr(torch.profiler.profiler, "_WARNINGS_SHOWN", set())
    profiling = profiling_config(enable_profiling=True, profile_freq=2, profiler_warmup=1, profiler_active=1)
    with warnings.catch_warnings(record=True) as escaped:
        warnings.simplefilter("always")
        with maybe_profile(profiling, tmp_path, rank=2) as profiler:
            run_matmul_steps(profiler, 4)
    assert not [w for w in escaped if "profiler" in w.filename]
    assert "Profiler clears events" in (tmp_path / "profile_traces" / "rank2_profiler.log").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU message")
def test_profile_memory_on_cpu_says_once_that_the_memory_timeline_is_skipped(tmp_path, caplog):
    profiling = profiling_config(
        enable_profiling=True, profile_freq=2, profiler_warmup=1, profiler_active=1, profile_memory=True
    )
    with caplog.at_level(logging.INFO, logger="dtrain.observe.profiling"):
        with maybe_profile(profiling, tmp_path, rank=0) as profiler:
            run_matmul_steps(profiler, 4)
    assert sum("memory timeline needs CUDA" in r.getMessage() for r in caplog.records) == 1
    assert not list((tmp_path / "profile_traces").glob("*/*memory_timeline*"))


@pytest.mark.slow
def test_profiled_run_log_is_quiet_and_writes_traces_and_tables(tmp_path):
    run = run_train(
        "--training.steps", "6", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--profiling.enable_profiling", "--profiling.profile_freq", "3", "--profiling.profiler_warmup", "1",
        "--profiling.top_ops", "5", "--job.dump_folder", str(tmp_path),
    )
    assert run.returncode == 0, run.stderr
    output = run.stdout + run.stderr
    assert "USDT" not in output and "Warning" not in output, output
    assert "top 5 operators by self CPU time" in output
    folder = tmp_path / "profile_traces" / "iteration_3"
    assert {p.name for p in folder.iterdir()} >= {"rank0_trace.json", "rank0_top_ops.txt", "rank0_top_ops.json"}


def test_profiling_off_yields_a_no_op_and_writes_nothing(tmp_path):
    with maybe_profile(Profiling(), tmp_path, rank=0) as profiler:
        assert isinstance(profiler, NoOpStepper)
        run_matmul_steps(profiler, 2)
    assert not any(tmp_path.iterdir())


def test_window_longer_than_profile_freq_is_refused_before_profiling(tmp_path):
    profiling = profiling_config(enable_profiling=True, profile_freq=4, profiler_warmup=3, profiler_active=2)
    with pytest.raises(ConfigError, match=r"profiling\.profiler_warmup \(3\) \+ profiling\.profiler_active \(2\)"):
        maybe_profile(profiling, tmp_path, rank=0)
    with pytest.raises(ConfigError, match=r"profiling\.profile_freq \(4\)"):
        check_profiling_config(profiling, CPU)


def test_memory_snapshot_on_cpu_is_refused_at_construction(tmp_path):
    profiling = profiling_config(enable_memory_snapshot=True)
    expected = (
        "profiling.enable_memory_snapshot needs CUDA (torch.cuda.memory._record_memory_history); this run is on "
        "cpu — set profiling.enable_memory_snapshot = false"
    )
    with pytest.raises(ConfigError) as refused:
        maybe_memory_snapshot(profiling, tmp_path, rank=0, device=CPU)
    assert str(refused.value) == expected
    with pytest.raises(ConfigError):
        check_profiling_config(profiling, CPU)


def test_memory_snapshot_off_yields_a_no_op(tmp_path):
    with maybe_memory_snapshot(Profiling(), tmp_path, rank=0, device=CPU) as snapshot:
        assert isinstance(snapshot, NoOpStepper)
        run_matmul_steps(snapshot, 2)
    assert not any(tmp_path.iterdir())


@pytest.mark.cuda
def test_memory_snapshot_dumps_every_profile_freq_steps_on_cuda(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    profiling = profiling_config(enable_memory_snapshot=True, profile_freq=2)
    with maybe_memory_snapshot(profiling, tmp_path, rank=0, device=device) as snapshot:
        x = torch.randn(256, 256, device=device)
        for _ in range(4):
            x = torch.tanh(x @ x)
            snapshot.step()
    folder = tmp_path / "memory_snapshot"
    assert trace_iterations(folder) == [2, 4]
    dumped = pickle.loads((folder / "iteration_2" / "rank0_memory_snapshot.pickle").read_bytes())
    assert dumped["segments"]


@pytest.mark.cuda
def test_profiler_records_cuda_kernels(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    profiling = profiling_config(enable_profiling=True, profile_freq=2, profiler_warmup=1, profiler_active=1)
    x = torch.randn(256, 256, device="cuda")
    with maybe_profile(profiling, tmp_path, rank=0) as profiler:
        for _ in range(2):
            x = torch.tanh(x @ x)
            profiler.step()
    trace = json.loads((tmp_path / "profile_traces" / "iteration_2" / "rank0_trace.json").read_text())
    assert any(event.get("cat") == "kernel" for event in trace["traceEvents"])


@pytest.mark.cuda
def test_cuda_window_ranks_operators_by_cuda_time_and_exports_the_memory_timeline(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    profiling = profiling_config(
        enable_profiling=True, profile_freq=2, profiler_warmup=1, profiler_active=1, profile_memory=True, top_ops=5
    )
    x = torch.randn(256, 256, device="cuda")
    with maybe_profile(profiling, tmp_path, rank=0) as profiler:
        for _ in range(2):
            x = torch.tanh(x @ x)
            profiler.step()
    folder = tmp_path / "profile_traces" / "iteration_2"
    by_cuda, by_cpu = json.loads((folder / "rank0_top_ops.json").read_text())["tables"]
    assert (by_cuda["sort_key"], by_cpu["sort_key"]) == ("self_device_us", "self_cpu_us")
    assert by_cuda["rows"][0]["self_device_us"] > 0
    assert "self CUDA ms" in (folder / "rank0_top_ops.txt").read_text()
    (timeline,) = folder.glob("rank0_memory_timeline.*")
    assert timeline.stat().st_size > 0


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(self.linear(x))


def squared_sum(y):
    return (y * y).sum()


def test_tables_name_each_compiled_graph_and_split_the_step_by_phase(tmp_path):
    torch._dynamo.reset()
    model = nn.Sequential(Block(), Block())
    for block in model:  # aot_eager: the autograd graphs of inductor, without its C++ builds
        block.compile(backend="aot_eager")
    loss = torch.compile(squared_sum, backend="aot_eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    profiling = profiling_config(enable_profiling=True, profile_freq=2, profiler_warmup=1, profiler_active=1,
                                 top_ops=200)
    x = torch.randn(4, 16)
    try:
        with maybe_profile(profiling, tmp_path, rank=0) as profiler:
            for _ in range(2):
                loss(model(x)).backward()
                optimizer.step()
                optimizer.zero_grad()
                profiler.step()
    finally:
        torch._dynamo.reset()
    document = json.loads((tmp_path / "profile_traces" / "iteration_2" / "rank0_top_ops.json").read_text())
    names = {row["name"] for row in document["tables"][0]["rows"]}
    assert not names & {"CompiledFunction", "CompiledFunctionBackward"}, names
    for graph in ("Block.forward [0/0]", "squared_sum [1/0]"):  # which code, and both directions
        assert {f"CompiledFunction {graph}", f"CompiledFunctionBackward {graph}"} <= names, names
    phases = document["phases"]["phases_us"]
    assert set(phases) == {"forward", "backward", "optimizer", "other"}
    assert all(phases[phase] > 0 for phase in ("forward", "backward", "optimizer")), phases
    assert sum(phases.values()) == pytest.approx(document["phases"]["total_us"])
    assert "step time by phase over 1 recorded step(s)" in (tmp_path / "profile_traces" / "iteration_2" /
                                                            "rank0_top_ops.txt").read_text()


def event(id_, name, start, end, parent=None, sequence_nr=-1, fwd_thread=0):
    made = FunctionEvent(id_, name, thread=1, start_us=start, end_us=end, sequence_nr=sequence_nr,
                         fwd_thread=fwd_thread)
    if parent is not None:
        made.set_cpu_parent(parent)
        parent.append_cpu_child(made)
    return made


def test_inductor_graph_calls_are_named_by_frame_and_direction():
    # What inductor's graphs look like in a window (their call carries a cache key, or None with caches off).
    region = event(1, "Torch-Compiled Region: 0/0", 0, 10)
    forward = event(2, "CompiledFunction", 1, 9, region, sequence_nr=37)
    forward_call = event(3, "## Call CompiledFxGraph None ##", 2, 8, forward)
    engine = event(4, "autograd::engine::evaluate_function: CompiledFunctionBackward", 20, 30, sequence_nr=37,
                   fwd_thread=1)
    backward = event(5, "CompiledFunctionBackward", 21, 29, engine, sequence_nr=37, fwd_thread=1)
    backward_call = event(6, "## Call CompiledFxGraph fclq377 ##", 22, 28, backward)
    events = [region, forward, forward_call, engine, backward, backward_call]
    assert name_compiled_graphs(events, {"0/0": "TransformerBlock.forward"}) == 2
    assert forward_call.name == "## Call CompiledFxGraph TransformerBlock.forward [0/0] forward ##"
    assert backward_call.name == "## Call CompiledFxGraph TransformerBlock.forward [0/0] backward ##"
    assert backward.name == "CompiledFunctionBackward TransformerBlock.forward [0/0]"
    assert region.name == "Torch-Compiled Region: 0/0"
