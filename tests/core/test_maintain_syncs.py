"""Maintenance of a device or host store without a cache never waits on the forward stream:
its served-rows counter reaches the host through a pinned copy behind an event, read at a later
maintenance once that event has passed (a `.tolist()` every 8th step stalled the scheduler).
Proven on the CPU with recording fake streams and a device counter that records host reads."""

from __future__ import annotations

import pytest
import torch

from engram_sglang.core.stores import maintenance, open_store
from tests.support.fake_streams import RecordingStreams
from tests.support.tables import random_table_dir, small_config

CFG = small_config(400)
HOST_READS = ("tolist", "item", "__int__", "__bool__", "__float__", "__index__", "cpu", "numpy", "equal")


class DeviceCounter(torch.Tensor):
    """A device tensor stand-in: every read of its values on the host is recorded."""

    reads: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            cls.reads.append(func.__name__)
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("placement", ["device", "host"])
def test_sixteen_steps_read_no_device_counter_on_the_host(tmp_path, placement):
    root, _ = random_table_dir(tmp_path, CFG)
    stores = open_store(root, placement, cfg=CFG)
    streams = RecordingStreams()
    try:
        for store in stores.values():
            store._streams = streams
            store._counts = store._counts.as_subclass(DeviceCounter)
        DeviceCounter.reads = []
        ids = torch.arange(24).view(4, 6)
        for _ in range(16):
            for store in stores.values():
                store.gather(ids)
            maintenance.between_steps()
        assert DeviceCounter.reads == [], f"host syncs in 16 steps: {DeviceCounter.reads}"
        assert streams.ops("to_host") and streams.ops("event_done")
        # The GPU catches up: a maintenance publishes the copy the 8th step queued (the 16th
        # found it in flight), the next one the 16th's: every row served.
        for published in (8, 16):
            streams.flush()
            for store in stores.values():
                store.maintain()
                assert store._published_rows == published * ids.numel()
        assert DeviceCounter.reads == []
    finally:
        for store in stores.values():
            store.close()
