"""A failing stats file or trace (full disk, EIO, ...) never raises into the scheduler."""

import logging
import os
import types

import pytest
import torch

from engram_sglang.serving.runtime import EngramRuntime, WriteGuard, _TraceWriter

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full for a real ENOSPC")


def _step():
    return types.SimpleNamespace(
        mode="on", on=None, token_req=torch.tensor([0]), positions=torch.tensor([0]),
        input_ids=torch.tensor([5]), hash_ids=torch.zeros(1, 1, dtype=torch.long), rows={}, windows={},
    )


def test_trace_on_full_disk_warns_and_goes_on(tmp_path, caplog):
    target = tmp_path / "trace.jsonl"
    target.symlink_to("/dev/full")
    w = _TraceWriter(str(target))
    with caplog.at_level(logging.INFO, logger="engram_sglang.serving.runtime"):
        w.write(_step(), [1])
        w.write(_step(), [1])  # within the minute: counted, not logged
        target.unlink()
        w.write(_step(), [1])
    msgs = [r.getMessage() for r in caplog.records]
    assert len([m for m in msgs if "ENOSPC" in m and str(target) in m]) == 1
    assert any(f"writes to {target} resumed" in m for m in msgs)
    assert target.read_text().count("\n") == 1


def test_stats_temp_on_full_disk_is_removed(tmp_path, caplog):
    target = tmp_path / "stats.json"
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tmp.symlink_to("/dev/full")
    fake = types.SimpleNamespace(_stats_path=target, _stats_guard=WriteGuard(target), stats=lambda: {"a": 1})
    with caplog.at_level(logging.WARNING, logger="engram_sglang.serving.runtime"):
        EngramRuntime.write_stats(fake)
    assert not os.path.lexists(tmp) and not target.exists()
    assert any("ENOSPC" in r.getMessage() for r in caplog.records)
    EngramRuntime.write_stats(fake)
    assert target.read_text().startswith("{")


def test_warning_rate_limit_counts_dropped(tmp_path, caplog):
    now = [0.0]
    g = WriteGuard(tmp_path / "x", interval=60.0, clock=lambda: now[0])
    err = OSError(28, "No space left on device")
    with caplog.at_level(logging.WARNING, logger="engram_sglang.serving.runtime"):
        for t in (0.0, 10.0, 30.0, 61.0):
            now[0] = t
            g.failed(err)
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2 and "2 more writes dropped" in msgs[1]
