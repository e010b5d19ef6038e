"""Training metrics: throughput, TFLOPs and MFU against device peaks, memory, and where they are logged."""

from dtrain.metrics.device_peaks import PeakFlops, device_peak_flops, lookup_peak_flops, peak_flops_for_name
from dtrain.metrics.logger import MetricsLogger, format_duration, read_metric_values, synchronize_device
from dtrain.metrics.logging_setup import setup_logging
from dtrain.metrics.memory import peak_memory_gib

__all__ = [
    "MetricsLogger",
    "PeakFlops",
    "device_peak_flops",
    "format_duration",
    "lookup_peak_flops",
    "peak_flops_for_name",
    "peak_memory_gib",
    "read_metric_values",
    "setup_logging",
    "synchronize_device",
]
