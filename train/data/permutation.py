"""Seeded permutations of [0, n) that need no memory: for sample orders at corpus scale.

A materialised permutation costs 8 bytes per sample per rank (torch.randperm, int64): 312 MB
for the 39M sequences of 128 tokens in a 10 GB uint16 corpus, 31 GB for a 1 TB one, and a
mixture draws one more per source. FeistelPermutation is a bijection of [0, n) computed per
index instead: a balanced 6-round Feistel network over the smallest even number of bits
covering n (a block cipher on 2^2h >= n values, h = half the bits) with cycle walking (an
image >= n is encrypted again until it lands below n; the domain is < 4n, so < 4 rounds of
walking on average). Rounds mix with splitmix64, keyed from the seed material by numpy's
SeedSequence. Any slice of the order is then O(slice) time and memory, on every rank alike.

Orders of at most SMALL samples stay materialised by the callers (torch.randperm in the
sampler, numpy's permutation in a mixture) so every existing run's data order is unchanged;
above it the Feistel order is used. Both are pure functions of (seed, epoch[, source, cycle]).
"""

from __future__ import annotations

import numpy as np

SMALL = 1 << 22  # 4M samples: a 32 MiB int64 order; above it, FeistelPermutation (O(1) memory)
ROUNDS = 6

_M1, _M2, _GOLD = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _mix(x: np.ndarray, key: np.uint64) -> np.ndarray:
    """splitmix64 of x + key (uint64 arithmetic wraps, as the hash intends)."""
    z = (x + key) * _GOLD
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


class FeistelPermutation:
    """perm(idx) for any array of indices in [0, n); see the module docstring."""

    def __init__(self, n: int, seed_material: list[int]):
        if n < 1:
            raise ValueError(f"a permutation of {n} items")
        self.n = n
        self.half = max(1, ((n - 1).bit_length() + 1) // 2)
        self.mask = np.uint64((1 << self.half) - 1)
        self.shift = np.uint64(self.half)
        keys = np.random.SeedSequence([int(s) for s in seed_material]).generate_state(ROUNDS, dtype=np.uint64)
        self.keys = [np.uint64(k) for k in keys]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.shift, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix(right, k) & self.mask)
        return (left << self.shift) | right

    def __call__(self, idx) -> np.ndarray:
        x = np.asarray(idx, dtype=np.uint64).reshape(-1)
        if x.size and int(x.max()) >= self.n:
            raise IndexError(f"index {int(x.max())} outside a permutation of {self.n}")
        y = self._encrypt(x)
        out = y >= self.n
        while out.any():  # cycle walking: a bijection of [0, 2^2h) restricted to [0, n)
            y[out] = self._encrypt(y[out])
            out = y >= self.n
        return y.astype(np.int64)

    def __getitem__(self, k: int) -> int:
        """One index, in plain integers (a per-sample lookup: a 1-element array's per-call overhead
        would dominate it)."""
        if not 0 <= k < self.n:
            raise IndexError(f"index {k} outside a permutation of {self.n}")
        y = self._encrypt_int(int(k))
        while y >= self.n:
            y = self._encrypt_int(y)
        return y

    def _encrypt_int(self, x: int) -> int:
        m64, half, mask = (1 << 64) - 1, self.half, int(self.mask)
        left, right = x >> half, x & mask
        for k in self.keys:
            z = ((right + int(k)) * 0x9E3779B97F4A7C15) & m64
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m64
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m64
            left, right = right, left ^ ((z ^ (z >> 31)) & mask)
        return (left << half) | right
