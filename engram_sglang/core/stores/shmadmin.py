"""`engram-sglang shm ls|rm`: the node's shared table copies (stores/shmcopy.py), as an
operator sees them: which exist, who holds them, and removing one nobody uses."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Optional

from ..errors import EngramError
from .shmcopy import _TMP, NAME, _open, _try_exclusive, filler_alive, lock, lock_holders, scan, sidecars


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
            entry.update(filler=pid, filler_alive=filler_alive(pid, st))
        out.append(entry)
    return out


def unheld(directory: Path) -> list[tuple[Path, int]]:
    """(path, bytes of memory) of what `shm prune` would free in `directory` that is worth
    naming: copies of this user that no process holds (neither `.users` nor `.lock` in
    /proc/locks) and fills of dead processes. Read from /proc/locks, taking no lock: safe
    while other ranks open their copies. [] where the directory or /proc/locks is unreadable."""
    out = []
    try:
        found = list(scan(directory, NAME, _TMP))
    except OSError:
        return out
    for p, st, match in found:
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            continue  # not one this user's servers could have left
        if match.re is _TMP:
            if filler_alive(int(match.group(2)), st):
                continue
        elif any(lock_holders(f) != [] for f in sidecars(p)):  # held, being opened, or unknown
            continue
        out.append((p, st.st_blocks * 512))
    return out


def describe_unheld(directory: Path, entries: list[tuple[Path, int]], most: int = 4) -> str:
    """What `unheld` found, as a clause of one log line."""
    if not entries:
        return f"no copy in {directory} is unheld (its space is in use)"
    names = ", ".join(f"{p.name} ({_size(n)})" for p, n in entries[:most])
    more = f" and {len(entries) - most} more" if len(entries) > most else ""
    return (f"{len(entries)} unheld file(s) in {directory}, {_size(sum(n for _, n in entries))}, which "
            f"`engram-sglang shm prune --shm-dir {directory}` would free: {names}{more}")


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


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
        if filler_alive(pid, st) and not force:
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


def table_identities(table_dir: Path) -> dict[int, str]:
    """Layer id -> the identity its shared copy is named by, for the tables in `table_dir`."""
    from ..tablefile import read_manifest
    from .shmcopy import identity

    manifest, layers = read_manifest(table_dir)
    chunk_rows = int(manifest["chunk_rows"])
    return {L: identity(L, info.rows, chunk_rows, tuple(info.checksums)) for L, info in layers.items()}


def _unheld(file: Path) -> bool:
    """Nobody holds a flock on `file` (missing: nobody); the probe's own lock goes with its fd."""
    try:
        fd = _open(file, os.O_RDWR)
    except FileNotFoundError:
        return True
    except EngramError:  # not a 0600 file of this user: not ours to judge (`shm rm` says why)
        return False
    try:
        return _try_exclusive(fd)
    finally:
        os.close(fd)


def prune(directory: Path, *, older_than: Optional[float] = None, current: Optional[dict[int, str]] = None,
          dry_run: bool = False, now: Optional[float] = None) -> list[tuple[Path, int, str]]:
    """Remove what no process uses: copies nobody holds (no flock on `.users`, none on `.lock`)
    that match the selection, fills of dead processes, sidecars without a copy nobody holds.
    The selection of copies: all, or with `older_than` (seconds since the fill) and/or
    `current` (layer -> identity of a table directory: another version of its layers) those
    matching either. Returns (path, bytes, why) of each removal (of each it would make when
    `dry_run`); copies in use are never touched."""
    import time

    now = time.time() if now is None else now
    out = []
    for p, st, match in scan(directory, NAME, _TMP, SIDECAR):
        if not stat.S_ISREG(st.st_mode):
            continue  # `shm rm` says what to do with it
        why = None
        if match.re is _TMP:
            pid = int(match.group(2))
            if not filler_alive(pid, st):
                why = f"a fill that did not finish (process {pid} is gone)"
        elif match.re is SIDECAR:
            if not os.path.lexists(directory / p.name[: -len(match["sidecar"]) - 1]) and _unheld(p):
                why = f"a {match['sidecar']} sidecar without a copy"
        else:
            why = _copy_selected(match, st, older_than, current, now)
            if why is not None and not (_unheld(sidecars(p)[1]) and _unheld(sidecars(p)[0])):
                why = None  # a server holds it, or is opening or checking it
        if why is None:
            continue
        if not dry_run and not _prune_one(p, match):
            continue
        out.append((p, st.st_size, why))
    return out


def _copy_selected(match: re.Match, st: os.stat_result, older_than, current, now) -> Optional[str]:
    if older_than is None and current is None:
        return "no server holds it"
    layer = int(match["layer"])
    if current is not None and layer in current and match["identity"] != current[layer]:
        return f"no server holds it, another version of layer {layer} than the table directory's"
    if older_than is not None and now - st.st_mtime >= older_than:
        return f"no server holds it, filled {(now - st.st_mtime) / 3600:.1f} h ago"
    return None


def _prune_one(p: Path, match: re.Match) -> bool:
    """Remove one entry prune chose, checked again under the copy's lock for a copy."""
    if match.re is not NAME:
        try:
            p.unlink()
        except FileNotFoundError:
            return False
        return True
    lock_fd = lock(p, blocking=False)
    if lock_fd is None:
        return False
    try:
        if not _unheld(sidecars(p)[1]):
            return False
        p.unlink(missing_ok=True)
        sidecars(p)[1].unlink(missing_ok=True)
        sidecars(p)[0].unlink(missing_ok=True)  # while held: see shmcopy.lock()
    finally:
        os.close(lock_fd)
    return True
