"""The step's loss for preference pairs: what the executor calls in place of the token cross-entropy.

A batch holds 2B sequences, the B chosen answers then the B rejected ones (data/preference_samples.py). The loss of
a microbatch is the sum of its pairs' losses (losses.py), and the step divides by the pairs of the global batch
(`count`), so the loss and the gradient are the mean over pairs whatever the layout, as TRL's are. The
reference's log-probabilities are computed with the target (`target`), before the policy's forward.

The metrics TRL logs (rewards/*, logps/*, logits/*) are summed here over the step's microbatches and reduced over
the data-parallel ranks by the step, through the loss's `sources`, the three calls it makes for a mixture's
per-source loss (step/source_loss.py): rewards and logps are means over pairs, logits/* the mean logit over the
answers' tokens (as TRL's DPOTrainer averages them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from dtrain.config.preference import Preference
from dtrain.preference.losses import Scores, pair_losses
from dtrain.step.labels import IGNORE_INDEX

Microbatch = dict[str, torch.Tensor]
# The sums kept per step, in this order: means over pairs, then the answers' logits over their tokens.
PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected")
TOKEN_METRICS = ("logits/chosen", "logits/rejected")


class Reference(Protocol):
    def logps(self, microbatch: Microbatch) -> torch.Tensor:
        """The reference's summed log-probability of each sequence's answer, [2B], without gradients."""


def answer_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's summed log-probability of its answer tokens (labels not IGNORE_INDEX), in fp32, and their
    number."""
    nll = F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), reduction="none", ignore_index=IGNORE_INDEX
    ).view(labels.shape)
    return -nll.sum(-1), (labels != IGNORE_INDEX).sum(-1)


@dataclass(frozen=True)
class PairTarget:
    """What the loss gets for a microbatch: its labels and the reference's log-probabilities (None: none)."""

    labels: torch.Tensor
    reference: torch.Tensor | None


class PairMetrics:
    """The step's TRL metrics, summed over its microbatches (per-step scratch, never saved)."""

    def __init__(self):
        self._sums: torch.Tensor | None = None

    def add(self, sums: torch.Tensor) -> None:
        self._sums = sums if self._sums is None else self._sums + sums

    def take(self, device: torch.device) -> torch.Tensor:
        sums, self._sums = self._sums, None
        return sums if sums is not None else torch.zeros(len(PAIR_METRICS) + 2 * len(TOKEN_METRICS), device=device)

    @staticmethod
    def tokens(microbatches: list[Microbatch]) -> torch.Tensor:
        """This rank's pairs in `microbatches` (what the pair means divide by)."""
        return sum(pair_count(mb) for mb in microbatches)

    @staticmethod
    def step_metrics(
        sums: torch.Tensor, pairs: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        totals = reduce(torch.cat([sums.double(), pairs.double().view(1)]))
        per_pair = len(PAIR_METRICS)
        metrics = {name: totals[i] / totals[-1] for i, name in enumerate(PAIR_METRICS)}
        for i, name in enumerate(TOKEN_METRICS):
            metrics[name] = totals[per_pair + i] / totals[per_pair + len(TOKEN_METRICS) + i]
        return metrics


def pair_count(microbatch: Microbatch) -> torch.Tensor:
    labels = microbatch["labels"]
    return torch.tensor(labels.shape[0] // 2, device=labels.device)


class PreferenceLoss:
    """The executor's loss (step/executor.py's `Loss`) for pairs: `settings` names the loss, `reference` gives the
    reference's log-probabilities (None for a reference-free loss)."""

    def __init__(self, settings: Preference, reference: Reference | None):
        self.settings, self.reference = settings, reference
        self.sources = PairMetrics()  # the step reports a loss's own metrics through `sources` (module doc)

    @staticmethod
    def count(microbatch: Microbatch) -> torch.Tensor:
        return pair_count(microbatch)

    def target(self, microbatch: Microbatch) -> PairTarget:
        reference = self.reference.logps(microbatch) if self.reference is not None else None
        return PairTarget(microbatch["labels"], reference)

    def context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def __call__(self, output: torch.Tensor, target: PairTarget) -> torch.Tensor:
        logps, tokens = answer_logps(output, target.labels)
        chosen, rejected = logps.chunk(2)
        chosen_tokens, rejected_tokens = tokens.chunk(2)
        references = target.reference.chunk(2) if target.reference is not None else (None, None)
        result = pair_losses(Scores(chosen, rejected, chosen_tokens, rejected_tokens, *references), self.settings)
        with torch.no_grad():
            answer = (target.labels != IGNORE_INDEX).float()
            logit_sums = (output.float().mean(-1) * answer).sum(-1).chunk(2)
            self.sources.add(torch.stack([
                result.chosen_reward.sum(), result.rejected_reward.sum(),
                (result.chosen_reward > result.rejected_reward).float().sum(),
                (result.chosen_reward - result.rejected_reward).sum(),
                result.chosen_logps.detach().sum(), result.rejected_logps.detach().sum(),
                logit_sums[0].sum(), logit_sums[1].sum(), chosen_tokens.sum().float(), rejected_tokens.sum().float(),
            ]))
        return result.loss.sum()
