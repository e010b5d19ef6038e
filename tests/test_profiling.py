import json
import pickle
from dataclasses import replace

import pytest
import torch

from dtrain.config.schema import Profiling
from dtrain.errors import ConfigError
from dtrain.profiling import NoOpStepper, check_profiling_config, maybe_memory_snapshot, maybe_profile

CPU = torch.device("cpu")


def profiling_config(**fields) -> Profiling:
    return replace(Profiling(), **fields)


def run_matmul_steps(stepper, steps):
    x = torch.randn(16, 16)
    for _ in range(steps):
        x = torch.tanh(x @ x)
        stepper.step()


def trace_iterations(folder):
    return sorted(int(p.name.removeprefix("iteration_")) for p in folder.iterdir())


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
