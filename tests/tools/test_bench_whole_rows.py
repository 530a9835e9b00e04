"""bench/whole_rows.py's pieces, in-process and small: its bit-identity check (each rank's whole
rows against all ranks' shards summed) passes at TP 2 and 4 and is not vacuous; its per-step
bytes are the planner's; its cache replay gives a shard's cache (keyed on 1/TP of the rows)
more hits than a whole-table cache of the same size on a skewed trace."""

from __future__ import annotations

from pathlib import Path

import torch

from engram_sglang.core.config import EngramConfig
from engram_sglang.tools.planner import plan

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    from bench import whole_rows

    return whole_rows


def test_bit_identity_holds_and_can_fail(monkeypatch):
    bench = _bench()
    assert bench.bit_identical((2, 4)) == {2: True, 4: True}
    # Negative control: a rank that did not get whole rows (agreement refused) fails the check.
    from engram_sglang.core import stores

    real = stores.open_store
    monkeypatch.setattr(stores, "open_store", lambda *a, **k: real(*a, **{**k, "agree": None}))
    assert bench.bit_identical((2,)) == {2: False}


def test_step_bytes_are_the_planners():
    bench = _bench()
    cfg = EngramConfig.from_preset(bench.PRESET)
    figures = bench.step_figures(cfg, (8,), {})
    p = plan(model=bench.PRESET, gpu="H200", tp=8, placement="host")["rows_per_rank"]["phases"]
    for f in figures:
        want = p[f["phase"]]
        assert {k: f[k] for k in want if k in f and k != "tokens"} == {k: want[k] for k in want if k in f and k != "tokens"}


def test_a_shard_cache_beats_a_whole_table_cache_of_the_same_size():
    bench = _bench()
    gen = torch.Generator().manual_seed(1)
    rows = 40_000
    # Zipf-like ids spread over the table by a fixed permutation (hashed rows are spread too).
    perm = torch.randperm(rows, generator=gen)
    weights = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64)
    trace = [perm[torch.multinomial(weights, 256 * 24, replacement=True, generator=gen)].view(256, 24)
             for _ in range(60)]
    whole = bench._replay(trace, 512, None)
    sharded = bench._replay(trace, 512, (0, rows // 4))
    assert 0 < whole < sharded < 1
