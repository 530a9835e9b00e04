"""Pinned staging buffers of a host-reading store (the disk tier) on a GPU.

A worker thread reads a step's packed rows from the file into a pinned buffer; the
consumer's stream copies them to the device and decodes them there. Two slots per layer
(double buffering): one can be filled while the other's copy is still queued on the GPU.
A slot is busy from `acquire` until its handle is waited on or released; the buffers of a
slot that is no longer busy may still be read by a queued host-to-device copy, so whoever
writes them first waits on the host for the slot's `free_event` (`wait_free`). When both
slots are busy (a caller holding several steps in flight) a temporary slot is used: never
a block, never a shared buffer.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch


class StagingSlot:
    """Growable pinned buffers (ids in, packed rows and local indices out) of one read."""

    def __init__(self, streams, pooled: bool = True):
        self.streams = streams
        self.pooled = pooled
        self.free_event = None  # recorded on the consumer's stream after its copies out of the slot
        self._buffers: dict[str, torch.Tensor] = {}

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A pinned view of `shape`, reusing the slot's buffer while it is large enough
        (grown to the next power of two otherwise). Call `wait_free` first for buffers a
        queued copy may read."""
        need = 1
        for s in shape:
            need *= s
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < need or buf.dtype != dtype:
            cap = 1 << max(need - 1, 1).bit_length()
            buf = self.streams.pinned_empty((cap,), dtype)
            self._buffers[name] = buf
        return buf[:need].view(shape)

    def wait_free(self) -> None:
        """On the host (a worker thread): until the GPU is done copying out of this slot."""
        event, self.free_event = self.free_event, None
        if event is not None:
            self.streams.synchronize_event(event)


class StagingPool:
    """Two pooled slots per store, handed out round robin; temporaries when both are busy."""

    def __init__(self, streams, slots: int = 2):
        self.streams = streams
        self._slots = [StagingSlot(streams) for _ in range(slots)]
        self._busy: set[int] = set()
        self._next = 0
        self._lock = threading.Lock()
        self.temporaries = 0  # slots made because every pooled one was busy

    def acquire(self) -> StagingSlot:
        with self._lock:
            for k in range(len(self._slots)):
                i = (self._next + k) % len(self._slots)
                if i not in self._busy:
                    self._busy.add(i)
                    self._next = i + 1
                    return self._slots[i]
            self.temporaries += 1
        return StagingSlot(self.streams, pooled=False)

    def free(self, slot: StagingSlot, event: Optional[object] = None) -> None:
        """The slot's handle is done; `event` (if any) marks the end of the copies out of it."""
        if event is not None:
            slot.free_event = event
        if not slot.pooled:
            return
        with self._lock:
            self._busy.discard(next(i for i, s in enumerate(self._slots) if s is slot))
