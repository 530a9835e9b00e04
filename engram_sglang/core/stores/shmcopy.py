"""The node's shared copy of a layer table (host placement, shared on): one file in /dev/shm.

Trusted on its content, not on its name and size:

* named by the table content's identity (an xxh3 over the manifest's chunk checksums, the
  layer and its rows), so a copy made from other tables of the same config is never found;
* every file here (copy, `.lock`, `.users`, a fill's `.tmp.PID`) is opened with O_NOFOLLOW
  and must be a regular 0600 file of this user: a symlink is refused, never followed or
  created through;
* filled through a writable mapping of `NAME.tmp.PID`, renamed when complete, and served
  from a separate read-only mapping (a stray write faults instead of reaching every rank);
* a copy that no running server holds (kept by an operator, or left by a server that was
  killed) is checked against the manifest's checksums before it is served: start-up waits
  for the check, with progress lines; a mismatch is removed and filled again;
* leftover `.tmp.PID` files of crashed fills are removed: those of this copy under its lock
  (no fill can be running then), others when their PID is dead;
* reference counted by shared flocks on `NAME.users` (the kernel drops those of a dead
  process): the last server to close its store removes the copy unless told to keep it, also
  when it is stopped by SIGTERM or SIGHUP (a process group's stop: systemd, `kill -- -PGID`,
  Kubernetes), which would otherwise kill Python without its exit handlers (_release_on_signal).

On a hugetlbfs mount (`--engram-shm-dir` naming one: huge pages by construction, reserved
by the node's vm.nr_hugepages) the same copy is a file whose size is the layer's rounded up to
the mount's page size (statfs f_bsize, its pagesize=; the kernel refuses any other size and
any write(2)): allocated by fallocate, filled through the mapping, the rows past the table's
end left zero and never served. The same names, locks, checks and release.

Start-up fills or checks under `NAME.lock`: the first rank works while the others wait, with
a line every LOCK_LOG_SECONDS naming the holder, given up when it stalls (wait_flock). A
SIGTERM/SIGHUP during it unwinds the cleanup first (_unwind_on_signals).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import glob
import logging
import mmap
import os
import re
import signal
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from ..errors import EngramError
from ..fileio import kind_of
from ..rowformat import ROW_BYTES
from . import numa, thp

logger = logging.getLogger(__name__)

# engram-IDENTITY[-NUMA]-layerL.rows: NUMA is node<N> or interleave where the copy is bound (stores/numa.py).
NAME = re.compile(r"^engram-(?P<identity>[0-9a-f]{16})(?:-(?P<numa>node\d+|interleave))?-layer(?P<layer>\d+)\.rows$")
_TMP = re.compile(r"^(engram-[0-9a-f]{16}(?:-(?:node\d+|interleave))?-layer\d+\.rows)\.tmp\.(\d+)$")
PROGRESS_SECONDS = 5.0
_ALLOCATE_STEP = 1 << 30


def identity(layer_id: int, rows: int, chunk_rows: int, checksums: tuple[str, ...]) -> str:
    """16 hex digits naming a layer's rows by content (the manifest's xxh3 chunk checksums)."""
    import xxhash

    h = xxhash.xxh3_64(f"engram-sglang shared copy v1|{ROW_BYTES}|{layer_id}|{rows}|{chunk_rows}|".encode())
    h.update(",".join(checksums).encode())
    return h.hexdigest()


@dataclass(frozen=True)
class Spec:
    """What a shared copy must hold: a layer's rows as the manifest describes them."""

    directory: Path
    layer_id: int
    rows: int
    chunk_rows: int
    checksums: tuple[str, ...]
    keep: bool = False
    binding: Optional[numa.Binding] = None  # the NUMA policy it is filled under; its tag is in the name

    @property
    def path(self) -> Path:
        tag = self.binding.tag if self.binding is not None else None
        ident = identity(self.layer_id, self.rows, self.chunk_rows, self.checksums)
        return self.directory / f"engram-{ident}{f'-{tag}' if tag else ''}-layer{self.layer_id}.rows"

    @property
    def nbytes(self) -> int:
        return self.rows * ROW_BYTES


def huge_page_bytes(directory: Path) -> Optional[int]:
    """The page size of `directory` where it is on hugetlbfs (statfs f_bsize: the mount's
    pagesize=), None on any other file system (or where the mount table cannot tell)."""
    if thp.probe_dir(directory).fstype != "hugetlbfs":
        return None
    return os.statvfs(directory).f_bsize


def copy_bytes(nbytes: int, page: Optional[int]) -> int:
    """The size of a copy of `nbytes` of rows: rounded up to whole pages on hugetlbfs (`page`),
    where a file can have no other size, else exactly nbytes."""
    return -(-nbytes // page) * page if page else nbytes


def sidecars(path: Path) -> tuple[Path, Path]:
    """(lock, users) files of a copy."""
    return Path(f"{path}.lock"), Path(f"{path}.users")


def check_kinds(path: Path) -> None:
    """Refuse, in one line, anything but a regular file (or nothing) at a copy's names."""
    for p in (path, *sidecars(path)):
        try:
            mode = os.lstat(p).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(mode):
            raise EngramError(f"{p}: is a symbolic link, not a shared table file; refusing to follow it (remove it)")
        if not stat.S_ISREG(mode):
            raise EngramError(f"{p}: is {kind_of(mode)}, not a shared table file; remove it")


def _open(path: Path, flags: int) -> int:
    """A descriptor of `path`, never through a symlink (O_NOFOLLOW, also with O_CREAT), which
    must be a regular file owned by this user with mode 0600. FileNotFoundError passes."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise EngramError(f"{path}: is a symbolic link, not a shared table file; refusing to follow it "
                              f"(remove it)") from None
        if e.errno == errno.EISDIR:
            raise EngramError(f"{path}: is a directory, not a shared table file; remove it") from None
        raise EngramError(f"{path}: cannot open the shared table file ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise EngramError(f"{path}: is {kind_of(st.st_mode)}, not a shared table file; remove it")
        check_owner(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_owner(fd: int, path: Path) -> None:
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        raise EngramError(f"{path}: owned by uid {st.st_uid}, not by this process (uid {os.geteuid()}); refusing to map it")
    if st.st_mode & 0o077:
        raise EngramError(f"{path}: mode {oct(st.st_mode & 0o777)} lets other users read or write it; refusing to map it (want 0600)")


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_ino, st.st_dev) == (own.st_ino, own.st_dev)


def lock(path: Path, blocking: bool = True) -> Optional[int]:
    """Hold the copy's `.lock` (exclusive); None when not blocking and someone holds it. The
    last server to leave unlinks the lock file while it holds it: a lock won on an unlinked
    file guards nothing, so it is taken again on the file the name now holds. A blocking
    wait is `wait_flock`'s: a line every LOCK_LOG_SECONDS, a bound on a holder that stalls."""
    lock_path = sidecars(path)[0]
    while True:
        fd = _open(lock_path, os.O_RDWR | os.O_CREAT)
        try:
            if not _try_exclusive(fd):
                if not blocking:
                    os.close(fd)
                    return None
                wait_flock(fd, fcntl.LOCK_EX, lock_path, path)
        except BaseException:
            os.close(fd)
            raise
        if _same_file(fd, lock_path):
            return fd
        os.close(fd)


# A wait for a flock held by another process: one WARNING every LOCK_LOG_SECONDS (what, which
# PIDs), given up after LOCK_STALL_SECONDS without a sign of progress from the holder. Progress
# is any change of the lock file's mtime (a filler or checker beats every PROGRESS_SECONDS), of
# the copy's `.tmp.PID` files (allocated in steps) or of the holders' CPU time: a legitimate
# fill of any size never gives up, a frozen holder (SIGSTOP, cgroup freezer, `docker pause`, D
# state on a hung mount) fails start-up in 5 minutes: 60 missed beats, far above a slow chunk
# read or page reclaim, and short enough that a stuck node is noticed.
LOCK_LOG_SECONDS = 10.0
LOCK_STALL_SECONDS = 300.0
LOCK_POLL_SECONDS = 0.1


def wait_flock(fd: int, op: int, lock_path: Path, copy: Path) -> None:
    """Take flock `op` on fd by LOCK_NB polling (no thread), logging and bounded as above."""
    t0 = last_log = last_progress = time.monotonic()
    seen = None
    while True:
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        now = time.monotonic()
        pids = lock_holders(lock_path)
        mark = _progress_mark(lock_path, copy, pids)
        if mark != seen:
            seen, last_progress = mark, now
        if now - last_progress >= LOCK_STALL_SECONDS:
            raise EngramError(f"{lock_path}: held by {_describe(pids)} with no sign of progress for "
                              f"{now - last_progress:.0f} s (frozen, stopped or stuck on a hung mount?); resume it "
                              f"(kill -CONT) or stop it, then start again")
        if now - last_log >= LOCK_LOG_SECONDS:
            last_log = now
            logger.warning("engram: waiting %.0f s for %s (the shared copy %s), held by %s; giving up after %.0f s "
                           "without progress", now - t0, lock_path, copy, _describe(pids), LOCK_STALL_SECONDS)
        time.sleep(LOCK_POLL_SECONDS)


def lock_holders(file: Path) -> Optional[list[int]]:
    """PIDs holding a flock on `file` (from /proc/locks; waiters excluded); None when that
    is unknown (/proc/locks unreadable), [] when the file does not exist or nobody holds it."""
    try:
        st = os.lstat(file)
    except FileNotFoundError:
        return []
    try:
        text = Path("/proc/locks").read_text()
    except OSError:
        return None
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    for line in text.splitlines():
        f = line.split()
        if "->" in f:  # a waiter, not a holder
            continue
        if len(f) >= 6 and f[1] == "FLOCK" and f[5] == dev:
            pids.append(int(f[4]))
    return sorted(set(pids))


def _proc_stat(pid: int) -> Optional[list[str]]:
    """/proc/PID/stat's fields after the command name (state first), None when gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


_STATES = {"T": "stopped", "t": "stopped (traced)", "D": "in uninterruptible I/O", "Z": "exiting"}


def _describe(pids: Optional[list[int]]) -> str:
    if not pids:
        return "a process /proc/locks does not show (another PID namespace?)"
    parts = []
    for pid in pids:
        f = _proc_stat(pid)
        state = _STATES.get(f[0], "running") if f else "gone"
        parts.append(f"{pid} ({state})")
    return f"process{'es' if len(pids) > 1 else ''} {', '.join(parts)}"


def _progress_mark(lock_path: Path, copy: Path, pids: Optional[list[int]]) -> tuple:
    """What changes while the holder works: see LOCK_STALL_SECONDS."""
    files = []
    for p in (lock_path, *copy.parent.glob(f"{glob.escape(copy.name)}.tmp.*")):
        try:
            st = os.lstat(p)
            files.append((p.name, st.st_size, st.st_blocks, st.st_mtime_ns))
        except OSError:
            continue
    cpu = []
    for pid in pids or ():
        f = _proc_stat(pid)
        cpu.append((pid, f[11:13] if f else None))  # utime, stime
    return tuple(files), tuple(cpu)


def _try_exclusive(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _started_at(pid: int) -> Optional[float]:
    """When process `pid` started (epoch seconds), None when unknown."""
    f = _proc_stat(pid)
    try:
        boot = next(float(ln.split()[1]) for ln in Path("/proc/stat").read_text().splitlines() if ln.startswith("btime"))
        return boot + int(f[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, TypeError, IndexError, ValueError, StopIteration):
        return None


def filler_alive(pid: int, st: os.stat_result) -> bool:
    """Whether the process that made a `.tmp.PID` (whose lstat is `st`) may still be filling
    it: PID alive and started before the file's last inode change (its filler created and
    sized it after starting; a later process is the PID reused, common in containers)."""
    if not _pid_alive(pid):
        return False
    started = _started_at(pid)
    return started is None or started <= st.st_ctime + 2.0  # (btime and the tick are coarse)


def allocated_bytes(path: Path) -> int:
    """Memory already allocated to the copy at `path` and to fills of it in progress (so a
    rank deciding where its copy goes counts it as its own, not as memory used by others)."""
    total = 0
    try:
        candidates = [path, *path.parent.glob(f"{path.name}.tmp.*")]
    except OSError:  # not a directory, unreadable: the caller's checks say so in one line
        return 0
    for p in candidates:
        try:
            st = os.lstat(p)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            total += st.st_blocks * 512
    return total


def scan(directory: Path, *patterns: re.Pattern) -> Iterator[tuple[Path, os.stat_result, re.Match]]:
    """(path, lstat, match) of each entry of `directory`, in name order, whose name the first
    of `patterns` that does matches; an entry gone between the listing and its lstat (another
    server removed it) is skipped. The listing's OSError reaches the caller."""
    for name in sorted(os.listdir(directory)):
        m = next((m for m in (p.match(name) for p in patterns) if m is not None), None)
        if m is None:
            continue
        path = directory / name
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        yield path, st, m


def reclaim_leftovers(directory: Path, own: Optional[Path] = None) -> list[Path]:
    """Remove `.tmp.PID` files of crashed fills: those of `own` whatever their PID (the caller
    holds own's lock, under which every fill of it runs), others whose PID is dead."""
    removed = []
    try:
        found = list(scan(directory, _TMP))
    except OSError:
        return removed
    for p, st, m in found:
        if st.st_uid != os.geteuid():
            continue
        if (own is None or m.group(1) != own.name) and filler_alive(int(m.group(2)), st):
            continue
        try:
            p.unlink()
        except FileNotFoundError:
            continue
        removed.append(p)
        logger.warning("engram: removed %s (%.2f GiB), left by a fill that did not finish (process %s is gone)",
                       p, st.st_size / 2**30, m.group(2))
    return removed


def _drop_orphan_sidecars(path: Path, lock_fd: int) -> None:
    """After a failed open, under the lock: remove `.users` and `.lock` when no copy is there
    and no server holds it (a failed open must leave nothing behind); never raises."""
    lock_path, users_path = sidecars(path)
    try:
        if os.path.lexists(path):
            return
        try:
            users = _open(users_path, os.O_RDWR)
        except FileNotFoundError:
            users = None
        if users is not None:
            try:
                if not _try_exclusive(users):
                    return
                users_path.unlink(missing_ok=True)
            finally:
                os.close(users)
        if _same_file(lock_fd, lock_path):
            lock_path.unlink(missing_ok=True)  # while held: see lock()
    except (OSError, EngramError):
        logger.debug("engram: leaving the sidecars of %s", path, exc_info=True)


class _Interrupted(BaseException):
    """A terminating signal during a fill or check, raised so that the cleanup runs."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


_UNWOUND_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@contextlib.contextmanager
def _unwind_on_signals():
    """SIGTERM/SIGINT/SIGHUP whose action is the default (killing Python without unwinding)
    raise inside the block instead, so that its cleanup removes the fill's `.tmp.PID` and the
    sidecars; then the default action is taken again: the process dies with the signal's usual
    status. A Python handler (SIGINT's KeyboardInterrupt, SGLang's own) and an ignored signal
    are left as they are. Python handlers exist only in the main thread: elsewhere a signal
    kills the process as before and the next start or `shm prune` reclaims what it left."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []

    def handler(signum, frame):
        if not got:  # once: the cleanup itself is not interrupted again
            got.append(signum)
            raise _Interrupted(signum)

    previous = {s: signal.getsignal(s) for s in _UNWOUND_SIGNALS}
    # (over the release handler too: once unwound, raising the signal again runs it)
    installed = [s for s, h in previous.items() if h is signal.SIG_DFL or h is _release_on_signal]
    for s in installed:
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s in installed:
            signal.signal(s, previous[s])
        if got:
            logger.warning("engram: %s during the shared copy's fill or check: removed what it left; exiting",
                           signal.Signals(got[0]).name)
            signal.raise_signal(got[0])  # the default action (or the release handler), now restored


# SIGTERM/SIGHUP while copies are held (a server stopped by its process group: systemd's
# KillMode=control-group, `kill -- -PGID`, Kubernetes): release them, then the handler that was
# there before (the default action: the process dies by the signal). SIGINT's default raises
# KeyboardInterrupt, which unwinds to the exit handlers already. SIGKILL cannot be caught: a copy
# a killed server held stays until the next start of the same table checks and serves it, or
# `engram-sglang shm prune` removes it.
_RELEASED_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_CHAINED: dict[int, object] = {}  # signal -> the handler _release_on_signal replaced
RELEASE_LOCK_SECONDS = 2.0  # a copy's lock busy longer than this at a stop: left for the next start


def _release_on_signal(signum, frame) -> None:
    previous = _CHAINED.get(signum, signal.SIG_DFL)  # (the last release puts it back: read it first)
    _release_all(wait=RELEASE_LOCK_SECONDS)
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)


def _hold_signals(holding: bool) -> None:
    """Install _release_on_signal while this process holds a copy (over the default action
    or a Python handler, which it then calls; an ignored signal stays ignored), put back what
    was there when it holds none. Only the main thread can set handlers: elsewhere nothing."""
    if threading.current_thread() is not threading.main_thread():
        return
    for s in _RELEASED_SIGNALS:
        current = signal.getsignal(s)
        if holding and s not in _CHAINED and current not in (signal.SIG_IGN, None, _release_on_signal):
            _CHAINED[s] = current
            signal.signal(s, _release_on_signal)
        elif not holding and s in _CHAINED:
            previous = _CHAINED.pop(s)
            if current is _release_on_signal:  # else someone installed theirs over ours: leave it
                signal.signal(s, previous)


class _Progress:
    """Log lines (every PROGRESS_SECONDS) of bytes done and the rate: 189 GiB takes minutes."""

    def __init__(self, what: str, total: int, beat: Optional[Callable[[], None]] = None):
        self.what, self.total, self.beat = what, total, beat
        self.t0 = self.last = self.last_beat = time.monotonic()

    def __call__(self, done: int) -> None:
        now = time.monotonic()
        if self.beat is not None and now - self.last_beat >= 1.0:  # waiters see progress (wait_flock)
            self.last_beat = now
            self.beat()
        if now - self.last >= PROGRESS_SECONDS:
            self.last = now
            logger.info("engram: %s: %.2f of %.2f GiB (%.0f%%), %.2f GiB/s", self.what, done / 2**30,
                        self.total / 2**30, 100 * done / max(1, self.total), done / 2**30 / max(now - self.t0, 1e-9))

    def done(self) -> None:
        s = max(time.monotonic() - self.t0, 1e-9)
        logger.info("engram: %s: %.2f GiB in %.1f s (%.2f GiB/s)", self.what, self.total / 2**30, s,
                    self.total / 2**30 / s)


def verify(m, spec: Spec, progress: Optional[Callable[[int], None]] = None) -> Optional[int]:
    """The first chunk of the mapped copy whose xxh3 differs from the manifest's, or None."""
    import xxhash

    view = memoryview(m)
    try:
        for i, want in enumerate(spec.checksums):
            lo = i * spec.chunk_rows * ROW_BYTES
            hi = min(spec.rows, (i + 1) * spec.chunk_rows) * ROW_BYTES
            if xxhash.xxh3_64(view[lo:hi]).hexdigest() != want:
                return i
            if progress is not None:
                progress(hi)
    finally:
        view.release()
    return None


# Copies this process holds, released at exit (a server that returns from main) or by a
# terminating signal (_release_on_signal, which may interrupt the main thread inside the lock).
_OPEN: "set[SharedCopy]" = set()
_OPEN_LOCK = threading.RLock()


class SharedCopy:
    """This process's hold on the node's copy of one layer: a read-only mapping (`map`).

    `fill(mapping, progress)` writes nbytes of rows into a writable mapping (HostTable's
    loader); `advise(mapping)` asks for huge pages. On hugetlbfs the file and `map` are
    `size` bytes (nbytes rounded up to the mount's page size; the rest zero, never served).
    `how` says whether it was filled, checked or found in use by a running server. `read_only=False` serves a writable mapping: only for
    a GPU that cannot register read-only memory."""

    def __init__(self, spec: Spec, fill: Callable[[mmap.mmap, Callable[[int], None]], None],
                 advise: Callable[[mmap.mmap], None], read_only: bool = True):
        self.spec, self.path, self.nbytes = spec, spec.path, spec.nbytes
        self.page = huge_page_bytes(spec.directory)  # None: not hugetlbfs
        self.size = copy_bytes(self.nbytes, self.page)  # (an unaligned munmap of hugetlbfs fails: map it whole)
        self.read_only = read_only
        self._prot = mmap.PROT_READ if read_only else mmap.PROT_READ | mmap.PROT_WRITE
        self._flags = os.O_RDONLY if read_only else os.O_RDWR
        check_kinds(self.path)
        with _unwind_on_signals():
            self._open_under_lock(fill, advise)
        with _OPEN_LOCK:
            _OPEN.add(self)
            _hold_signals(True)
        logger.info("engram layer %d: shared copy %s %s", spec.layer_id, self.path, self.how)

    def _open_under_lock(self, fill, advise) -> None:
        lock_fd = lock(self.path)
        self._beat = lambda: os.utime(lock_fd)
        try:
            reclaim_leftovers(self.spec.directory, self.path)
            users = _open(sidecars(self.path)[1], os.O_RDWR | os.O_CREAT)
            try:
                self.map, self.how = self._open_or_fill(users, fill, advise)
                # held while mapped (exclusive after a check: downgraded)
                wait_flock(users, fcntl.LOCK_SH, sidecars(self.path)[1], self.path)
                fd = _open(self.path, os.O_RDONLY)
                try:
                    st = os.fstat(fd)
                    self._ident = (st.st_ino, st.st_dev)
                finally:
                    os.close(fd)
            except BaseException:
                os.close(users)
                raise
            self._users = users
        except BaseException:
            _drop_orphan_sidecars(self.path, lock_fd)
            raise
        finally:
            os.close(lock_fd)

    def _open_or_fill(self, users: int, fill, advise) -> tuple[mmap.mmap, str]:
        path, nbytes = self.path, self.size
        try:
            fd = _open(path, self._flags)
        except FileNotFoundError:
            fd = None
        if fd is not None:
            try:
                size = os.fstat(fd).st_size
                in_use = not _try_exclusive(users)
                if size != nbytes:
                    if in_use:
                        raise EngramError(f"{path}: shared table has {size} bytes, {nbytes} expected, and a running "
                                          f"server maps it; stop it, then remove the file")
                    bad = "its size"
                    m = None
                else:
                    m = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=self._prot)
                    advise(m)
                    if in_use:  # checked or filled by the running server that holds it
                        return m, "mapped (in use by a running server)"
                    progress = _Progress(f"layer {self.spec.layer_id}: checking {path}", nbytes, self._beat)
                    chunk = verify(m, self.spec, progress)
                    if chunk is None:
                        progress.done()
                        return m, "checked against the manifest's checksums (no running server held it)"
                    bad = f"chunk {chunk} (rows from {chunk * self.spec.chunk_rows})"
                    m.close()
            finally:
                os.close(fd)
            logger.warning("engram layer %d: %s does not match the table's manifest (%s): removing it and filling "
                           "it again", self.spec.layer_id, path, bad)
            path.unlink()
        return self._fill(fill, advise), "filled"

    def _fill(self, fill, advise) -> mmap.mmap:
        path, nbytes = self.path, self.size
        tmp = Path(f"{path}.tmp.{os.getpid()}")
        fd = _open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        try:
            os.ftruncate(fd, nbytes)  # sized, no page yet: the NUMA policy must come first
            writable = self._map_writable(fd, nbytes)
            try:
                advise(writable)
                # tmpfs keeps a shared mapping's policy with the file: fallocate and every rank's
                # later mapping get pages by it (hugetlbfs does not: see below).
                numa.bind(writable, self.spec.binding)
                # All pages now, so a full /dev/shm or NUMA node fails here, not in a page fault (on
                # hugetlbfs a SIGBUS). hugetlbfs's fallocate takes its pages by this thread's policy,
                # not the mapping's: the binding is set on the thread around it.
                try:
                    with numa.thread_policy(self.spec.binding if self.page else None):
                        for lo in range(0, nbytes, _ALLOCATE_STEP):  # in steps: waiters see the file grow
                            os.posix_fallocate(fd, lo, min(_ALLOCATE_STEP, nbytes - lo))
                            self._beat()
                except OSError as e:
                    if self.page and e.errno in (errno.ENOSPC, errno.ENOMEM):
                        raise EngramError(self._no_huge_pages(nbytes)) from None
                    if e.errno == errno.ENOSPC:
                        raise EngramError(f"{path.parent}: no space for a {nbytes / 2**30:.2f} GiB shared table") from None
                    if e.errno == errno.ENOMEM:
                        raise EngramError(f"{path}: no memory for a {nbytes / 2**30:.2f} GiB shared table on "
                                          f"{self.spec.binding.describe() if self.spec.binding else 'this host'}; "
                                          f"free memory or choose --engram-host-numa interleave") from None
                    raise
                progress = _Progress(f"layer {self.spec.layer_id}: filling {path}", nbytes, self._beat)
                fill(writable, progress)
                progress.done()
            finally:
                writable.close()
            os.rename(tmp, path)  # complete: only now can another rank find it
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        fd = _open(path, self._flags)
        try:
            m = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=self._prot)
        finally:
            os.close(fd)
        advise(m)
        return m

    def _map_writable(self, fd: int, nbytes: int) -> mmap.mmap:
        try:
            return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:  # hugetlbfs reserves a shared mapping's pages when it is made
            if self.page and e.errno in (errno.ENOMEM, errno.ENOSPC):
                raise EngramError(self._no_huge_pages(nbytes)) from None
            raise

    def _no_huge_pages(self, nbytes: int) -> str:
        return (f"{self.path}: no huge pages for a {nbytes / 2**30:.2f} GiB shared table on "
                f"{self.spec.binding.describe() if self.spec.binding and self.spec.binding.tag else 'this host'}: "
                f"{thp.hugetlb_room_text(self.spec.directory, nbytes, self.page)}")

    def release(self, wait: Optional[float] = None) -> None:
        """Drop this hold (the caller has closed `map`, or left it to its last view); the last
        holder removes the copy and its sidecars unless the spec keeps it. `wait`: seconds to
        try for the copy's lock (a stop must not wait on another rank's fill); past them the
        hold goes with the process and the copy stays (`shm ls`: nobody holds it)."""
        with _OPEN_LOCK:
            if self not in _OPEN:
                return
            _OPEN.discard(self)
            if not _OPEN:
                _hold_signals(False)
        lock_fd = lock(self.path) if wait is None else _lock_within(self.path, wait)
        if lock_fd is None:
            logger.warning("engram layer %d: %s stays: its lock was busy for %.0f s while stopping (engram-sglang "
                           "shm prune removes it when nobody holds it)", self.spec.layer_id, self.path, wait)
            os.close(self._users)
            return
        try:
            # Under the lock no other server is opening or leaving: exclusive means nobody else holds it.
            last = _try_exclusive(self._users)
            lock_path, users_path = sidecars(self.path)
            if last and not self.spec.keep and _same_file(self._users, users_path):
                try:
                    st = os.lstat(self.path)
                    if (st.st_ino, st.st_dev) == self._ident:  # not a newer copy made after an `shm rm --force`
                        self.path.unlink()
                        logger.info("engram layer %d: removed the shared copy %s (no server holds it)",
                                    self.spec.layer_id, self.path)
                except FileNotFoundError:
                    pass
                users_path.unlink(missing_ok=True)
                lock_path.unlink(missing_ok=True)  # while held: see lock()
        finally:
            os.close(self._users)
            os.close(lock_fd)


def _lock_within(path: Path, seconds: float) -> Optional[int]:
    """The copy's lock (as `lock`), tried for `seconds`; None when it stays busy."""
    deadline = time.monotonic() + seconds
    while True:
        fd = lock(path, blocking=False)
        if fd is not None or time.monotonic() >= deadline:
            return fd
        time.sleep(LOCK_POLL_SECONDS)


@atexit.register
def _release_all(wait: Optional[float] = None) -> None:
    with _OPEN_LOCK:
        held = list(_OPEN)
    for copy in held:
        try:
            copy.release(wait)
        except Exception:  # noqa: BLE001 - at exit: the next server's start reclaims what is left
            logger.exception("engram: releasing %s at exit failed", copy.path)
