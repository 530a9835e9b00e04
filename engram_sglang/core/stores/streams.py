"""The few GPU stream operations the stores use, behind one object.

Every tensor that crosses streams is ordered by an event and kept alive on the stream
that reads it (`record_stream`); a worker thread never touches a stream at all except to
wait, on the host, for an event that says its input is ready. Keeping these calls in one
place lets the tests replace them by a recording fake (tests/support/fake_streams.py) that runs
the GPU code paths on the CPU and checks the order, which no CPU run could otherwise show.

`for_device(device)` returns the real operations for a CUDA/HIP device (ROCm's torch
spells HIP as `torch.cuda`) and None for the CPU, where prefetch runs on a worker thread.
"""

from __future__ import annotations

from typing import Optional

import torch


class CudaStreams:
    """torch.cuda's streams and events for one device."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    def current(self):
        return torch.cuda.current_stream(self.device)

    def set_device(self) -> None:
        """Make this device the calling thread's current one (a worker thread's first call)."""
        torch.cuda.set_device(self.device)

    def new_stream(self):
        return torch.cuda.Stream(device=self.device)

    def use(self, stream):
        return torch.cuda.stream(stream)

    def wait_stream(self, waiter, waitee) -> None:
        """`waiter` runs what is queued after this only once `waitee`'s queued work is done."""
        waiter.wait_stream(waitee)

    def record_event(self, stream):
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait_event(self, stream, event) -> None:
        stream.wait_event(event)

    def event_done(self, event) -> bool:
        """Whether the work before `event` has finished (never waits)."""
        return event.query()

    def synchronize_event(self, event) -> None:
        """The host waits (a worker thread, never the forward)."""
        event.synchronize()

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        tensor.record_stream(stream)

    def pinned_empty(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Queue a device-to-host copy into pinned `dst` on the current stream."""
        dst.copy_(src, non_blocking=True)

    def to_device(self, src: torch.Tensor) -> torch.Tensor:
        """Queue a host-to-device copy of pinned `src` on the current stream."""
        return src.to(self.device, non_blocking=True)

    def on_device(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda"


def for_device(device: torch.device) -> Optional[CudaStreams]:
    device = torch.device(device)
    return CudaStreams(device) if device.type == "cuda" else None
