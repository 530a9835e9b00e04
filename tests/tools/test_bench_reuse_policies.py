"""bench/reuse_policies.py (the reuse-distance-aware policies bench/cache.py --dram --reuse
compares), on small traces: none beats Belady's optimum, each keeps every row when all fit
(every read but the first hits), and LIRS keeps a loop one row longer than the cache (where
LRU hits nothing)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

from bench import cache as bench_cache
from bench import reuse_policies

POLICIES = sorted(reuse_policies.POLICIES)


def trace(steps: list[list[int]], rows: int) -> bench_cache.Trace:
    return bench_cache.Trace([torch.tensor(s, dtype=torch.int64) for s in steps], rows)


def skewed(seed: int, steps: int = 60, per_step: int = 30, rows: int = 400) -> bench_cache.Trace:
    rng = np.random.default_rng(seed)
    return trace([(rng.zipf(1.3, per_step) % rows).tolist() for _ in range(steps)], rows)


def uniform(seed: int, rows: int, steps: int = 200, per_step: int = 3) -> bench_cache.Trace:
    """Few rows, each read often: most misses meet a row a ghost list remembers."""
    rng = np.random.default_rng(seed)
    return trace([rng.integers(0, rows, per_step).tolist() for _ in range(steps)], rows)


@pytest.mark.parametrize("name", POLICIES)
def test_no_policy_beats_the_optimum_and_all_keep_what_fits(name):
    policy = reuse_policies.POLICIES[name]
    for seed in range(4):
        t = skewed(seed)
        for capacity in (5, 20, 60):
            assert 0 <= policy(t, capacity) <= bench_cache.belady(t, capacity), (seed, capacity)
        assert policy(t, t.distinct() + 5) == t.fetches - t.distinct()
        for capacity in (2, 4, 8):
            t = uniform(seed, 3 * capacity)
            assert 0 <= policy(t, capacity) <= bench_cache.belady(t, capacity), (seed, capacity)


def test_lirs_keeps_a_loop_that_lru_thrashes():
    capacity, passes = 100, 10
    t = trace([[i] for _ in range(passes) for i in range(capacity + 1)], 200)
    assert bench_cache.lru(t, capacity) == 0
    assert reuse_policies.lirs(t, capacity) >= (passes - 2) * (capacity - 5)
