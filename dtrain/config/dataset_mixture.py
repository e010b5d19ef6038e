"""`training.dataset_mixture`: its entries read and checked, and how many places of each block of the global
order its weights give each source (dtrain/data/mixture.py lays the places out).

Here, in the config, so that the config is checked before anything runs without importing the data pipeline.
Entries are `[kind, weight]` or `[kind, path, weight]`, e.g. `[["tokens", "/data/web", "0.7"], ["files",
"/data/code", "0.3"]]`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dtrain.config.schema import DATASET_KINDS
from dtrain.errors import ConfigError

# Samples per block of the global order: the proportions are exact to 1/BLOCK over every block.
BLOCK = 10_000
# What a mixture may mix, and what validation may read: every kind of training.dataset but a mixture.
MIXABLE_KINDS = tuple(kind for kind in DATASET_KINDS if kind != "mixture")
KEY = "training.dataset_mixture"


@dataclass(frozen=True)
class MixtureEntry:
    kind: str
    path: str
    weight: float


def parse_mixture(entries: list[list[str]], kinds: tuple[str, ...]) -> list[MixtureEntry]:
    """The entries of `training.dataset_mixture`; ConfigError naming the entry when one is malformed."""
    if not entries:
        raise ConfigError(f"training.dataset = 'mixture' needs {KEY}: a list of [kind, weight] or [kind, path, weight]")
    parsed = []
    for index, entry in enumerate(entries):
        where = f"{KEY} entry {index} {entry!r}"
        if len(entry) not in (2, 3):
            raise ConfigError(f"{where}: give [kind, weight] or [kind, path, weight]")
        kind, path, weight_text = (entry[0], "", entry[1]) if len(entry) == 2 else tuple(entry)
        if kind not in kinds:
            raise ConfigError(f"{where}: kind {kind!r} is not one of {', '.join(kinds)}")
        try:
            weight = float(weight_text)
        except ValueError:
            raise ConfigError(f"{where}: weight {weight_text!r} is not a number") from None
        if not weight > 0 or weight == float("inf"):
            raise ConfigError(f"{where}: weight must be a positive finite number, got {weight_text}")
        parsed.append(MixtureEntry(kind, path, weight))
    block_counts([entry.weight for entry in parsed])
    return parsed


def block_counts(weights: list[float]) -> np.ndarray:
    """Samples of each source per block: the weights' shares of BLOCK, rounded by largest remainder."""
    shares = np.asarray(weights, dtype=np.float64) / sum(weights) * BLOCK
    counts = np.floor(shares).astype(np.int64)
    remainders = shares - counts
    counts[np.argsort(-remainders, kind="stable")[: BLOCK - int(counts.sum())]] += 1
    if (counts == 0).any():
        small = int(np.flatnonzero(counts == 0)[0])
        raise ConfigError(
            f"{KEY} entry {small}: its weight is below 1/{BLOCK} of the total, too small to mix in; raise it or drop it"
        )
    return counts
