"""The preference losses of one batch of pairs, from the answers' log-probabilities, with the rewards TRL logs.

Each loss takes `Scores` (the policy's and, for the losses that compare with one, the reference's log-probability
of each answer, summed over its tokens, and the answers' token counts) and returns per pair its loss, the chosen
and rejected rewards and the log-probabilities reported as logps/*:
- sigmoid (DPO): -(1 - eps) log sigmoid(beta d) - eps log sigmoid(-beta d), d the difference of the answers'
  log-ratios to the reference (eps = label_smoothing: conservative DPO); rewards beta * log-ratio (TRL's DPOTrainer);
- ipo: (d_c / n_c - d_r / n_r - 1 / (2 beta))^2, the log-ratios averaged over the answers' tokens (TRL's IPO);
- simpo: the answers' mean token log-probabilities a, -(1 - eps) log sigmoid(beta (a_c - a_r) - gamma) - eps ...,
  rewards beta * a, logps a (TRL's CPOTrainer with loss_type = simpo);
- orpo: -a_c - beta log sigmoid(log odds(a_c) - log odds(a_r)), rewards beta * a, logps a (TRL's ORPOTrainer, its
  NLL taken per pair).
`sft_weight` adds RPO's term, the chosen answer's mean token NLL, to every loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dtrain.config.preference import Preference


@dataclass(frozen=True)
class Scores:
    """Per pair: the policy's summed log-probabilities of the answers, the reference's (None: reference-free) and
    the answers' token counts."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    reference_chosen: torch.Tensor | None = None
    reference_rejected: torch.Tensor | None = None

    @property
    def chosen_mean(self) -> torch.Tensor:
        return self.chosen / self.chosen_tokens.clamp(min=1)

    @property
    def rejected_mean(self) -> torch.Tensor:
        return self.rejected / self.rejected_tokens.clamp(min=1)


@dataclass(frozen=True)
class PairLosses:
    """Per pair: the loss, the rewards of both answers, and their log-probabilities as logps/* reports them."""

    loss: torch.Tensor
    chosen_reward: torch.Tensor
    rejected_reward: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor


def _smoothed(logits: torch.Tensor, eps: float) -> torch.Tensor:
    return -(1 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits)


def sigmoid(s: Scores, p: Preference) -> PairLosses:
    chosen, rejected = s.chosen - s.reference_chosen, s.rejected - s.reference_rejected
    loss = _smoothed(p.beta * (chosen - rejected), p.label_smoothing)
    return PairLosses(loss, p.beta * chosen.detach(), p.beta * rejected.detach(), s.chosen, s.rejected)


def ipo(s: Scores, p: Preference) -> PairLosses:
    chosen, rejected = s.chosen - s.reference_chosen, s.rejected - s.reference_rejected
    per_token = chosen / s.chosen_tokens.clamp(min=1) - rejected / s.rejected_tokens.clamp(min=1)
    loss = (per_token - 1 / (2 * p.beta)) ** 2
    return PairLosses(loss, p.beta * chosen.detach(), p.beta * rejected.detach(), s.chosen, s.rejected)


def simpo(s: Scores, p: Preference) -> PairLosses:
    chosen, rejected = s.chosen_mean, s.rejected_mean
    loss = _smoothed(p.beta * (chosen - rejected - p.simpo_gamma / p.beta), p.label_smoothing)
    return PairLosses(loss, p.beta * chosen.detach(), p.beta * rejected.detach(), chosen, rejected)


def orpo(s: Scores, p: Preference) -> PairLosses:
    chosen, rejected = s.chosen_mean, s.rejected_mean
    log_odds = (chosen - rejected) - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
    loss = -chosen - p.beta * F.logsigmoid(log_odds)
    return PairLosses(loss, p.beta * chosen.detach(), p.beta * rejected.detach(), chosen, rejected)


LOSS_FUNCTIONS: dict[str, Callable[[Scores, Preference], PairLosses]] = {
    "sigmoid": sigmoid, "ipo": ipo, "simpo": simpo, "orpo": orpo,
}


def pair_losses(s: Scores, p: Preference) -> PairLosses:
    """The loss `p.loss` of each pair, with RPO's SFT term when `p.sft_weight` is set."""
    result = LOSS_FUNCTIONS[p.loss](s, p)
    if not p.sft_weight:
        return result
    loss = result.loss - p.sft_weight * s.chosen_mean
    return PairLosses(loss, result.chosen_reward, result.rejected_reward, result.chosen_logps, result.rejected_logps)
