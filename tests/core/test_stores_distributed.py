"""Tensor parallelism for real: 2 and 4 processes (torch.distributed, gloo) each open their
row-range shard, gather the same ids, and an all-reduce sum reassembles the unsharded rows
bit for bit. With the node's shared host copy and the ranks' agreement (`agree`, one MIN
all-reduce) every rank reads whole rows instead: no sum, the same bits as shards summed."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engram_sglang.core import rowformat
from engram_sglang.core.hashing import EngramLayout
from engram_sglang.core.rowformat import ROW_BYTES, bf16_bits
from engram_sglang.core.shards import column_shards
from engram_sglang.core.tablefile import write_tables
from tests.support.tables import small_config

pytest.importorskip("engram_sglang.core.ops", reason="the gather_dequant op (engram_sglang.core.ops) is not built yet")

CFG = small_config(300, layer_ids=(4,), n_heads=2)
# Balanced shards are open_store's default; "device-contiguous" opens one range a rank. In
# "host-fallback" rank 0 maps the node's copy whole and rank 1 keeps a private shard (as when
# /dev/shm had no room for it): rank 1 answers `agree` no, so rank 0 narrows its whole rows
# to its balanced shard (`hold_only` with a list of ranges) and the ranks sum.
PLACEMENT_OPTIONS = {"device": {}, "host": {"shared": True}, "disk": {}, "host-whole": {"shared": True},
                     "device-contiguous": {"shards": "contiguous"}, "host-fallback": {"shared": True}}


def _rank(rank: int, world: int, init_file: str, table_dir: str, placement: str, shm_dir: str, result_dir: str):
    from engram_sglang.core.stores import open_store

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        options = dict(PLACEMENT_OPTIONS[placement])
        if options.get("shared"):
            options["shm_dir"] = shm_dir
        whole = placement == "host-whole"
        if placement in ("host-whole", "host-fallback"):  # what the serving runtime passes
            options["agree"] = _agree
        if placement == "host-fallback" and rank == 1:
            options["shared"] = False
        store = open_store(table_dir, placement.split("-")[0], cfg=CFG, tp_rank=rank, tp_size=world, **options)[4]
        ids = torch.from_numpy(np.load(os.path.join(result_dir, "ids.npy")))
        rows = store.gather(ids)
        partial = rows.float()
        if whole:  # no sum: this rank's own rows, checked against private shards summed
            shard = open_store(table_dir, "host", cfg=CFG, tp_rank=rank, tp_size=world)[4]
            summed = shard.gather(ids).float()
            dist.all_reduce(summed)
            same = torch.tensor([int(torch.equal(bf16_bits(rows), bf16_bits(summed.to(torch.bfloat16))))])
            dist.all_reduce(same, op=dist.ReduceOp.MIN)  # on every rank
            shard.close()
        else:
            dist.all_reduce(partial)  # what a TP all-reduce of the Engram rows computes
        dist.barrier()  # every rank holds its store: count the node's copies now
        if rank == 0:
            copies = len([n for n in os.listdir(shm_dir) if n.startswith("engram-") and n.endswith("-layer4.rows")])
            torch.save({"sum": partial.to(torch.bfloat16), "range": store.row_range, "copies": copies,
                        "ranges": store.row_ranges,
                        "whole_equals_shards": bool(same.item()) if whole else None},
                       os.path.join(result_dir, "out.pt"))
        store.close()
        dist.barrier()  # no rank tears gloo down while a peer is still talking to it
    finally:
        dist.destroy_process_group()
    # Leave without interpreter teardown: under load, gloo's threads now and then abort the
    # exiting process ("terminate called without an active exception") after all the
    # work above is done and checked; that is torch's exit path, not what this test checks.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _agree(everywhere: bool) -> bool:
    value = torch.tensor([int(everywhere)])
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    rows = torch.randint(0, 256, (EngramLayout(CFG).rows(4), ROW_BYTES), dtype=torch.uint8, generator=gen)
    rows[:256, :256] = torch.arange(256, dtype=torch.uint8)
    rows[:256, 256:] = torch.arange(256, dtype=torch.uint8).unsqueeze(1)
    root = write_tables(tmp_path_factory.mktemp("dist") / "t", CFG, {4: rows.numpy()}, progress=False)
    return root, rows


@pytest.mark.slow
@pytest.mark.parametrize("world,placement", [(w, p) for w in (2, 4) for p in ("device", "host", "disk")]
                         + [(2, "host-whole"), (2, "device-contiguous"), (2, "host-fallback")])
def test_tp_shards_all_reduce_to_the_unsharded_rows(table, tmp_path, world, placement, rng):
    root, rows = table
    ids = torch.randint(0, rows.shape[0], (48, 24), generator=rng)
    ids[0, :3] = torch.tensor([0, rows.shape[0] - 1, 7])
    np.save(tmp_path / "ids.npy", ids.numpy())
    mp.start_processes(
        _rank,
        args=(world, str(tmp_path / "init"), str(root), placement, str(tmp_path), str(tmp_path)),
        nprocs=world,
        start_method="spawn",
    )
    out = torch.load(tmp_path / "out.pt")
    want = rowformat.dequantize(rows[ids.reshape(-1)]).view(48, 24, 256)
    assert torch.equal(bf16_bits(out["sum"]), bf16_bits(want))
    if placement == "host-whole":
        assert out["range"] == (0, rows.shape[0])  # rank 0 read whole rows, no sum
        assert out["whole_equals_shards"] is True  # every rank, bit for bit
    else:
        assert out["range"][0] == 0 and out["range"][1] < rows.shape[0]  # rank 0 really held a shard
    bounds = EngramLayout(CFG).column_bounds(0)
    if placement == "device-contiguous":
        assert out["ranges"] == [out["range"]]
    elif placement != "host-whole":  # balanced: rank 0 held several ranges (core/shards.py)
        assert out["ranges"] == column_shards(bounds, 0, world) and len(out["ranges"]) > 1
    if placement.startswith("host"):
        assert out["copies"] == 1  # one copy for all ranks
        assert list(tmp_path.glob("engram-*-layer4.rows")) == []  # removed by the last rank to close
