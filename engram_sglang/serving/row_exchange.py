"""Row shards over tensor-parallel ranks, reassembled exactly.

A rank whose store holds a shard returns the rows it owns and +0.0 (bits 0x0000) for every
other id; each row is owned by exactly one rank. Adding the int32 view of the shards (a row is
256 bf16 values: an even count, so every int32 covers two values of one row) gives the owner's
bits under any reduction algorithm, whatever a lossy float collective would do (ROCm's quick
all-reduce casts bf16 to fp16 or quantizes it; a future CUDA one-shot might too). Every sum or
reduce-scatter of row shards goes through `exact_sum_` or `exchange_rows`, on every vendor.

Where the ranks of the TP group hold the same tokens (plain TP) one all-reduce sums the shards
(`exact_sum_`). Under DeepSeek-V4.1's attention data parallelism the ranks hold different
tokens, so `exchange_rows` does what upstream's `EngramEmbedding._dp_sharded_lookup` does, per
layer: gather every attention-DP rank's ids (SGLang's `dp_gather_replicate`, which knows the
DP padding modes and gatherv), read the rows this rank's shard owns for all of them, and send
each rank its own rows back through an int32 reduce-scatter (`dp_reduce_scatter_tensor`) or an
int32 all-reduce and `dp_scatter`, as SGLang's buffer layout allows. Under attention context
parallelism a lookup of a prompt's slice gathers the slices' ids over the CP group first
(`context_rows`). Nothing here syncs with the host: the sizes are SGLang's host integers, so a
CUDA graph captures the collectives and a replay re-runs them.

A store that reads files (disk) can fail a read after its retries (TableIOError). A rank
that raised would skip the collective and the others would wait for it forever, so with
`can_fail` the rank still joins it, with +0.0 for the rows it could not read, and one int32
column of per-token failure flags rides beside the rows' int32 view: its sum is exact too, so
each rank learns which of its OWN tokens lacked a row (`Exchanged.failed`), whichever rank
failed to read it, and its runtime fails their requests. Flagging a failed read takes the
host (its ids are matched there); such stores are never captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import numpy as np
import torch

from ..core.errors import EngramError
from ..core.rowformat import ROW_VALUES
from ..core.stores.base import TableIOError

Gather = Callable[[torch.Tensor], torch.Tensor]  # ids [N, C] -> bf16 [N, C, 256], +0.0 for ids not held


class Exchanged(NamedTuple):
    """Rows of a lookup whose gather may fail (`can_fail`)."""

    rows: torch.Tensor  # bf16 [*ids.shape, 256]: exact, +0.0 for a row no rank could read
    failed: torch.Tensor  # bool [T]: this rank's tokens that lacked a row (on the rows' device)
    fault: Optional[TableIOError]  # this rank's own failed read (rows of any rank's tokens), or None


def exact_sum_(rows: torch.Tensor, group=None) -> torch.Tensor:
    """Sum bf16 row shards in place over `group` (SGLang's TP group by default) as int32.

    On a GPU through SGLang's `inplace_all_reduce` (NCCL or RCCL: SGLang's custom and quick
    all-reduce are never asked), on the CPU through torch.distributed over the group's
    device group (gloo). Returns `rows` (made contiguous first where it was not)."""
    if group is None:
        from sglang.srt.distributed import get_tp_group

        group = get_tp_group()
    rows = rows.contiguous()
    ints = rows.view(torch.int32)
    if _on_gpu(rows):  # CUDA and HIP alike: no vendor branch
        from sglang.srt.distributed import parallel_state

        parallel_state.inplace_all_reduce(ints, group_name=group.unique_name)
    else:
        torch.distributed.all_reduce(ints, group=group.device_group)
    return rows


def _on_gpu(t: torch.Tensor) -> bool:
    return t.is_cuda


def _reduce_scatter_fits(parallel, forward_batch, global_len: int, local_len: int) -> bool:
    """Whether SGLang's DP reduce-scatter hands each rank exactly its own slot of the global
    buffer: MAX_LEN padding over one attention-TP rank per DP group (every slot `local_len`
    rows), or the variable-length gatherv pair. Else all-reduce and `dp_scatter`."""
    from sglang.srt.environ import envs
    from sglang.srt.layers.dp_attention import is_dp_gatherv_active

    if envs.SGLANG_ENABLE_DETERMINISTIC_INFERENCE.get():
        # SGLang's deterministic reduce-scatter is a plain all_reduce, which may pick a custom
        # all-reduce that does not take int32: ours goes straight to NCCL/RCCL instead.
        return False
    padding = getattr(forward_batch, "dp_padding_mode", None)
    equal_slots = (padding is not None and padding.is_max_len() and parallel.tp_size == parallel.attn_dp_size
                   and global_len == parallel.tp_size * local_len)
    return equal_slots or is_dp_gatherv_active()


def exchange_rows(gather: Gather, ids: torch.Tensor, forward_batch, *, can_fail: bool = False):
    """bf16 rows [*ids.shape, 256] of this rank's own ids `ids` [T, C] under attention DP,
    from a shard: every rank must call it for every Engram layer of a step (an idle rank with
    T = 0 included), in the same order, as for any DP collective. `can_fail` (the same on
    every rank: a store that reads files): an `Exchanged`, whose flags say which of this
    rank's tokens some rank could not read a row of."""
    from sglang.srt.layers import dp_attention as dpa
    from sglang.srt.runtime_context import get_parallel

    if forward_batch is None:
        raise EngramError("an Engram lookup under attention data parallelism over row shards came without its "
                          "forward batch, which the id exchange needs (SGLang's DP buffer layout)")
    parallel = get_parallel()
    global_len = dpa.get_global_dp_buffer_len()
    all_ids = ids.new_empty((global_len, *ids.shape[1:]))
    # The MAX_LEN gather may zero its local input in place: hand it a copy.
    dpa.dp_gather_replicate(all_ids, ids.contiguous().clone(), forward_batch)
    width = ids.shape[1:].numel() * ROW_VALUES // 2  # int32 per token: two bf16 values each
    local = torch.empty((ids.shape[0], width + can_fail), dtype=torch.int32, device=ids.device)
    if global_len == 0:  # (the same on every rank: SGLang's global buffer length)
        return _result(local, ids, width, can_fail, None)
    owned, fault = _owned(gather, all_ids, can_fail)
    if _reduce_scatter_fits(parallel, forward_batch, global_len, local.shape[0]):
        dpa.dp_reduce_scatter_tensor(local, owned)
    else:  # (bf16 views in and out, as SGLang's dp_scatter copies them; summed as int32)
        dpa.dp_scatter(local.view(torch.bfloat16), exact_sum_(owned.view(torch.bfloat16), parallel.tp_group),
                       forward_batch)
    return _result(local, ids, width, can_fail, fault)


def _owned(gather: Gather, all_ids: torch.Tensor, can_fail: bool) -> tuple[torch.Tensor, Optional[TableIOError]]:
    """int32 [N, width (+1)] of the rows this rank's shard holds for `all_ids` [N, C] (+0.0
    elsewhere), with `can_fail` a last column of per-token flags: 1 where this rank could not
    read a row of the token. A failed read is contained here, so the rank joins the collective."""
    if not can_fail:
        return gather(all_ids).reshape(all_ids.shape[0], -1).view(torch.int32), None
    fault = None
    try:
        rows = gather(all_ids)
        bad = None
    except TableIOError as e:
        fault, rows = e, getattr(e, "rows", None)
        flat = all_ids.reshape(all_ids.shape[0], -1)
        if rows is None:  # the call failed as a whole: every token that read a row
            rows = torch.zeros(*all_ids.shape, ROW_VALUES, dtype=torch.bfloat16, device=all_ids.device)
            bad = (flat >= 0).any(-1)
        else:
            bad = torch.from_numpy(np.isin(flat.cpu().numpy(), e.failed_ids).any(-1))
    ints = rows.reshape(all_ids.shape[0], -1).view(torch.int32)
    flags = ints.new_zeros((ints.shape[0], 1))
    if bad is not None:
        flags[:, 0] = bad.to(flags.device, torch.int32)
    return torch.cat([ints, flags], 1), fault


def _result(summed: torch.Tensor, ids: torch.Tensor, width: int, can_fail: bool, fault: Optional[TableIOError]):
    """The bf16 rows [*ids.shape, 256] of the exchanged int32 `summed` [T, width (+1)], and
    with `can_fail` its flag column (any rank's flag summed: > 0 where a row was missing)."""
    if not can_fail:
        return summed.view(torch.bfloat16).view(*ids.shape, ROW_VALUES)
    rows = summed[:, :width].contiguous().view(torch.bfloat16).view(*ids.shape, ROW_VALUES)
    return Exchanged(rows, summed[:, width] > 0, fault)


def context_rows(gather: Gather, ids: torch.Tensor, *, can_fail: bool = False):
    """bf16 rows of a context-parallel rank's slice `ids` [T, C] of a prompt (every CP rank's
    slice has T rows), from a shard: the CP group's slices are gathered, so every rank of the
    TP group (the CP group, attention DP being 1) looks up the same ids; the shards are summed
    exactly and this rank keeps its slice. Every CP rank calls it for every Engram layer.
    `can_fail`: an `Exchanged`, as `exchange_rows` returns."""
    from sglang.srt.layers.dp_attention import attn_cp_all_gather_into_tensor
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    all_ids = ids.new_empty((parallel.attn_cp_size * ids.shape[0], *ids.shape[1:]))
    attn_cp_all_gather_into_tensor(all_ids, ids.contiguous())
    width = ids.shape[1:].numel() * ROW_VALUES // 2
    if all_ids.shape[0] == 0:
        return _result(torch.zeros((0, width + can_fail), dtype=torch.int32, device=ids.device), ids, width,
                       can_fail, None)
    owned, fault = _owned(gather, all_ids, can_fail)
    summed = exact_sum_(owned.view(torch.bfloat16), parallel.tp_group).view(torch.int32)
    start = parallel.attn_cp_rank * ids.shape[0]
    return _result(summed[start:start + ids.shape[0]], ids, width, can_fail, fault)
