"""Weighted mixtures: which source each sample of the global order comes from.

Every block of BLOCK samples has the same pattern, each source's places (config/dataset_mixture.py counts them)
spread evenly through it by stride scheduling, so the interleave is a function of the sample index alone: the
same on every rank and after a resume with another number of ranks (docs/data.md, "Mixtures").

Each source also has a name, under which its loss and tokens are logged (`loss/<name>`, dtrain/step/source_loss.py).
"""

from __future__ import annotations

import re
from pathlib import PurePath

import numpy as np

from dtrain.config.dataset_mixture import BLOCK, MixtureEntry, block_counts


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

    def samples_before(self, count: int) -> np.ndarray:
        """How many of global samples [0, count) each source holds: whole blocks, then the head of the pattern."""
        whole, rest = divmod(count, BLOCK)
        return whole * self.counts + np.bincount(self.pattern[:rest], minlength=len(self.counts))


def source_names(entries: list[MixtureEntry]) -> list[str]:
    """A short name for each source of a mixture: its path's last part without extension (`/data/web` -> `web`),
    else its kind; characters other than letters, digits, `_`, `-` and `.` become `_` (a TensorBoard tag's `/`
    would nest it); a name already taken gets the entry's index (`builtin`, `builtin_2`)."""
    names: list[str] = []
    for index, entry in enumerate(entries):
        name = re.sub(r"[^\w.-]", "_", PurePath(entry.path.rstrip("/\\")).stem or entry.kind)
        names.append(f"{name}_{index}" if name in names else name)
    return names
