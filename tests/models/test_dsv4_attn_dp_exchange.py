"""DeepSeek-V4.1's attention data parallelism over row shards, for real: 2 processes
(gloo), each an attention-DP rank of one TP group (attention DP = TP) with its own token count
(one rank idle), serve their Engram lookups through our StoreEngramEmbedding under SGLang's own
parallel state (a GroupCoordinator over gloo) and dp_attention helpers. Each rank's rows must be
the whole rows of its OWN ids bit for bit, for device, private host and disk shards, in SGLang's
SUM_LEN (all-reduce + dp_scatter) and MAX_LEN (reduce-scatter) padding modes, with every float
sum made lossy (an fp16 round trip, as ROCm's quick all-reduce does) and integers summed
exactly; under attention context parallelism, device and disk shards. Negative controls in
the same processes: ranks that skip the exchange, and ranks that sum the bf16 rows instead of
their int32 view, must get other bits.

Faults (disk): reads of some rows fail with EIO on ONE rank (rank 1, through the disk store's
own read path); that rank still joins the exchange, and every rank fails exactly the requests
of its own tokens that needed a failed row (the flag column), whichever rank read it, while
every other token's rows stay exact; a timeout fails the test if any rank hangs. Negative
control: with the flag column zeroed the owners do not learn of the failure.
"""

from __future__ import annotations

import os
import sys
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engram_sglang import EngramLayout
from engram_sglang.core.rowformat import ROW_BYTES, ROW_VALUES, bf16_bits, dequantize
from engram_sglang.core.tablefile import write_tables
from tests.support.tables import small_config

pytest.importorskip("sglang.srt.layers.dp_attention", reason="needs the installed sglang")

CFG = small_config(300, layer_ids=(2, 5), n_heads=2)
COUNTS = {2: [7, 0], 4: [5, 0, 11, 1]}  # tokens per attention-DP rank (one idle)
PLACEMENTS = {"device": {}, "host": {"host_shared": False}, "disk": {"disk_retries": 0}}
CASES = ("sum_len", "max_len", "skip", "bf16")  # the last two: negative controls
FAULT_COUNTS = {2: [5, 3], 4: [5, 2, 3, 0]}  # tokens per rank where rank 1's reads fail
FAULT_CASES = ("fault_sum_len", "fault_max_len", "fault_noflag")  # the last: negative control


def _ids(layout: EngramLayout, rank: int, n: int) -> torch.Tensor:
    """`n` tokens' ids [n, C] of layer 5, each column in its own segment; rank 0's first id
    is the table's first row, its last id the last row."""
    bounds = layout.column_bounds(layout.layer_index(5))
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.stack([lo + torch.randint(0, hi - lo, (n,), generator=g) for lo, hi in zip(bounds, bounds[1:])], 1)
    if n and rank == 0:
        ids[0, 0], ids[-1, -1] = 0, bounds[-1] - 1
    return ids


def _lossy_all_reduce(real):
    """torch.distributed.all_reduce where a float input makes an fp16 round trip first."""

    def all_reduce(tensor, *args, **kwargs):
        if tensor.is_floating_point():
            exact = tensor.float()
            real(exact, *args, **kwargs)
            tensor.copy_(exact.half().to(tensor.dtype))
            return None
        return real(tensor, *args, **kwargs)

    return all_reduce


def _rank(rank: int, world: int, init_file: str, table_dir: str, shm_dir: str, out_dir: str):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from sglang.srt.distributed import parallel_state
    from sglang.srt.layers import dp_attention as dpa
    from sglang.srt.runtime_context import get_parallel

    import engram_sglang.serving.row_exchange as row_exchange
    from engram_sglang.models.deepseek_v4_hook import StoreEngramEmbedding, _layers_read_these_ids, process_runtime
    from engram_sglang.serving.settings import ServeSettings

    # SGLang registers its collective custom ops for CUDA only: on the CPU its GroupCoordinator
    # methods run their bodies directly (the same ones the ops call), over gloo.
    parallel_state._is_cpu = True
    dpa.memcpy_func = dpa.memcpy_cpu  # (chosen at import by SGLang's device, not by the tensor's)
    parallel_state.inplace_all_reduce = lambda t, group_name: parallel_state._groups[group_name]()._all_reduce_in_place(t)
    dist.all_reduce = _lossy_all_reduce(dist.all_reduce)
    group = parallel_state.GroupCoordinator(
        [list(range(world))], rank, "gloo", use_pynccl=False, use_mscclpp=False, use_custom_allreduce=False,
        use_torch_symm_mem_all_reduce=False, use_hpu_communicator=False, use_xpu_communicator=False,
        group_name="tp")
    layout = EngramLayout(CFG)
    counts = COUNTS[world]
    out = {}
    try:
        with get_parallel().override(tp_size=world, tp_rank=rank, attn_tp_size=1, attn_tp_rank=0,
                                     attn_dp_size=world, attn_dp_rank=rank, attn_cp_size=1, attn_cp_rank=0,
                                     tp_group=group) as par:
            for placement, options in PLACEMENTS.items():
                settings = ServeSettings(placement=placement, table_dir=table_dir, shm_dir=shm_dir, **options)
                runtime = process_runtime(settings=settings, device="cpu", parallel=par)
                embed = StoreEngramEmbedding(layout.rows(5), ROW_VALUES, 5, layout.column_bounds(1), runtime=runtime)
                decode = SimpleNamespace(forward_mode=SimpleNamespace(is_extend=lambda: False))
                out[placement, "opened"] = (runtime.tp_rank, runtime.tp_size, runtime.row_exchange,
                                            runtime.attention_rows, _layers_read_these_ids(runtime, decode, bool))
                for case in CASES:
                    max_len = case == "max_len"
                    n = max(counts) if max_len else counts[rank]  # MAX_LEN pads every rank to the longest
                    ids = _ids(layout, rank, n)
                    sizes = [max(counts)] * world if max_len else counts
                    fb = _batch(dpa, sizes, max_len)
                    dpa.set_dp_buffer_len(sum(sizes), sizes[rank], max_len, sizes)
                    real_exchange, real_sum = row_exchange.exchange_rows, row_exchange.exact_sum_
                    from engram_sglang.serving import runtime as runtime_module

                    if case == "skip":  # every rank reads its own shard of its own ids, nothing exchanged
                        runtime_module.exchange_rows = _skip_exchange
                    if case == "bf16":  # the rows summed as bf16 through SGLang's all-reduce (CUDA's old path)
                        row_exchange.exact_sum_ = lambda rows, g: g.all_reduce(rows)
                    try:
                        rows = embed(ids, fb)
                    finally:
                        runtime_module.exchange_rows, row_exchange.exact_sum_ = real_exchange, real_sum
                    out[placement, case] = (ids[:counts[rank]], rows[:counts[rank]])
                if placement == "disk":
                    out.update(_faults(rank, world, layout, runtime, embed, dpa, row_exchange))
                runtime.close()
        # Attention context parallelism (CP = TP): a prompt slice's ids are gathered over the CP
        # group (upstream's way); a decode lookup, the same tokens on every rank, is summed.
        with get_parallel().override(tp_size=world, tp_rank=rank, attn_tp_size=1, attn_tp_rank=0, attn_dp_size=1,
                                     attn_dp_rank=0, attn_cp_size=world, attn_cp_rank=rank, tp_group=group,
                                     attn_cp_group=group) as par:
            for placement in ("device", "disk"):
                runtime = process_runtime(settings=ServeSettings(placement=placement, table_dir=table_dir),
                                          device="cpu", parallel=par)
                embed = StoreEngramEmbedding(layout.rows(5), ROW_VALUES, 5, layout.column_bounds(1), runtime=runtime)
                out["cp", placement, "opened"] = (runtime.tp_rank, runtime.tp_size, runtime.row_exchange,
                                                  runtime.attention_rows)
                ids = _ids(layout, rank, 3)
                out["cp", placement, "slice"] = (ids, embed(ids, None, cp_all_tokens=True))
                ids = _ids(layout, 0, 4)
                out["cp", placement, "decode"] = (ids, embed(ids, None))
                runtime.close()
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # (gloo's threads may abort an exiting process under load: see test_stores_distributed.py)


def _skip_exchange(gather, ids, fb, can_fail=False):
    from engram_sglang.serving.row_exchange import Exchanged

    rows = gather(ids)
    return Exchanged(rows, torch.zeros(ids.shape[0], dtype=torch.bool), None) if can_fail else rows


def _faults(rank: int, world: int, layout: EngramLayout, runtime, embed, dpa, row_exchange) -> dict:
    """FAULT_CASES on every rank, reads of some rows failing on rank 1 only: the rows of rank
    0's token 2 and rank 1's token 1 that rank 1's shard holds. Each token is a request of its
    own (slot 100 x rank + token): returns per case the ids, rows, the slots failed on this rank,
    and the rows rank 1 failed to read."""
    counts = FAULT_COUNTS[world]
    store = runtime.stores[5]
    marked = torch.cat([_ids(layout, 0, counts[0])[2], _ids(layout, 1, counts[1])[1]])
    held = marked[bf16_bits(store.gather(marked.view(1, -1)))[0].reshape(marked.shape[0], -1).any(-1)]
    out = {}
    monkeypatch = pytest.MonkeyPatch()
    if rank == 1:
        from tests.support.disk_faults import rows_fail_with_eio

        rows_fail_with_eio(monkeypatch, set(held.tolist()))
    real_owned = row_exchange._owned
    try:
        for case in FAULT_CASES:
            max_len = case == "fault_max_len"
            n = max(counts) if max_len else counts[rank]
            sizes = [max(counts)] * world if max_len else counts
            fb = _batch(dpa, sizes, max_len)
            dpa.set_dp_buffer_len(sum(sizes), sizes[rank], max_len, sizes)
            if case == "fault_noflag":  # the rank that failed joins, but sends no flags
                def owned(gather, all_ids, can_fail):
                    ints, fault = real_owned(gather, all_ids, can_fail)
                    ints[:, -1] = 0
                    return ints, fault

                row_exchange._owned = owned
            ids = _ids(layout, rank, n)
            hash_ids = torch.stack([torch.zeros_like(ids), ids], 1)  # [T, layers (2, 5), C]
            slots = torch.arange(n, dtype=torch.int64) + 100 * rank
            step = runtime.begin(hash_ids, slots, torch.arange(n), torch.zeros(n, dtype=torch.int64), "decode",
                                 forward_batch=fb, prefetch=False)
            runtime._current = step  # (begin_step's bookkeeping; the step is the model's)
            try:
                rows = embed(step.hash_ids[:, 1], fb)  # the step's own column: its tokens' requests
            finally:
                row_exchange._owned = real_owned
                runtime.end(step, 0.0, 0.0, 0)
            out["disk", case] = (ids, rows, sorted(runtime.take_failed_requests()), held,
                                 runtime.stats()["read_faults"])
    finally:
        monkeypatch.undo()
    return out


def _batch(dpa, sizes, max_len: bool):
    mode = dpa.DpPaddingMode.MAX_LEN if max_len else dpa.DpPaddingMode.SUM_LEN
    return SimpleNamespace(global_num_tokens_gpu=torch.tensor(sizes), global_num_tokens_cpu=list(sizes),
                           dp_padding_mode=mode, dp_local_start_pos=None, dp_local_num_tokens=None)


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    layout = EngramLayout(CFG)
    gen = torch.Generator().manual_seed(11)
    rows = {L: torch.randint(0, 256, (layout.rows(L), ROW_BYTES), dtype=torch.uint8, generator=gen) for L in CFG.layer_ids}
    # Scale bytes near the top of e8m0: rows far beyond fp16's range, so a lossy float sum shows.
    rows[5][:, 256:] = torch.randint(150, 200, (layout.rows(5), ROW_BYTES - 256), dtype=torch.uint8, generator=gen)
    return write_tables(tmp_path_factory.mktemp("attndp") / "t", CFG, rows, progress=False), rows, layout


@pytest.mark.slow
@pytest.mark.parametrize("world", [2])  # 4 (COUNTS) passes too; 2 keeps the suite's time
def test_dsv4_attn_dp_shards_exchange_ids_and_return_each_ranks_own_rows(table, tmp_path, world):
    table_dir, packed, layout = table
    ranks = mp.start_processes(_rank, args=(world, str(tmp_path / "init"), str(table_dir), str(tmp_path),
                                            str(tmp_path)), nprocs=world, start_method="spawn", join=False)
    deadline = time.monotonic() + 240  # a rank that skipped a collective would leave the others waiting
    while not ranks.join(timeout=2):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail("a rank hung in the exchange (a fault must not take a rank out of the collective)")
    for rank in range(world):
        out = torch.load(tmp_path / f"rank{rank}.pt")
        for placement in PLACEMENTS:
            # A shard on SGLang's TP rank; no prefetch of the step's own ids (each layer exchanges them).
            assert out[placement, "opened"] == (rank, world, "dp", "exchange", False)
            for case in CASES:
                ids, rows = out[placement, case]
                assert ids.shape[0] == COUNTS[world][rank]
                want = bf16_bits(dequantize(packed[5][ids.reshape(-1)]).view(*ids.shape, ROW_VALUES))
                same = torch.equal(bf16_bits(rows), want)
                if case in ("skip", "bf16") and ids.shape[0]:
                    assert not same, (rank, placement, case)  # the negative controls show the test can fail
                else:
                    assert same, (rank, placement, case)
            if rank == 0:  # the table's first and last rows were among them (ids in every column: `_ids`)
                ids = out[placement, "sum_len"][0]
                assert ids[0, 0] == 0 and ids[-1, -1] == layout.rows(5) - 1
        _check_faults(out, torch.load(tmp_path / "rank1.pt")["disk", "fault_sum_len"][3], packed, rank)
        for placement in ("device", "disk"):
            assert out["cp", placement, "opened"] == (rank, world, "cp", "exchange")
            for case in ("slice", "decode"):
                ids, rows = out["cp", placement, case]
                want = bf16_bits(dequantize(packed[5][ids.reshape(-1)]).view(*ids.shape, ROW_VALUES))
                assert torch.equal(bf16_bits(rows), want), (rank, placement, case)


def _check_faults(out: dict, held: torch.Tensor, packed, rank: int) -> None:
    """Exactly this rank's tokens that needed a row rank 1 failed to read (`held`: the marked
    rows rank 1's shard holds) fail their requests (their own slots), their failed rows +0 and
    every other row exact; only rank 1 counts the fault. Without the flag column
    (`fault_noflag`) the owners never learn of it."""
    assert held.numel()
    for case in FAULT_CASES:
        ids, rows, failed, _, faults = out["disk", case]
        needs = torch.isin(ids, held)  # [T, C]: the rows that could not be read
        want = bf16_bits(dequantize(packed[5][ids.reshape(-1)]).view(*ids.shape, ROW_VALUES))
        want[needs] = 0  # +0 (never served: their requests fail)
        assert torch.equal(bf16_bits(rows), want), (rank, case)
        expected = sorted((torch.nonzero(needs.any(-1)).squeeze(1) + 100 * rank).tolist())
        if rank == 0:  # rank 0's token 2 needs rows only rank 1 reads: it learns of them through the flags
            assert 2 in expected, (rank, case)
        assert faults == (FAULT_CASES.index(case) + 1 if rank == 1 else 0), (rank, case)  # counted where read
        if case == "fault_noflag":
            assert failed != expected or not expected, (rank, case)  # the negative control can fail the test
        else:
            assert failed == expected, (rank, case)
