"""A recording stand-in for the GPU stream operations (engram_sglang/core/stores/streams.py).

No GPU exists here, so the GPU code paths of the stores run on CPU tensors with this fake
swapped in for `store._streams`. It is a mock of what cannot exist on this machine, and it
is built to make ordering mistakes visible, not to be lenient:

* every call is logged with the calling thread and the stream it names;
* a device-to-host copy (`to_host`) is queued on the current stream and its destination is
  poisoned until the copy "runs": when an event recorded after it is synchronized or waited
  on, or the stream is flushed. A reader that does not wait for the event sees poison;
* a host-to-device copy (`to_device`) returns its data at once (the consumer's decode runs
  right after it, in stream order) but stays "in flight" until an event after it is
  synchronized or the stream is flushed; a write into its pinned source meanwhile is a
  hazard (the GPU would copy the new bytes), found by comparing a snapshot at completion;
* every tensor counts as a device tensor except pinned buffers made by `pinned_empty`.
"""

from __future__ import annotations

import contextlib
import threading

import torch

POISON = -0x5EED  # what a device-to-host destination holds before its copy ran


class FakeStream:
    def __init__(self, name: str):
        self.name = name
        self.queue: list = []  # pending copies: (kind, fn)
        self.done = 0  # queue entries run so far

    def __repr__(self):
        return f"<stream {self.name}>"


class FakeEvent:
    def __init__(self, stream: FakeStream, upto: int, seq: int):
        self.stream, self.upto, self.seq = stream, upto, seq

    def __repr__(self):
        return f"<event {self.seq} on {self.stream.name}>"


class RecordingStreams:
    def __init__(self):
        self.default = FakeStream("default")
        self.log: list[tuple] = []  # (op, thread name, details...)
        self.hazards: list[str] = []
        self.pinned: set[int] = set()
        self.skip_event_sync = False  # negative control: synchronize_event does nothing
        self._tls = threading.local()
        self._lock = threading.RLock()
        self._streams = 0
        self._events = 0

    # -------------------------------------------------------------- helpers
    def _stack(self):
        if not hasattr(self._tls, "stack"):
            self._tls.stack = [self.default]
        return self._tls.stack

    def _note(self, op, *details):
        self.log.append((op, threading.current_thread().name, *details))

    def _run(self, stream: FakeStream, upto: int) -> None:
        with self._lock:
            while stream.done < upto:
                _, fn = stream.queue[stream.done]
                fn()
                stream.done += 1

    def flush(self, stream: FakeStream | None = None) -> None:
        """The GPU catches up with everything queued (on one stream or all)."""
        for s in [stream] if stream else list(self._all):
            self._run(s, len(s.queue))

    @property
    def _all(self):
        return getattr(self, "_known", [self.default])

    def ops(self, op: str) -> list[tuple]:
        return [e for e in self.log if e[0] == op]

    # -------------------------------------------------------------- the API
    def current(self):
        return self._stack()[-1]

    def set_device(self) -> None:
        self._note("set_device")

    def new_stream(self):
        self._streams += 1
        s = FakeStream(f"side{self._streams}")
        self._known = [*self._all, s]
        self._note("new_stream", s)
        return s

    @contextlib.contextmanager
    def use(self, stream):
        if stream not in self._all:
            self._known = [*self._all, stream]
        self._stack().append(stream)
        self._note("use", stream)
        try:
            yield
        finally:
            self._stack().pop()

    def wait_stream(self, waiter, waitee) -> None:
        self._note("wait_stream", waiter, waitee)

    def record_event(self, stream):
        self._events += 1
        ev = FakeEvent(stream, len(stream.queue), self._events)
        self._note("record_event", stream, ev)
        return ev

    def wait_event(self, stream, event) -> None:
        self._note("wait_event", stream, event)
        self._run(event.stream, event.upto)

    def event_done(self, event) -> bool:
        self._note("event_done", event)
        return event.stream.done >= event.upto

    def synchronize_event(self, event) -> None:
        self._note("synchronize_event", event)
        if not self.skip_event_sync:
            self._run(event.stream, event.upto)

    def record_stream(self, tensor, stream) -> None:
        try:
            ptr = tensor.data_ptr()
        except RuntimeError:  # a fake tensor (tests/support/capture.py) has no storage
            ptr = id(tensor)
        self._note("record_stream", ptr, stream)

    def pinned_empty(self, shape, dtype):
        t = torch.empty(shape, dtype=dtype)
        self.pinned.add(t.data_ptr())
        self._note("pinned_empty", tuple(shape), dtype)
        return t

    def on_device(self, tensor) -> bool:
        return tensor.untyped_storage().data_ptr() not in self.pinned

    def to_host(self, src, dst) -> None:
        stream = self.current()
        self._note("to_host", stream, dst.data_ptr())
        value = src.detach().clone()
        dst.fill_(POISON)
        stream.queue.append(("to_host", lambda: dst.copy_(value)))

    def to_device(self, src):
        stream = self.current()
        self._note("to_device", stream, src.data_ptr())
        snapshot = src.clone()
        out = snapshot.clone()

        def complete():
            if not torch.equal(src, snapshot):
                self.hazards.append(f"pinned source {src.data_ptr():#x} was rewritten while its copy on "
                                    f"{stream.name} was in flight")

        stream.queue.append(("to_device", complete))
        return out
