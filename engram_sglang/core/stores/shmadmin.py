"""`engram-sglang shm ls|rm`: the node's shared table copies (stores/shmcopy.py), as an
operator sees them: which exist, who holds them, and removing one nobody uses."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Optional

from ..errors import EngramError
from .shmcopy import _TMP, NAME, _open, _pid_alive, _try_exclusive, lock, lock_holders, scan, sidecars


def holders(path: Path) -> Optional[list[int]]:
    """PIDs holding a copy (its `.users` flocks, from /proc/locks); None when that is unknown."""
    return lock_holders(sidecars(path)[1])


def list_copies(directory: Path) -> list[dict]:
    """The shared copies in `directory` and the leftovers of fills, for `engram-sglang shm ls`."""
    out = []
    for p, st, match in scan(directory, NAME, _TMP):
        m, t = (match, None) if match.re is NAME else (None, match)
        entry = {"name": p.name, "bytes": st.st_size, "regular": stat.S_ISREG(st.st_mode)}
        copy = m if m is not None else NAME.match(t.group(1))
        # numa: the node the copy is bound to (node1), interleave, or "-" where it is not bound
        entry.update(identity=copy["identity"], layer=int(copy["layer"]), numa=copy["numa"] or "-")
        if m is not None:
            entry.update(holders=holders(p))
        else:
            pid = int(t.group(2))
            entry.update(filler=pid, filler_alive=_pid_alive(pid))
        out.append(entry)
    return out


def remove_copy(directory: Path, name: str, force: bool = False) -> int:
    """Remove a copy (and its sidecars) or a fill's leftover by name; bytes freed. A copy a
    running server holds is refused unless `force` (that server keeps its mapping: the memory
    is freed when it exits)."""
    if Path(name).name != name or not (NAME.match(name) or _TMP.match(name)):
        raise EngramError(f"{name}: not the name of a shared copy (engram-IDENTITY[-NUMA]-layerL.rows, as `shm ls` "
                          f"lists)")
    path = directory / name
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise EngramError(f"{path}: no such shared copy") from None
    t = _TMP.match(name)
    if t is not None:
        pid = int(t.group(2))
        if _pid_alive(pid) and not force:
            raise EngramError(f"{path}: process {pid}, which may still be filling it, is alive; pass --force to remove it")
        path.unlink()
        return st.st_size
    lock_fd = lock(path)
    try:
        users = None
        try:
            users = _open(sidecars(path)[1], os.O_RDWR)
        except FileNotFoundError:
            pass
        try:
            if users is not None and not _try_exclusive(users) and not force:
                who = holders(path)
                pids = f" (processes {', '.join(map(str, who))})" if who else ""
                raise EngramError(f"{path}: in use by a running server{pids}; stop it first, or pass --force")
        finally:
            if users is not None:
                os.close(users)
        path.unlink()
        sidecars(path)[1].unlink(missing_ok=True)
        sidecars(path)[0].unlink(missing_ok=True)
    finally:
        os.close(lock_fd)
    return st.st_size
