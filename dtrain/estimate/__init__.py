"""Planning on paper: per-rank memory, pipeline bubble, communication and step time of a run (scripts/estimate.py)."""

from dtrain.estimate.estimator import Estimate, estimate, format_report
from dtrain.estimate.hardware import Hardware, load_hardware, profile_names

__all__ = ["Estimate", "Hardware", "estimate", "format_report", "load_hardware", "profile_names"]
