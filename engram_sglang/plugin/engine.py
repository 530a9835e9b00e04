"""sglang.srt.entrypoints.engine: a scheduler that stopped start-up on an EngramError (its line
left by plugin/scheduler.py) ends the launcher with that line and exit status 2, where SGLang
would raise "scheduler died" from `_wait_for_scheduler_ready` (serving/startup_exit.py)."""

from __future__ import annotations

import functools

from .targets import Target

MODULE = "sglang.srt.entrypoints.engine"


def wait_for_scheduler_ready(original):
    @functools.wraps(original)
    def wait(scheduler_pipe_readers, scheduler_procs, *args, **kwargs):
        try:
            return original(scheduler_pipe_readers, scheduler_procs, *args, **kwargs)
        except RuntimeError:
            from ..serving import startup_exit

            line = startup_exit.reported(p.pid for p in scheduler_procs if p.pid is not None)
            if line is None:
                raise
            startup_exit.stop(line)

    return wait


TARGETS = (Target(MODULE, "_wait_for_scheduler_ready", "replace", wait_for_scheduler_ready),)
