"""bench/shard_balance.py's pieces, in-process and small: each rank's distinct rows are counted
from its own ranges, and on ids shaped like text (low orders repeat, high orders do not) the
contiguous split is skewed and the balanced one even."""

from __future__ import annotations

import numpy as np

from engram_sglang.core.hashing import EngramLayout
from tests.support.tables import small_config

LAYOUT = EngramLayout(small_config(300))  # 3 orders x 4 heads = 12 columns a layer


def _bench():
    from bench import shard_balance

    return shard_balance


def test_distinct_rows_are_counted_per_rank_range():
    bench = _bench()
    uniq = np.array([0, 3, 9, 10, 15, 29])
    assert bench.distinct_per_rank(uniq, [[(0, 10)], [(10, 20), (29, 30)], [(20, 29)]]).tolist() == [3, 3, 0]


def test_text_shaped_ids_skew_contiguous_not_balanced():
    bench = _bench()
    bounds = LAYOUT.column_bounds(0)
    gen = np.random.default_rng(7)
    # Column c of order o (c // 4) draws from 8 ** (o + 1) distinct values: 2-grams repeat most.
    ids = np.stack([bounds[c] + gen.integers(0, min(8 ** (c // 4 + 1), bounds[c + 1] - bounds[c]), 4096)
                    for c in range(12)], axis=1)
    assert [s.shape[0] for s in bench.steps_of(np.zeros((2 * bench.PREFILL_CHUNK + 5, 12)), "prefill", 0)] == \
        [bench.PREFILL_CHUNK] * 2
    steps = bench.steps_of(ids, "decode", 8)
    assert len(steps) == 8 and steps[0].shape == (bench.DECODE_BATCH, 12)
    uniqs = [np.unique(s) for s in steps]
    for tp in (2, 4):
        got = {split: sum(bench.distinct_per_rank(u, r) for u in uniqs)
               for split, r in bench.rank_ranges(bounds, tp).items()}
        assert sum(got["contiguous"]) == sum(got["balanced"])  # the same rows, split otherwise
        assert got["contiguous"].max() / got["contiguous"].mean() > 1.3
        assert got["balanced"].max() / got["balanced"].mean() < 1.05
