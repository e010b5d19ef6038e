"""A seeded permutation of [0, n) evaluated index by index, in O(1) memory: each epoch's sample order.

A shuffled array of n indices would cost every rank 8·n bytes and O(n) time per epoch (a billion-sample dataset:
8 GB per rank), and each rank needs only its own few samples' places. So the order is a keyed bijection computed
on demand: a Feistel network over the smallest even number of bits that covers n (a bijection of [0, 4^h)), with
cycle walking (apply it again while the result is >= n), which makes it a bijection of [0, n). The domain is
below 4n, so an index takes fewer than four applications on average.
"""

from __future__ import annotations

import numpy as np

from dtrain.step.rng import derive_seed

ROUNDS = 6
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a well-spread 64-bit hash of each element (uint64 arithmetic wraps)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class Permutation:
    """A bijection of [0, n) determined by `keys` (e.g. the seed and the epoch): `self[indices]`."""

    def __init__(self, n: int, *keys: object):
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = n
        self._half_bits = max(1, ((n - 1).bit_length() + 1) // 2)
        self._half_mask = np.uint64((1 << self._half_bits) - 1)
        self._round_keys = [np.uint64(derive_seed(0, "permutation", *keys, r)) for r in range(ROUNDS)]

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        bits = np.uint64(self._half_bits)
        left, right = x >> bits, x & self._half_mask
        for key in self._round_keys:
            left, right = right, left ^ (_mix64(right ^ key) & self._half_mask)
        return (left << bits) | right

    def __getitem__(self, indices: np.ndarray | int) -> np.ndarray:
        """The images of `indices` (each in [0, n)), as int64."""
        given = np.asarray(indices, dtype=np.uint64)
        x = given.reshape(-1)
        if x.size and int(x.max()) >= self.n:
            raise IndexError(f"index {int(x.max())} is outside [0, {self.n})")
        with np.errstate(over="ignore"):
            y = self._feistel(x)
            outside = y >= self.n
            while outside.any():  # cycle walking: a bijection of the domain restricted to [0, n) stays one
                y[outside] = self._feistel(y[outside])
                outside = y >= self.n
        return y.astype(np.int64).reshape(given.shape)
