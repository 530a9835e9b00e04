"""sglang.srt.model_executor.model_runner: per-KV-slot Engram state allocated with the KV pool,
and the stores' host work run between forward steps."""

from __future__ import annotations

import sys

from .targets import Target

MODULE = "sglang.srt.model_executor.model_runner"


def init_post_memory_pool_components(original, self, *args, **kwargs):
    """Per-KV-slot Engram state is allocated once the KV pool exists: before the attention
    backends and before any CUDA graph is captured (never inside a capture)."""
    out = original(self, *args, **kwargs)
    init = getattr(getattr(self, "model", None), "init_engram_buffers", None)
    if callable(init):
        init(self.token_to_kv_pool)
    return out


def forward(original, self, *args, **kwargs):
    """Host work of the stores (hot-row cache admission, statistics from device counters,
    the stats file) runs after each forward step, never inside it: `ModelRunner.forward`
    runs for eager and replayed steps alike and is never captured (SGLang captures the
    model's forward), so replays count and no capture ever syncs (core/stores/maintenance.py)."""
    out = original(self, *args, **kwargs)
    # Every store registers there when it opens: not imported yet, nothing to do (a
    # model without Engram layers never imports the stores).
    steps = sys.modules.get("engram_sglang.core.stores.maintenance")
    if steps is not None:
        steps.between_steps()
    return out


TARGETS = (
    Target(MODULE, "ModelRunner._init_post_memory_pool_components", "wrap", init_post_memory_pool_components),
    Target(MODULE, "ModelRunner.forward", "wrap", forward),
)
