"""Calls that read no row of this rank's shard: ids that all belong to other tensor-parallel
ranks, and empty id tensors. With TP > 1 a decode step of a few tokens often has no id in a
rank's rows; every placement must answer +0 rows (its share of the all-reduce), never raise.

Tested through TableStore (open_store), so it holds whatever the disk tier's reads become."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engram_sglang.core.hashing import EngramLayout
from engram_sglang.core.ops import gather_dequant
from engram_sglang.core.rowformat import ROW_BYTES, bf16_bits
from engram_sglang.core.stores import open_store
from tests.support.tables import held_mask, random_table_dir, small_config

CFG = small_config(300)
LAYOUT = EngramLayout(CFG)

PLACEMENTS = [
    ("device", {}, 0),
    ("host", {}, 0),
    ("disk", {}, 0),
    ("disk", {"direct": True, "threads": 4}, 0),
    ("disk", {"dram_cache_bytes": 64 << 10}, 0),
    ("disk", {"dram_cache_bytes": 64 << 10, "direct": True, "threads": 4}, 0),
    ("disk", {}, 128 << 10),  # a hot-row cache in front
    ("host", {}, 128 << 10),
]


@pytest.fixture(scope="module")
def table_dir(tmp_path_factory):
    return random_table_dir(tmp_path_factory.mktemp("tables"), CFG)


def _zeros(shape) -> torch.Tensor:
    return torch.zeros((*shape, 256), dtype=torch.int16)


@pytest.mark.parametrize("placement,options,cache_bytes", PLACEMENTS, ids=lambda p: str(p))
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_calls_with_no_row_of_this_rank_give_zero_rows(table_dir, placement, options, cache_bytes, backend):
    root, tables = table_dir
    tp_size = 4
    for rank in (0, 1, tp_size - 1):
        stores = open_store(root, placement, cfg=CFG, tp_rank=rank, tp_size=tp_size, backend=backend,
                            cache_bytes=cache_bytes, **options)
        try:
            for L, store in stores.items():
                every = torch.arange(LAYOUT.rows(L))
                others = every[~held_mask(every, store.row_ranges)]
                for ids in (others[:1], others[-3:], others.view(-1, 1)[:5], others[:48].view(2, 24),
                            torch.empty(0, dtype=torch.int64), torch.empty(0, 24, dtype=torch.int32)):
                    for dtype in (torch.int32, torch.int64):
                        ids = ids.to(dtype)
                        got = store.gather(ids)
                        assert got.dtype == torch.bfloat16 and got.shape == (*ids.shape, 256)
                        assert torch.equal(got.view(torch.int16), _zeros(ids.shape))  # +0.0 exactly
                        assert torch.equal(store.prefetch(ids).wait().view(torch.int16), _zeros(ids.shape))
                        out = torch.full((*ids.shape, 256), 7.0, dtype=torch.bfloat16)
                        assert store.gather(ids, out=out) is out
                        assert torch.equal(out.view(torch.int16), _zeros(ids.shape))
                # The store still serves its own rows exactly afterwards.
                mine = every[held_mask(every, store.row_ranges)]
                want = gather_dequant(torch.from_numpy(tables[L]), mine, backend="torch")
                assert torch.equal(bf16_bits(store.gather(mine)), bf16_bits(want))
        finally:
            for s in stores.values():
                s.close()


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_gather_accepts_an_empty_table(backend):
    """A staging buffer of no rows (torch gives it strides (0, 0)) serves ids as +0 rows."""
    empty = torch.from_numpy(np.empty((0, ROW_BYTES), dtype=np.uint8))
    for table in (empty, torch.empty(0, ROW_BYTES, dtype=torch.uint8), empty[:, :].t().t()):
        ids = torch.tensor([0, 5, 1 << 40])
        got = gather_dequant(table, ids, row_range=(0, 0), backend=backend)
        assert torch.equal(got.view(torch.int16), _zeros((3,)))
        assert gather_dequant(table, ids[:0], row_range=(0, 0), backend=backend).shape == (0, 256)
