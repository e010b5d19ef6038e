"""[training.preference]: preference tuning (DPO and its family) on pairs of a chosen and a rejected answer.

`training.dataset = "preference"` reads the pairs (data/preference_rows.py) and trains with the loss named here
(dtrain/preference/). The names follow TRL's DPOConfig and CPOConfig (beta, label_smoothing, simpo_gamma, the SFT
weight as RPO's alpha), so a TRL recipe's numbers carry over; docs/preference-tuning.md says where the two differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dtrain.config.options import opt
from dtrain.errors import ConfigError

if TYPE_CHECKING:
    from dtrain.config.schema import JobConfig

LOSSES = ("sigmoid", "ipo", "simpo", "orpo")
# The losses that compare with a reference model; simpo and orpo are reference-free.
REFERENCE_LOSSES = ("sigmoid", "ipo")


@dataclass
class Preference:
    loss: str = opt(
        "sigmoid",
        "sigmoid (DPO), ipo, simpo or orpo (the last two need no reference model).",
        choices=LOSSES,
    )
    beta: float = opt(
        0.1, "The loss's temperature (> 0); for ipo its regularization tau, for orpo the odds ratio's weight."
    )
    label_smoothing: float = opt(
        0.0, "sigmoid and simpo: the probability that a pair's labels are flipped (conservative DPO), in [0, 0.5).",
        minimum=0.0,
    )
    sft_weight: float = opt(
        0.0, "Weight of an SFT term on the chosen answer (RPO's alpha): its mean token NLL, per pair.", minimum=0.0
    )
    simpo_gamma: float = opt(0.5, "simpo: the target reward margin gamma (TRL's simpo_gamma).", minimum=0.0)
    reference: str = opt(
        "copy",
        "The reference model of sigmoid and ipo: copy (a frozen copy of the starting weights, sharded like the "
        "policy) or adapters (a LoRA run's base with its adapters disabled: no second copy).",
        choices=("copy", "adapters"),
    )
    overlong_policy: str = opt(
        "truncate",
        "A pair whose prompt + answer is longer than seq_len + 1 tokens: truncate keeps its start (TRL's "
        "max_length with keep_start; a pair whose prompt alone fills it is dropped), drop drops the pair.",
        choices=("truncate", "drop"),
    )
    max_prompt_length: int = opt(
        0, "Keep only the last this many tokens of a longer prompt (0: no limit), before overlong_policy.", minimum=0
    )
    prompt_field: str = opt("prompt", "The field of a row holding its prompt (text or messages); absent: implicit.")
    chosen_field: str = opt("chosen", "The field of a row holding the chosen answer (text or messages).")
    rejected_field: str = opt("rejected", "The field of a row holding the rejected answer (text or messages).")


def check_preference(cfg: JobConfig) -> None:
    """One line for a preference setting that cannot train, before anything is written."""
    p, training = cfg.training.preference, cfg.training
    if training.dataset == "mixture" and any(entry[0] == "preference" for entry in training.dataset_mixture):
        raise ConfigError(
            "training.dataset_mixture cannot hold preference data (its rows are pairs, not sequences); set "
            "training.dataset = preference"
        )
    if training.dataset != "preference":
        return
    if p.beta <= 0:
        raise ConfigError(f"training.preference.beta must be > 0; got {p.beta:g}")
    if p.label_smoothing >= 0.5:
        raise ConfigError(f"training.preference.label_smoothing must be in [0, 0.5); got {p.label_smoothing:g}")
    if p.loss in REFERENCE_LOSSES and p.reference == "adapters" and not cfg.lora.enable:
        raise ConfigError(
            "training.preference.reference = adapters needs lora.enable = true (the reference is the base with the "
            "adapters disabled); set reference = copy for a full fine-tuning run"
        )
    if p.loss in REFERENCE_LOSSES and p.reference == "copy" and cfg.checkpoint.enable:
        raise ConfigError(
            "training.preference.reference = copy cannot be restored on a resume yet, so checkpoint.enable is "
            "refused with it; use LoRA with reference = adapters, or checkpoint.enable = false"
        )
    par = cfg.parallelism
    unsupported = {
        "parallelism.pipeline_parallel_degree": par.pipeline_parallel_degree,
        "parallelism.context_parallel_degree": par.context_parallel_degree,
        "parallelism.tensor_parallel_degree": par.tensor_parallel_degree,
    }
    for key, degree in unsupported.items():
        if degree > 1:
            raise ConfigError(f"training.dataset = preference runs on FSDP2/HSDP/DDP layouts; {key} must be 1")
    if cfg.validation.enable:
        raise ConfigError("validation on preference data is not built yet; set validation.enable = false")
