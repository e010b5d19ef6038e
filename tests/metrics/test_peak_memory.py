import types

import pytest
import torch

from dtrain.metrics import memory
from dtrain.metrics.memory import peak_memory_gib


def test_cpu_peak_memory_is_the_process_peak_rss():
    # The interpreter plus torch alone occupy well over 50 MiB; far below 1 TiB on any test machine.
    assert 0.05 < peak_memory_gib(torch.device("cpu")) < 1024


def _fake_rusage(monkeypatch, max_rss):
    monkeypatch.setattr(memory.resource, "getrusage", lambda who: types.SimpleNamespace(ru_maxrss=max_rss))


def test_linux_reports_kib(monkeypatch):
    _fake_rusage(monkeypatch, 2 * 1024 * 1024)
    monkeypatch.setattr(memory.sys, "platform", "linux")
    assert peak_memory_gib(torch.device("cpu")) == pytest.approx(2.0)


def test_macos_reports_bytes(monkeypatch):
    _fake_rusage(monkeypatch, 3 * 1024**3)
    monkeypatch.setattr(memory.sys, "platform", "darwin")
    assert peak_memory_gib(torch.device("cpu")) == pytest.approx(3.0)


@pytest.mark.cuda
def test_cuda_peak_memory_counts_allocated_tensors():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    block = torch.empty(256 * 1024**2, dtype=torch.uint8, device=device)
    assert peak_memory_gib(device) >= 0.25
    del block
