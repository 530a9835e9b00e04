"""The commands' output targets (--out, --trace, --json, --png, --gate-stats, demo-model's
DIR), checked before a run starts: a run of minutes must not end in "cannot write", and a
directory named as a file is refused rather than written beside (DIR.npz, DIR.png).

Each problem is an EngramError with one line naming the flag, the path and what to do.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..core.errors import EngramError


def _nearest_existing(path: Path) -> Path:
    """`path` or its closest ancestor that exists (Path(".") for a relative name)."""
    for p in (path, *path.parents):
        if os.path.lexists(p):
            return p
    return Path(".")


def check_output(path: str | os.PathLike, flag: str, *, directory: bool = False, parents: bool = False) -> Path:
    """Refuse an output target that the run could not write: its parent missing (unless
    `parents`: the command creates it), not a directory, or not writable; the target itself
    a directory (a file target) or a non-directory (a `directory` target). Returns the path."""
    path = Path(path)
    where = f"{flag} {path}" if flag else str(path)
    if directory:
        if os.path.lexists(path) and not path.is_dir():
            raise EngramError(f"{where}: exists and is not a directory; name a directory (or remove the file)")
    elif path.is_dir():
        raise EngramError(f"{where}: is a directory; name a file to write (e.g. {path / 'out'})")
    parent = path.parent
    anc = _nearest_existing(parent)
    if not anc.is_dir():
        raise EngramError(f"{where}: {anc} is not a directory; name a path in a directory")
    if anc != parent and not parents:
        raise EngramError(f"{where}: no such directory {parent}; create it first (mkdir -p {parent})")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise EngramError(f"{where}: cannot write in {anc} (not writable: permissions or a read-only filesystem)")
    return path
