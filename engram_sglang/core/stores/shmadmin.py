"""`engram-sglang shm ls|rm`: the node's shared table copies (stores/shmcopy.py), as an
operator sees them: which exist, who holds them, and removing one nobody uses."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Optional

from ..errors import EngramError
from .shmcopy import _TMP, NAME, _open, _pid_alive, _try_exclusive, lock, lock_holders, scan, sidecars


def holders(path: Path) -> Optional[list[int]]:
    """PIDs holding a copy (its `.users` flocks, from /proc/locks); None when that is unknown."""
    return lock_holders(sidecars(path)[1])


# A copy's `.lock`/`.users`, listed where its copy is missing: left by a failed open of an
# older version, or in use by a fill in progress (the copy appears when it is complete).
SIDECAR = re.compile(NAME.pattern.rstrip("$") + r"\.(?P<sidecar>lock|users)$")


def list_copies(directory: Path) -> list[dict]:
    """The shared copies in `directory`, the leftovers of fills and the sidecars without a
    copy, for `engram-sglang shm ls`."""
    out = []
    for p, st, match in scan(directory, NAME, _TMP, SIDECAR):
        entry = {"name": p.name, "bytes": st.st_size, "regular": stat.S_ISREG(st.st_mode)}
        if match.re is SIDECAR:
            if os.path.lexists(directory / p.name[: -len(match["sidecar"]) - 1]):
                continue  # the copy's own: listed with it
            entry.update(identity=match["identity"], layer=int(match["layer"]), numa=match["numa"] or "-",
                         sidecar=match["sidecar"], holders=lock_holders(p))
            out.append(entry)
            continue
        m, t = (match, None) if match.re is NAME else (None, match)
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
    """Remove a copy (and its sidecars), a fill's leftover or a sidecar without a copy by
    name; bytes freed. A copy a running server holds is refused unless `force` (that server
    keeps its mapping: the memory is freed when it exits)."""
    if Path(name).name != name or not (NAME.match(name) or _TMP.match(name) or SIDECAR.match(name)):
        raise EngramError(f"{name}: not the name of a shared copy (engram-IDENTITY[-NUMA]-layerL.rows, as `shm ls` "
                          f"lists)")
    path = directory / name
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise EngramError(f"{path}: no such shared copy") from None
    if stat.S_ISDIR(st.st_mode):
        raise EngramError(f"{path}: is a directory, not a shared copy; remove it yourself if it is yours (rm -r)")
    if not stat.S_ISREG(st.st_mode):  # a link or FIFO at the name, refused by the servers: the name goes
        path.unlink()
        return 0
    t = _TMP.match(name)
    if t is not None:
        pid = int(t.group(2))
        if _pid_alive(pid) and not force:
            raise EngramError(f"{path}: process {pid}, which may still be filling it, is alive; pass --force to remove it")
        path.unlink()
        return st.st_size
    if SIDECAR.match(name):
        return _remove_sidecar(path, st, force)
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


def _remove_sidecar(path: Path, st: os.stat_result, force: bool) -> int:
    """A `.lock`/`.users` whose copy is missing, unless a process holds it (a fill in progress)."""
    copy = Path(str(path).rsplit(".", 1)[0])
    if os.path.lexists(copy):
        raise EngramError(f"{path}: a sidecar of the copy {copy.name}, which is there; remove the copy instead "
                          f"(shm rm {copy.name})")
    fd = _open(path, os.O_RDWR)
    try:
        if not _try_exclusive(fd) and not force:
            who = lock_holders(path)
            pids = f" (processes {', '.join(map(str, who))})" if who else ""
            raise EngramError(f"{path}: held by a server filling or opening the copy{pids}; wait for it, or pass --force")
        path.unlink()  # while held: see shmcopy.lock()
    finally:
        os.close(fd)
    return st.st_size
