"""The per-epoch sample order of pre-tokenized datasets: a keyed permutation evaluated index by index."""

from __future__ import annotations

import numpy as np
import pytest

from dtrain.data.shuffle import Permutation


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 15, 16, 17, 255, 256, 1000, 4097, 65537])
def test_it_is_a_permutation_of_range_n(n):
    images = Permutation(n, 7, 0)[np.arange(n)]
    assert images.dtype == np.int64
    assert np.array_equal(np.sort(images), np.arange(n))


def test_the_order_is_the_seeds_and_the_epochs():
    n = 10_000
    everything = np.arange(n)
    first = Permutation(n, 1234, 0)[everything]
    assert np.array_equal(first, Permutation(n, 1234, 0)[everything])  # reproducible
    assert not np.array_equal(first, Permutation(n, 1234, 1)[everything])  # a new order each epoch
    assert not np.array_equal(first, Permutation(n, 99, 0)[everything])  # another seed, another order
    # Index by index as a whole: a rank asking for its few samples gets what the full order holds.
    picks = np.array([0, 17, 9_999, 4_242])
    assert np.array_equal(Permutation(n, 1234, 0)[picks], first[picks])
    assert Permutation(n, 1234, 0)[17] == first[17]


def test_the_order_looks_random():
    n = 100_000
    images = Permutation(n, 3, 0)[np.arange(n)]
    # A uniformly random permutation moves an element by n/3 on average and keeps few in place.
    assert abs(np.abs(images - np.arange(n)).mean() / n - 1 / 3) < 0.01
    assert (images == np.arange(n)).sum() < 10
    # Neighbours end up far apart: consecutive samples of a window's document do not stay together.
    assert np.median(np.abs(np.diff(images))) > n / 10


def test_an_index_outside_is_refused():
    with pytest.raises(IndexError, match="outside"):
        Permutation(10, 0)[np.array([3, 10])]
    with pytest.raises(ValueError, match="n >= 1"):
        Permutation(0, 0)
