"""Weighted mixtures: which source each sample of the global order comes from.

Every block of BLOCK samples has the same pattern, each source's places (config/dataset_mixture.py counts them)
spread evenly through it by stride scheduling, so the interleave is a function of the sample index alone: the
same on every rank and after a resume with another number of ranks (docs/data.md, "Mixtures").
"""

from __future__ import annotations

import numpy as np

from dtrain.config.dataset_mixture import BLOCK, block_counts


class Interleave:
    """The source of every sample index of the global order, for sources weighted by `weights`."""

    def __init__(self, weights: list[float]):
        self.counts = block_counts(weights)
        # Stride scheduling: sample j of source s at time (j + 0.5) / count_s; ties go to the lower source index.
        times = np.concatenate([(np.arange(n) + 0.5) / n for n in self.counts])
        owners = np.repeat(np.arange(len(self.counts)), self.counts)
        self.pattern = owners[np.lexsort((owners, times))]

    def sources(self, start: int, count: int) -> np.ndarray:
        """The source index of global samples [start, start + count)."""
        return self.pattern[(start + np.arange(count, dtype=np.int64)) % BLOCK]
