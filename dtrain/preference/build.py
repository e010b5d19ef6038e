"""The preference loss of a run (`training.dataset = preference`), with its reference model, built once as the
trainer builds its state (run/build_state.py takes it as the run's loss)."""

from __future__ import annotations

import logging

import torch

from dtrain.config.preference import REFERENCE_LOSSES
from dtrain.config.schema import JobConfig
from dtrain.models.decoder import DecoderArgs
from dtrain.parallelize import FamilySpec
from dtrain.parallelize.pipeline_split import StageModule
from dtrain.preference.loss import PreferenceLoss, Reference
from dtrain.preference.reference import AdaptersOff, FrozenCopy
from dtrain.run.layout import ParallelLayout
from dtrain.run.memory_preflight import Workload
from dtrain.run.model_builder import build_model_parts

logger = logging.getLogger("dtrain")


def build_preference_loss(
    cfg: JobConfig, layout: ParallelLayout, family: FamilySpec, args: DecoderArgs, stages: list[StageModule],
    device: torch.device, workload: Workload,
) -> PreferenceLoss:
    """The loss `training.preference` names; a reference model for the losses that compare with one: a frozen copy
    built like the policy's parts, or the policy with its LoRA adapters disabled."""
    settings = cfg.training.preference
    policy = [stage.module for stage in stages]
    reference: Reference | None = None
    if settings.loss not in REFERENCE_LOSSES:
        how = "no reference model (reference-free)"
    elif settings.reference == "adapters":
        reference, how = AdaptersOff(policy), "the reference is the base with the LoRA adapters disabled"
    else:
        copy = build_model_parts(family, args, layout, device, seed=cfg.debug.seed, workload=workload)
        reference = FrozenCopy([stage.module for stage in copy], policy)
        how = "the reference is a frozen copy of the starting weights, sharded like the policy"
    extra = f", label_smoothing {settings.label_smoothing:g}" if settings.label_smoothing else ""
    extra += f", SFT weight {settings.sft_weight:g}" if settings.sft_weight else ""
    logger.info("preference loss %s, beta %g%s; %s", settings.loss, settings.beta, extra, how)
    return PreferenceLoss(settings, reference)
