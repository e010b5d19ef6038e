"""Each source's loss and tokens in a dataset mixture, as tensors inside the step (no host sync).

A mixture's batches carry `source_ids`, the source index of every label (data/dataloader.py). The executor hands
the loss a target of labels and source ids stacked on a last dimension (`target`), the only tensor that reaches the
loss inside a pipeline schedule, which splits it into microbatches like the labels. The loss is then computed per
token once: summed whole it is the step's loss, as without a mixture, and summed by source (detached) it is added
up here over the step's microbatches. The step reduces both sums and the token counts over the data-parallel ranks
with one all-reduce and reports, per source, `loss/<name>` (the mean over its label tokens of the step; NaN when
the step held none of them) and `tokens/<name>` (its label tokens in the step, all ranks).

A run without a mixture builds none of this: its loss is `cross_entropy_sum` as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

SOURCE_IDS = "source_ids"


class SourceLoss:
    """The step's summed loss for a mixture of the sources `names`, with each source's part kept apart.

    `per_token(output, labels)` is the loss of each label (0 where ignored), flattened, a plain tensor; labels
    equal to `ignore_index` count as no token.
    """

    def __init__(
        self, names: Sequence[str], per_token: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], ignore_index: int
    ):
        self.names, self.per_token, self.ignore_index = tuple(names), per_token, ignore_index
        # The per-source loss sums of the microbatches since the last `take`: per-step scratch, never saved.
        self._sums: torch.Tensor | None = None

    @staticmethod
    def target(microbatch: dict[str, torch.Tensor]) -> torch.Tensor:
        """What the loss gets: labels and source ids, stacked as ``[batch, seq, 2]``; only labels (a validation
        batch) when the batch has no source ids."""
        if SOURCE_IDS not in microbatch:
            return microbatch["labels"]
        return torch.stack([microbatch["labels"], microbatch[SOURCE_IDS]], dim=-1)

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The summed loss of `output` against the labels of `target` (see `target`); each source's sum is added up
        apart, detached."""
        labels, sources = target.unbind(-1)
        per_token = self.per_token(output, labels)
        sums = per_token.new_zeros(len(self.names)).index_add_(0, sources.flatten(), per_token.detach())
        self._sums = sums if self._sums is None else self._sums + sums
        return per_token.sum()

    def take(self, device: torch.device) -> torch.Tensor:
        """The per-source loss sums since the last call (zeros on a rank that computed no loss: a pipeline rank
        without the last stage), and start again."""
        sums, self._sums = self._sums, None
        return sums if sums is not None else torch.zeros(len(self.names), device=device)

    def tokens(self, microbatches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """This rank's label tokens of each source in `microbatches`."""
        counts = torch.zeros(len(self.names), dtype=torch.long, device=microbatches[0]["labels"].device)
        for mb in microbatches:
            valid = (mb["labels"] != self.ignore_index).long()
            counts.index_add_(0, mb[SOURCE_IDS].flatten(), valid.flatten())
        return counts

    def step_metrics(
        self, loss_sums: torch.Tensor, tokens: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """`loss/<name>` and `tokens/<name>` of the step from this rank's sums and counts, `reduce` summing them
        over the ranks that hold other tokens (one all-reduce; float64 keeps the counts exact)."""
        totals = reduce(torch.stack([loss_sums.double(), tokens.double()]))
        metrics = {}
        for index, name in enumerate(self.names):
            metrics[f"loss/{name}"] = totals[0, index] / totals[1, index]
            metrics[f"tokens/{name}"] = totals[1, index]
        return metrics
