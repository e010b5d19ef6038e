"""Preference tuning (DPO, IPO, SimPO, ORPO): the loss of pairs of a chosen and a rejected answer, and the
reference model. Its data is dtrain/data/preference_*.py; docs/preference-tuning.md."""

from dtrain.preference.build import build_preference_loss

__all__ = ["build_preference_loss"]
