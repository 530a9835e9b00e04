"""bench/attn_dp_rows.py's pieces on tiny inputs: each rank's steps, the rows each scheme
fetches (shard: never more than its shard's rows of all ranks' ids, every such row once per
node; whole: a row two ranks need counted twice), the replay through the store's DRAM cache,
and the read and exchange times."""

from __future__ import annotations

import numpy as np
import pytest

from engram_sglang.core.hashing import EngramLayout
from tests.support.tables import small_config

LAYOUT = EngramLayout(small_config(300))  # 3 orders x 4 heads = 12 columns a layer
BOUNDS = LAYOUT.column_bounds(0)


def _bench():
    from bench import attn_dp_rows

    return attn_dp_rows


def _text_ids(tokens: int, seed: int = 3) -> np.ndarray:
    """[tokens, 12] ids of one layer: column c of order o draws from 8 ** (o + 1) rows of its
    own range (low orders repeat, as in text)."""
    gen = np.random.default_rng(seed)
    return np.stack([BOUNDS[c] + gen.integers(0, min(8 ** (c // 4 + 1), BOUNDS[c + 1] - BOUNDS[c]), tokens)
                     for c in range(12)], axis=1)


def test_rank_steps_give_each_rank_its_own_streams_and_chunks():
    bench = _bench()
    ids = np.arange(2 * bench.DECODE_BATCH * 3 * 12).reshape(-1, 12)
    steps = bench.rank_steps(ids, 2, "decode", 100)
    assert len(steps) == 3 and all(len(s) == 2 and s[0].shape == (bench.DECODE_BATCH, 12) for s in steps)
    # Rank 1 runs streams 256..511; stream k's token t is row k * 3 + t of the ids.
    assert steps[2][1][0].tolist() == ids[bench.DECODE_BATCH * 3 + 2].tolist()
    assert not np.intersect1d(steps[0][0], steps[0][1]).size
    chunks = bench.rank_steps(np.zeros((5 * bench.PREFILL_CHUNK, 12)), 2, "prefill", 100)
    assert len(chunks) == 2 and chunks[1][1].shape == (bench.PREFILL_CHUNK, 12)


@pytest.mark.parametrize("dp", [2, 4])
def test_shard_reads_are_the_union_of_its_shard_once_whole_counts_every_rank(dp):
    bench = _bench()
    ids = _text_ids(dp * bench.DECODE_BATCH * 6)
    steps = bench.rank_steps(ids, dp, "decode", 6)
    whole, _ = bench.scheme_reads(steps, "whole", BOUNDS, 0)
    shard, _ = bench.scheme_reads(steps, "shard", BOUNDS, 0)
    for s, step in enumerate(steps):
        union = np.unique(np.concatenate(step))
        for r in range(dp):
            held = bench.in_ranges(union, bench.column_shards(BOUNDS, r, dp))
            assert shard[s, r] == held.shape[0]  # every row of all ranks' ids in its shard, each once
        assert shard[s].sum() == union.shape[0]  # the shards split the union, no row twice
        assert whole[s].tolist() == [np.unique(a).shape[0] for a in step]
        assert whole[s].sum() > union.shape[0]  # 2-grams several ranks need: read once per rank
    _, cached = bench.scheme_reads(steps, "shard", BOUNDS, 1 << 20)
    assert (cached <= shard).all() and cached[1:].sum() < shard[1:].sum()


def test_a_row_two_ranks_need_is_read_twice_whole_once_shard():
    bench = _bench()
    row = int(BOUNDS[5])
    step = [np.full((1, 1), row), np.full((1, 1), row)]
    whole, _ = bench.scheme_reads([step], "whole", BOUNDS, 0)
    shard, _ = bench.scheme_reads([step], "shard", BOUNDS, 0)
    assert whole.tolist() == [[1, 1]]
    assert shard.tolist() == [[0, 1]]  # column 5 is rank 1's (5 % 2)


def test_replay_hits_what_the_dram_cache_admitted():
    bench = _bench()
    a, b = np.array([1, 5, 9]), np.array([5, 9, 12])
    assert bench.replay_reads([a, b, a], 1000, 0).tolist() == [3, 3, 3]
    assert bench.replay_reads([a, b, a], 1000, 1 << 20).tolist() == [3, 1, 0]


def test_read_time_is_the_slowest_ranks_share_and_exchange_counts_bytes():
    bench = _bench()
    # Two ranks share 1,000 IOPS: 500 each; the slowest rank's 50 reads take 100 ms, + 1 ms latency.
    assert bench.read_ms(np.array([[10, 50], [0, 0]]), 1000.0, 1.0) == pytest.approx((101.0 + 0.0) / 2)
    ex = bench.exchange_ms(tokens_per_rank=1, dp=2, columns=1, layers=1, gbps=1.0)
    assert ex["ids_bytes_per_layer"] == 8  # the other rank's one id
    assert ex["rows_bytes_per_layer"] == 512  # half of 2 tokens' bf16 rows of 256 values
    assert ex["ms"] == pytest.approx((2 * bench.ALLREDUCE_LATENCY_S + 520 / 1e9) * 1e3)


def test_verdict_picks_the_smaller_exposed_time_and_the_break_even_disk():
    bench = _bench()

    def result(scheme, reads, read, exch):
        return {"shape": "decode", "dp": 4, "dram_cache_gib": 1.0, "scheme": scheme, "reads_max_rank": reads,
                "exchange_ms": {"H200": exch}, "exposed_ms": {"planner/H200": read + exch}}

    v = bench.verdicts([result("whole", 1000.0, 4.0, 0.0), result("shard", 900.0, 3.0, 0.5)])[0]
    assert v["picks"] == {"planner/H200": "shard"}
    # 100 reads saved on each of 4 ranks are worth the 0.5 ms exchange at 800 k IOPS a replica.
    assert v["breakeven_iops"]["H200"] == pytest.approx(100 * 4 / 0.5e-3)
    v = bench.verdicts([result("whole", 1000.0, 0.1, 0.0), result("shard", 900.0, 0.09, 0.5)])[0]
    assert v["picks"] == {"planner/H200": "whole"}
