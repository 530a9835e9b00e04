"""Host work between forward steps, outside any CUDA graph: one entry, `between_steps()`.

A forward step may be the replay of a captured CUDA graph, which runs no Python and must
not wait for the device. So nothing a store does inside a gather syncs with the host or
advances Python state (its counters are device tensors, advanced in place), and whatever
needs the host waits here: a hot-row cache's admission and eviction, reading the device
counters into statistics and Prometheus metrics, the runtime's stats file.

* The serving layer calls `between_steps()` once per forward step, outside any graph (the
  plugin wraps SGLang's `ModelRunner.forward`, which runs for eager and replayed steps
  alike and is never itself captured: SGLang captures `model.forward`).
* Participants register themselves, weakly: every TableStore when it opens, and the
  serving runtime (`last=True`: it reads what the stores have just brought up to date).
  Each gets `between_steps(step)` on every step and does its host work when its cadence
  says so; with one cadence for all (the default), the syncs of every layer fall on the
  same step: one pipeline bubble per `DEFAULT_EVERY` steps, not one per layer.
* Cost (bench/maintenance.py): see `DEFAULT_EVERY`. On a GPU the host sync that starts a
  maintenance also ends the overlap of that one step (SGLang's overlap scheduler prepares
  step n+1 while step n runs): every 8th step by default, never every step.
* Standalone use (tests, benches): call `between_steps()` after each step, or a store's
  own `maintain()`; a gather never maintains by itself.
"""

from __future__ import annotations

import logging
import threading
import weakref

import torch

logger = logging.getLogger(__name__)

# Steps between two maintenances. bench/maintenance.py (decode size: 256 tokens x 24 ids
# per layer, caches of 5% of 2^20 rows, CPU, one thread, on a shared 2-core machine): a
# maintenance costs 45 ms a layer every step, 133 ms every 4, 66-142 ms every 8, 240 ms
# every 16; per step that is 45, 33, 8-18 and 15 ms a layer: 8 takes most of the saving
# that 16 would, while bench/cache.py finds no hit rate gained by maintaining more often on
# real decode traces; and 8 x 6144 missed ids fit the ring of 2^17 that remembers them
# (at 32 it would wrap and forget the oldest). On a GPU the same work is device kernels plus
# the one host sync that ends the overlap of that step: not measured yet.
DEFAULT_EVERY = 8

_lock = threading.Lock()
_first: "weakref.WeakSet" = weakref.WeakSet()  # stores
_last: "weakref.WeakSet" = weakref.WeakSet()  # what reads the stores (the runtime's stats file)
_step = 0


def capturing() -> bool:
    """Whether this thread's current CUDA stream is capturing a graph (never where CUDA was
    not initialized: torch's query itself fails on a machine without a driver)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def register(participant, *, last: bool = False) -> None:
    """Call `participant.between_steps(step)` once per step from now on (until it is
    collected or unregistered)."""
    with _lock:
        (_last if last else _first).add(participant)


def unregister(participant) -> None:
    with _lock:
        _first.discard(participant)
        _last.discard(participant)


def participants() -> list:
    with _lock:
        return list(_first) + list(_last)


def steps() -> int:
    """Steps seen so far by `between_steps()` in this process."""
    return _step


def between_steps() -> int:
    """One forward step is done: run every participant's between-steps work that is due.
    Returns the step number (0, nothing run, when called inside a graph capture: that is
    not between steps, and whatever syncs would break the capture)."""
    global _step
    if capturing():
        logger.debug("between_steps() called inside a CUDA-graph capture: skipped")
        return 0
    with _lock:
        _step += 1
        step = _step
        todo = list(_first) + list(_last)
        readers = list(_last)
    # A step its model left open ends first (EngramRuntime.end_open_step): every prefetch of
    # it is ordered before the stores' admissions and evictions below.
    for p in readers:
        end = getattr(p, "end_open_step", None)
        if end is not None:
            end()
    for p in todo:
        p.between_steps(step)
    return step
