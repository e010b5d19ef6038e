"""Planning on paper: per-rank memory, pipeline bubble, communication and step time of a run (scripts/estimate.py),
and, for a layout that does not fit, the changes that make it fit (advice.py)."""

from dtrain.estimate.estimator import Estimate, estimate
from dtrain.estimate.hardware import Hardware, load_hardware, profile_names
from dtrain.estimate.report import format_report

__all__ = ["Estimate", "Hardware", "estimate", "format_report", "load_hardware", "profile_names"]
