"""The orders MindSpore's samplers give, reproduced: dp sharding and MindDataset's global shuffle.

Measured against MindSpore 2.7 (tests/fixtures/mindrecord, tests/fixtures/gptdataset):
  - num_shards=n, shard_id=k: positions k, k+n, ... of the (shuffled) order, ceil(N/n) of them, wrapping around.
  - MindDataset shuffle (ADAPTIVE / GLOBAL below a million rows): ShardShuffle, std::shuffle with
    std::default_random_engine (libstdc++'s minstd_rand0) seeded with seed+1+epoch. Without sharding the permutation
    carries over from epoch to epoch (epoch e shuffles epoch e-1's order); with sharding each epoch shuffles 0..N-1.
"""
from __future__ import annotations

from typing import List

import numpy as np

_M = 2147483647  # minstd_rand0: x <- 16807 x mod (2^31 - 1), values in [1, 2^31 - 2]
_RANGE = _M - 3  # urng.max() - urng.min()


class _MinstdRand0:
    def __init__(self, seed: int):
        self.x = seed % _M or 1

    def __call__(self) -> int:
        self.x = (self.x * 16807) % _M
        return self.x


def _uniform(g: _MinstdRand0, hi: int) -> int:
    """libstdc++ uniform_int_distribution(0, hi) on a generator narrower than 32 bits: scale down, reject the tail."""
    erange = hi + 1
    scaling = _RANGE // erange
    past = erange * scaling
    while True:
        r = g() - 1
        if r < past:
            return r // scaling


def std_shuffle(perm: List[int], seed: int) -> List[int]:
    """std::shuffle(perm, std::default_random_engine(seed)) as libstdc++ does it (two swaps per draw when n^2 fits)."""
    g, n = _MinstdRand0(seed), len(perm)
    if n < 2:
        return perm
    if _RANGE // n >= n:
        i = 1
        if n % 2 == 0:
            j = _uniform(g, 1)
            perm[i], perm[j] = perm[j], perm[i]
            i += 1
        while i != n:
            r = i + 1
            x = _uniform(g, r * (r + 1) - 1)
            a, b = divmod(x, r + 1)
            perm[i], perm[a] = perm[a], perm[i]
            perm[i + 1], perm[b] = perm[b], perm[i + 1]
            i += 2
        return perm
    for i in range(1, n):
        j = _uniform(g, i)
        perm[i], perm[j] = perm[j], perm[i]
    return perm


def minddataset_order(n_rows: int, epoch: int, seed: int, shuffle: bool, sharded: bool) -> np.ndarray:
    """MindDataset's row order for one epoch before the dp split."""
    perm = list(range(n_rows))
    if not shuffle:
        return np.asarray(perm, dtype=np.int64)
    for e in range(0 if not sharded else epoch, epoch + 1):
        perm = std_shuffle(perm if not sharded else list(range(n_rows)), seed + 1 + e)
    return np.asarray(perm, dtype=np.int64)


def dp_positions(n_rows: int, dp_rank: int, dp_size: int) -> np.ndarray:
    """The positions MindSpore's distributed sampler gives shard dp_rank of dp_size (wrap-around padding)."""
    per = -(-n_rows // dp_size)
    return (dp_rank + dp_size * np.arange(per, dtype=np.int64)) % n_rows
