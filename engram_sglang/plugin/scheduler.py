"""sglang.srt.managers.scheduler: around each batch the scheduler runs, in this order,

1. the batch's Engram modes recorded per request slot (its forward asks for them:
   serving/modes.py);
2. the next chunk of a chunked prefill read ahead into the disk tier's DRAM row cache
   (serving/readahead.py);
3. the batch runs;
4. the requests whose rows could not be read aborted, with a reason naming the table
   (serving/faults.py).

One wrapper, so the order is written here and nowhere else.

And around the scheduler's construction: an EngramError there (the tables, the flags) ends the
scheduler with its one line and exit status 2, not inside SGLang's traceback and SIGKILL of the
tree (serving/startup_exit.py).
"""

from __future__ import annotations

from .targets import Target

MODULE = "sglang.srt.managers.scheduler"
_settings = []  # read on the first batch, in the scheduler's process (the flags are exported by then)


def run_batch(original, self, batch, *args, **kwargs):
    from ..serving import faults, modes, readahead

    if not _settings:
        _settings.append(modes.server_settings())
    modes.record_batch(batch, _settings[0])
    readahead.read_ahead_next_chunk(self, batch)
    result = original(self, batch, *args, **kwargs)
    faults.abort_failed_requests(self, batch)
    return result


def scheduler_init(original, self, *args, **kwargs):
    from ..core.errors import EngramError
    from ..serving import startup_exit

    try:
        return original(self, *args, **kwargs)
    except EngramError as e:
        if not startup_exit.in_child_process():  # a scheduler built in-process: its caller decides
            raise
        startup_exit.report(e)
        raise SystemExit(startup_exit.STATUS) from None


TARGETS = (Target(MODULE, "Scheduler.run_batch", "wrap", run_batch),
           Target(MODULE, "Scheduler.__init__", "wrap", scheduler_init))
