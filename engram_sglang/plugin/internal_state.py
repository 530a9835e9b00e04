"""sglang.srt.managers.scheduler_components.internal_state: Engram table statistics in the
scheduler's internal state (`/server_info` -> `internal_states[i]["engram"]`)."""

from __future__ import annotations

from .targets import Target

MODULE = "sglang.srt.managers.scheduler_components.internal_state"


def get_internal_state(original, self, recv_req):
    out = original(self, recv_req)
    from ..serving.runtime import active_runtimes

    runtimes = active_runtimes()
    if runtimes and isinstance(getattr(out, "internal_state", None), dict):
        out.internal_state["engram"] = runtimes[0].stats()
    return out


TARGETS = (Target(MODULE, "SchedulerInternalStateController.get_internal_state", "wrap", get_internal_state),)
