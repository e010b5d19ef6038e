import types

import pytest
import torch

from dtrain.metrics import device_peaks
from dtrain.metrics.device_peaks import device_peak_flops, peak_flops_for_name, tf32_matmul_enabled

BF16 = torch.bfloat16


@pytest.mark.parametrize(
    "name, expected",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA H200 NVL", 835e12),
        ("NVIDIA GH200 480GB", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA A10", 125e12),
        ("NVIDIA A10G", 70e12),
        ("NVIDIA A40", 149.7e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA L40", 181.05e12),
        ("NVIDIA L40S", 362.05e12),
        ("NVIDIA B200", 2.25e15),
        ("NVIDIA GB200", 2.5e15),
        ("AMD Instinct MI300X", 1307.4e12),
    ],
)
def test_known_devices_have_their_own_dense_bf16_peak(name, expected):
    assert peak_flops_for_name(name, BF16, allow_tf32=False) == expected


@pytest.mark.parametrize(
    "name",
    ["NVIDIA GeForce RTX 4090", "Tesla V100-SXM2-16GB", "NVIDIA H100 80GB HBM3 MIG 3g.40gb", "", "Intel Arc"],
)
def test_unknown_devices_and_mig_slices_have_no_peak(name):
    assert peak_flops_for_name(name, BF16, allow_tf32=True) is None


def test_fp16_uses_the_half_precision_tensor_peak():
    assert peak_flops_for_name("NVIDIA A100-SXM4-40GB", torch.float16, allow_tf32=False) == 312e12


def test_fp32_uses_tf32_only_when_allowed():
    assert peak_flops_for_name("NVIDIA H100 80GB HBM3", torch.float32, allow_tf32=True) == 494.7e12
    assert peak_flops_for_name("NVIDIA H100 80GB HBM3", torch.float32, allow_tf32=False) == 67e12
    assert peak_flops_for_name("NVIDIA A100-SXM4-80GB", torch.float32, allow_tf32=False) == 19.5e12


def test_amd_fp32_ignores_the_cuda_tf32_flag():
    assert peak_flops_for_name("AMD Instinct MI300X", torch.float32, allow_tf32=True) == 163.4e12


def test_dtypes_without_a_listed_peak_give_none():
    assert peak_flops_for_name("NVIDIA H100 80GB HBM3", torch.float64, allow_tf32=True) is None


def test_cpu_has_no_peak():
    assert device_peak_flops(torch.device("cpu"), BF16) is None
    assert device_peak_flops(torch.device("cpu"), torch.float32) is None


def test_tf32_flag_follows_float32_matmul_precision():
    saved = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert tf32_matmul_enabled()
        torch.set_float32_matmul_precision("highest")
        assert not tf32_matmul_enabled()
    finally:
        torch.set_float32_matmul_precision(saved)


def test_tf32_flag_falls_back_to_fp32_precision_when_legacy_flag_refuses(monkeypatch):
    class MixedApiMatmul:
        fp32_precision = "tf32"

        @property
        def allow_tf32(self):
            raise RuntimeError("mix of the legacy and new APIs")

    monkeypatch.setattr(device_peaks.torch.backends.cuda, "matmul", MixedApiMatmul())
    assert tf32_matmul_enabled()
    monkeypatch.setattr(device_peaks.torch.backends.cuda, "matmul", types.SimpleNamespace(allow_tf32=False))
    assert not tf32_matmul_enabled()


@pytest.mark.cuda
def test_current_gpu_peak_matches_the_table():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device)
    assert device_peak_flops(device, BF16) == peak_flops_for_name(name, BF16, allow_tf32=False)
