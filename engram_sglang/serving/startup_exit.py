"""A scheduler's start-up error, ended as one line and exit status 2 instead of SGLang's way.

SGLang's scheduler logs an exception from its construction inside a traceback of ~100 lines,
then sends its launcher SIGQUIT, whose handler SIGKILLs the whole tree, itself included: the
server exits with status 137 and the one line that says what to fix is lost in the middle.
For an EngramError the plugin instead

* in the scheduler process (plugin/scheduler.py, around `Scheduler.__init__`): leaves the
  error's line for the process that launched it (`report`) and exits with status 2, quietly
  (SystemExit: multiprocessing prints nothing for it, SGLang's `except Exception` misses it);
* in that launcher (plugin/engine.py, around `_wait_for_scheduler_ready`, which notices the
  dead scheduler within 5 s): prints the line last, as `engram-sglang: error: ...`, and exits
  with status 2 where it runs as SGLang's command line (`python -m sglang.launch_server`,
  `sglang serve`), whose `finally` ends the other processes; a program that embeds
  `sglang.Engine` gets the EngramError raised instead.

The line travels in a 0600 file in the temporary directory named by both PIDs. A scheduler
whose launcher is not SGLang's main process (a data-parallel controller) still exits quietly
with status 2 after its line; that controller may then end the tree SGLang's way.
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import Iterable, Optional

from .launch import ERROR_MARK  # the launcher reads the last such line as the failure

STATUS = 2  # what `engram-sglang` and the plugin's flag errors exit with (docs/operations.md)


def _path(launcher: int, scheduler: int) -> Path:
    return Path(tempfile.gettempdir()) / f"engram-sglang-start-up-{launcher}-{scheduler}.err"


def in_child_process() -> bool:
    """Whether this process was started by multiprocessing (as SGLang starts its schedulers)."""
    import multiprocessing

    return multiprocessing.parent_process() is not None


def report(error: BaseException) -> None:
    """In a scheduler: leave the error's first line for the launching process; never raises."""
    path = _path(os.getppid(), os.getpid())
    line = (str(error).strip().splitlines() or [type(error).__name__])[0]
    try:
        path.unlink(missing_ok=True)  # a file left by an earlier process of this PID
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(line)
    except OSError:
        pass  # the launcher then ends the tree SGLang's way; the line is in the log all the same


def reported(schedulers: Iterable[int]) -> Optional[str]:
    """In the launcher: the first line one of these scheduler PIDs left (all of them removed)."""
    found = None
    for pid in schedulers:
        path = _path(os.getpid(), pid)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():  # another user's file says nothing
                text = os.read(fd, 1 << 16).decode(errors="replace").strip()
                if text and found is None:
                    found = text.splitlines()[0]
        finally:
            os.close(fd)
        try:
            path.unlink()
        except OSError:
            pass
    return found


def on_command_line() -> bool:
    """Whether this process is SGLang's command line (`python -m sglang.launch_server`, `sglang
    serve`), not a program that embeds its Engine."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return (spec is not None and spec.name in ("sglang.launch_server", "sglang.cli.main")) or \
        Path(sys.argv[0] if sys.argv else "").name == "sglang"


def stop(line: str):
    """End the launcher on a scheduler's reported line: one line and SystemExit(2) on the
    command line, else the EngramError (never returns)."""
    from ..core.errors import EngramError

    if on_command_line():
        print(f"{ERROR_MARK}{line}", file=sys.stderr, flush=True)
        raise SystemExit(STATUS)
    raise EngramError(line)
