"""Read-ahead of a chunked prefill's next chunk into the disk tier's DRAM row cache.

Decode row ids depend on the token just sampled, so decode reads cannot start before the
step. A long prompt is different: SGLang prefills it in chunks, and the tokens of the next
chunk are known while this one runs. Before the scheduler runs a batch that holds a
chunked request, this hashes that request's next chunk (with the n-1 tokens before it as
history, so the ids are the ones the next step will ask for) and starts reading its rows
into each layer's DRAM row cache (`DiskStore.read_ahead`). The next chunk's gathers then
find them in memory: the reads overlap a whole chunk of model compute instead of one layer.

A hint only: a wrong or late read-ahead costs a read, never a wrong row (the gather reads
whatever the cache lacks). Only disk placements with a DRAM row cache read ahead.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)
_failed_once = False


def read_ahead_next_chunk(scheduler, batch) -> int:
    """Start reading the next chunk of the scheduler's chunked request; returns its tokens."""
    global _failed_once
    try:
        req = getattr(scheduler, "chunked_req", None)
        size = getattr(scheduler, "chunked_prefill_size", None)
        if req is None or batch is None or not size or not batch.forward_mode.is_extend():
            return 0
        from .modes import modes_in_use, request_span, server_mode
        from .runtime import active_runtimes

        runtimes = [r for r in active_runtimes() if r.reads_ahead]
        if not runtimes:
            return 0
        fill = req.full_untruncated_fill_ids
        start = req.extend_end
        end = min(len(fill), start + size)
        if start is None or end <= start:
            return 0
        for runtime in runtimes:
            lo, hi = start, end
            if modes_in_use(runtime.settings):  # tokens with Engram off read no rows, ahead or not
                on_lo, on_hi = request_span(req, server_mode(runtime.settings), runtime.settings.ablation)
                lo, hi = max(lo, on_lo), min(hi, on_hi)
            if hi > lo:
                runtime.read_ahead(fill[lo:hi], history=fill[max(0, lo - runtime.hasher.n + 1):lo], start=lo)
        return end - start
    except Exception:  # noqa: BLE001 - a hint must never fail a batch
        if not _failed_once:
            _failed_once = True
            logger.exception("engram-sglang: prefill read-ahead failed (serving continues without it)")
        return 0
