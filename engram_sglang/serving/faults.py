"""Faults fail requests, not the server.

A row read that still fails after its retries reaches the runtime as a TableIOError; the
runtime finishes the forward (every other token's rows are exact) and keeps the request
slots whose tokens needed a failed row (`EngramRuntime.take_failed_requests`). After the
batch, the scheduler hook below aborts exactly those requests with an error finish reason
naming the table and the errno (HTTP 500 for a plain request; a streamed one ends with
that finish reason), so nothing read from a broken table is served as if it were real,
and the server keeps serving.

With tensor parallelism each rank reads its own shard: a fault is seen by one rank only,
so the ranks agree on the requests to abort with one small all-reduce over SGLang's CPU
group, done only for placements that read on the host (where faults can happen at all).
"""

from __future__ import annotations

import logging
from http import HTTPStatus

import torch

from .modes import request_slot
from .runtime import active_runtimes

logger = logging.getLogger(__name__)
ERROR_TYPE = "EngramTableReadError"


def abort_failed_requests(scheduler, batch) -> int:
    """Abort the requests of `batch` whose rows could not be read; returns how many."""
    runtimes = active_runtimes()
    if batch is None or not runtimes:
        return 0
    failed: dict[int, str] = {}
    for runtime in runtimes:
        failed.update(runtime.take_failed_requests())
    # The ranks that run this very batch: the attention-TP group (the whole TP group without
    # attention data parallelism); ranks of other attention-DP groups run other batches.
    tp = getattr(scheduler, "attn_tp_size", None) or getattr(scheduler, "tp_size", 1)
    if not failed and tp <= 1:
        return 0
    reqs = list(getattr(batch, "reqs", None) or [])
    flags = torch.tensor([1 if request_slot(r) in failed else 0 for r in reqs], dtype=torch.int32)
    group = getattr(scheduler, "attn_tp_cpu_group", None) or getattr(scheduler, "tp_cpu_group", None)
    if tp > 1 and group is not None and reqs and _reads_on_host(runtimes):
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=group)
    if not int(flags.sum()):
        return 0
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    aborted = 0
    for req, flag in zip(reqs, flags.tolist()):
        if flag and not req.finished():
            reason = failed.get(request_slot(req), "engram: a table read failed on another tensor-parallel rank")
            req.to_finish = FINISH_ABORT(f"{reason} (request aborted; the server keeps serving)",
                                         HTTPStatus.INTERNAL_SERVER_ERROR, ERROR_TYPE)
            aborted += 1
    logger.error("engram-sglang: aborted %d request(s) whose Engram rows could not be read", aborted)
    return aborted


def _reads_on_host(runtimes) -> bool:
    return any(s.needs_host_ids for r in runtimes for s in r.stores.values())

