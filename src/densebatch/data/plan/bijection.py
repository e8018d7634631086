"""Seeded pseudo-random permutations of [0, n), evaluated at any index without a stored table.

Sharded planning and mixture sampling need "a shuffled order of n items" for n up to billions,
where a materialised ``rng.permutation(n)`` costs 8 bytes per item and a cache miss per element
(Fisher-Yates swaps at random addresses). A ``Bijection`` instead computes the k-th element of a
seeded permutation from k alone: a balanced Feistel network on 2h bits (4^h >= n, so fewer than
four values per valid one) with cycle walking, i.e. values that land outside [0, n) are encrypted
again until they fall inside, which keeps the map a bijection of [0, n). Its state is a few keys.
"""

from __future__ import annotations

import numpy as np

_ROUNDS = 4
_CHUNK = 1 << 16  # evaluate in cache-sized pieces: the temporaries of every round stay in L2
_A = np.uint64(0x9E3779B97F4A7C15)  # odd multipliers of a 64-bit mixing function (splitmix64's)
_B = np.uint64(0xBF58476D1CE4E5B9)


class Bijection:
    """``f(j)``: position j of a pseudo-random permutation of [0, n) fixed by ``key`` (ints)."""

    def __init__(self, n: int, key) -> None:
        self.n = int(n)
        if self.n < 0:
            raise ValueError(f"n: expected a non-negative size; got {n}")
        h = max(1, (max(0, self.n - 1).bit_length() + 1) // 2)  # half width: 4^h >= n
        self._h, self._mask, self._shift = np.uint64(h), np.uint64((1 << h) - 1), np.uint64(64 - h)
        ss = np.random.SeedSequence([int(k) % 2**63 for k in key])
        self._keys = [np.uint64(k) for k in ss.generate_state(_ROUNDS, np.uint64)]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._h, x & self._mask
        for k in self._keys:
            f = (right ^ k) * _A
            f ^= f >> np.uint64(32)
            f *= _B
            left, right = right, left ^ (f >> self._shift)  # top h bits of the mix: depend on every input bit
        return (left << self._h) | right

    def _walk(self, j: np.ndarray) -> np.ndarray:
        x = self._encrypt(j)
        n = np.uint64(self.n)
        out = np.flatnonzero(x >= n)
        while len(out):  # cycle walking: each pass leaves < 3/4 of the previous pass out of range
            y = self._encrypt(x[out])
            x[out] = y
            out = out[y >= n]
        return x

    def __call__(self, j) -> np.ndarray:
        """Images of indices ``j`` (each in [0, n)) as int64, in the order given."""
        j = np.asarray(j, dtype=np.int64)
        if self.n <= 1 or j.size == 0:
            return j.copy()
        flat = j.reshape(-1).astype(np.uint64)
        out = np.empty(flat.shape, np.int64)
        for a in range(0, len(flat), _CHUNK):
            out[a : a + _CHUNK] = self._walk(flat[a : a + _CHUNK])
        return out.reshape(j.shape)

    def arange(self, start: int, stop: int) -> np.ndarray:
        """Images of ``start .. stop - 1``: a slice of the permuted order."""
        return self(np.arange(start, stop, dtype=np.int64))
