"""The hidden directories writers work in (`.engram-HASH.writing-PID-XXXX`, beside the target):
each writer holds an flock on its own for as long as it writes, and a later write into the
same target removes those of writers that are gone (killed: SIGTERM from a Job's deadline,
SIGKILL, a node lost), which would otherwise hold up to the whole table's size on the disk.

A directory counts as its writer's while the lock is held (flock is released when a process
dies, in any PID namespace) or while its PID is alive and started before the directory last
changed (the moment between mkdtemp and the lock; a container's PID 1 is the PID of the next
run too, started after). Nothing is resumed: see docs/operations.md, "Converting"."""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)


def hold(path: Path) -> int:
    """Lock the writer's own directory for as long as the returned descriptor is open."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:  # ENOLCK: a filesystem without locks; the PID still marks it as ours
        pass
    return fd


def reclaim(parent: Path, stem: str) -> list[Path]:
    """Remove the `{stem}writing-PID-*` directories in `parent` that no live writer holds;
    one INFO line each. Returns those removed."""
    pattern = re.compile(re.escape(stem) + r"writing-(\d+)-.+")
    try:
        names = sorted(os.listdir(parent))
    except OSError:  # no parent yet, unreadable: the writer's own errors say so
        return []
    removed = []
    for name in names:
        m = pattern.fullmatch(name)
        if m is None:
            continue
        path = parent / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # gone meanwhile, or not a directory we made
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its writer is at work
            except OSError:
                pass  # no locks on this filesystem: the PID alone says
            pid, st = int(m.group(1)), os.fstat(fd)
            if _alive_since(pid, st.st_ctime):
                continue
            nbytes = _size(path)
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.lexists(path):
                removed.append(path)
                logger.info(f"{path}: removed, the partial tables of a write that is no longer running "
                            f"(process {pid}, {nbytes / 2**30:.2f} GiB)")
        finally:
            os.close(fd)
    return removed


def _alive_since(pid: int, changed: float) -> bool:
    """Is `pid` alive and started before `changed` (epoch s)? A PID reused since is not the writer."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    started = _started_at(pid)
    return started is None or started <= changed + 2.0  # (btime and the clock tick are coarse)


def _started_at(pid: int) -> Optional[float]:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(text[text.rindex(")") + 2 :].split()[19])  # field 22, starttime
        boot = next(float(ln.split()[1]) for ln in Path("/proc/stat").read_text().splitlines() if ln.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total
