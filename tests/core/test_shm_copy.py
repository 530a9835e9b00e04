"""The node's shared host copy (issue 12 item 6): named by content, checked before it is
served, never through a symlink, read-only, leftovers reclaimed, freed by the last server.

Written against open_store and the files in the shm directory (found by glob), so each test
also runs, and fails, on the code from before stores/shmcopy.py."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from engram_sglang.core.errors import EngramError
from engram_sglang.core.hashing import EngramLayout
from engram_sglang.core.rowformat import ROW_BYTES
from engram_sglang.core.stores import open_store
from engram_sglang.core.tablefile import write_tables
from tests.support.tables import small_config

ROOT = Path(__file__).resolve().parents[2]
CFG = small_config(200, layer_ids=(1,), n_heads=2)
ROWS = EngramLayout(CFG).rows(1)


def _rows(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (ROWS, ROW_BYTES), dtype=np.uint8)


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    """Two table directories of the same config with different rows."""
    base = tmp_path_factory.mktemp("tables")
    a, b = _rows(1), _rows(2)
    return (write_tables(base / "a", CFG, {1: a}, chunk_rows=64, progress=False), a,
            write_tables(base / "b", CFG, {1: b}, chunk_rows=64, progress=False), b)


def _open(table_dir, shm, **kw):
    return open_store(table_dir, "host", cfg=CFG, shared=True, shm_dir=shm, **kw)[1]


def _copies(shm: Path) -> list[Path]:
    return sorted(shm.glob("engram-*-layer1.rows"))


def _served(store) -> np.ndarray:
    return store.table.numpy().copy()


def test_a_copy_of_other_tables_of_the_same_config_is_never_served(tables, tmp_path):
    dir_a, rows_a, dir_b, rows_b = tables
    a = _open(dir_a, tmp_path)
    b = _open(dir_b, tmp_path)  # while a holds its copy
    assert np.array_equal(_served(a), rows_a)
    assert np.array_equal(_served(b), rows_b), "served the copy made from the other tables"
    assert len(_copies(tmp_path)) == 2 and a.memory.shm_path != b.memory.shm_path
    a.close()
    b.close()


def test_a_flipped_byte_in_a_copy_left_by_a_killed_server_is_refilled_not_served(tables, tmp_path, caplog):
    dir_a, rows_a, _, _ = tables
    _left_behind(dir_a, tmp_path)
    (copy,) = _copies(tmp_path)
    with open(copy, "r+b") as f:  # one bit of row 100, in checksum chunk 1
        f.seek(100 * ROW_BYTES + 7)
        byte = f.read(1)[0]
        f.seek(100 * ROW_BYTES + 7)
        f.write(bytes([byte ^ 0x10]))
    with caplog.at_level(logging.WARNING):
        b = _open(dir_a, tmp_path)
    assert np.array_equal(_served(b), rows_a), "served the corrupted copy"
    assert "does not match the table's manifest (chunk 1" in caplog.text
    b.close()


def test_the_copy_is_mapped_read_only(tables, tmp_path):
    dir_a, _, _, _ = tables
    store = _open(dir_a, tmp_path)
    (copy,) = _copies(tmp_path)
    perms = [ln.split()[1] for ln in Path("/proc/self/maps").read_text().splitlines() if ln.endswith(str(copy))]
    assert perms and all(p == "r--s" for p in perms), perms
    store.close()


@pytest.mark.parametrize("suffix", ["", ".lock"])
def test_a_symlink_at_the_copy_or_lock_name_is_refused(tables, tmp_path, suffix):
    dir_a, rows_a, _, _ = tables
    shm, elsewhere = tmp_path / "shm", tmp_path / "elsewhere"
    shm.mkdir()
    elsewhere.mkdir()
    _left_behind(dir_a, shm)  # learn the names, then leave only a link behind
    (copy,) = _copies(shm)
    name = copy.name + suffix
    for p in shm.iterdir():
        p.unlink()
    target = elsewhere / "target"
    if suffix == "":  # a table someone else's link points at: must not be mapped
        target.write_bytes(rows_a.tobytes())
        os.chmod(target, 0o600)
    (shm / name).symlink_to(target)
    with pytest.raises(EngramError, match=f"{name}: is a symbolic link, not a shared table file; refusing to follow"):
        _open(dir_a, shm)
    assert (shm / name).is_symlink()
    if suffix == ".lock":
        assert not target.exists(), "created a file where the link points"


def test_a_crashed_fillers_leftover_is_reclaimed(tables, tmp_path):
    dir_a, rows_a, _, _ = tables
    _left_behind(dir_a, tmp_path)
    (copy,) = _copies(tmp_path)
    copy.unlink()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    leftovers = [Path(f"{copy}.tmp.{pid}"), tmp_path / f"engram-0123456789abcdef-layer1.rows.tmp.{pid}"]
    for p in leftovers:
        with open(p, "wb") as f:
            f.truncate(ROWS * ROW_BYTES)
        os.chmod(p, 0o600)
    from engram_sglang.core.stores.shmadmin import list_copies

    # `shm ls` lists them, by the same directory scan the reclaim walks (shmcopy.scan).
    # (the removed copy's sidecars are listed too, as sidecars without a copy)
    listed = {e["name"]: (e["filler"], e["filler_alive"], e["layer"]) for e in list_copies(tmp_path) if "filler" in e}
    assert listed == {p.name: (pid, False, 1) for p in leftovers}
    store = _open(dir_a, tmp_path)
    assert np.array_equal(_served(store), rows_a)
    assert not any(p.exists() for p in leftovers)
    store.close()


HOLDER = """
    import sys
    from tests.support.tables import small_config
    from engram_sglang.core.stores import open_store
    cfg = small_config(200, layer_ids=(1,), n_heads=2)
    store = open_store({table_dir!r}, "host", cfg=cfg, shared=True, shm_dir={shm!r})[1]
    print("holding", flush=True)
    sys.stdin.readline()
    store.close()
    print("closed", flush=True)
"""


def _holder(table_dir, shm) -> subprocess.Popen:
    code = textwrap.dedent(HOLDER).format(table_dir=str(table_dir), shm=str(shm))
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.readline().strip() == "holding"
    return proc


def test_the_last_server_to_leave_removes_the_copy(tables, tmp_path):
    dir_a, _, _, _ = tables
    other = _holder(dir_a, tmp_path)  # another server process on the node
    try:
        mine = _open(dir_a, tmp_path)
        mine.close()
        assert len(_copies(tmp_path)) == 1, "removed while another server holds it"
        other.stdin.write("\n")
        other.stdin.flush()
        assert other.stdout.readline().strip() == "closed"
    finally:
        other.stdin.close()
        other.wait(timeout=60)
    assert _copies(tmp_path) == [] and list(tmp_path.iterdir()) == []


def _left_behind(table_dir, shm) -> None:
    """A copy left by a server that was killed (no close, no exit handlers)."""
    killed = _holder(table_dir, shm)
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)


def test_a_dead_holder_does_not_count(tables, tmp_path):
    dir_a, _, _, _ = tables
    _left_behind(dir_a, tmp_path)
    mine = _open(dir_a, tmp_path)
    mine.close()
    assert _copies(tmp_path) == []


def test_keep_on_keeps_the_copy(tables, tmp_path):
    dir_a, rows_a, _, _ = tables
    store = _open(dir_a, tmp_path, keep=True)
    store.close()
    (copy,) = _copies(tmp_path)
    assert np.array_equal(np.fromfile(copy, dtype=np.uint8).reshape(ROWS, ROW_BYTES), rows_a)


def test_filling_reports_progress_and_rate(tables, tmp_path, monkeypatch, caplog):
    from engram_sglang.core.stores import shmcopy

    dir_a, _, _, _ = tables
    monkeypatch.setattr(shmcopy, "PROGRESS_SECONDS", 0.0)
    with caplog.at_level(logging.INFO, logger="engram_sglang.core.stores.shmcopy"):
        store = _open(dir_a, tmp_path)
    assert "filling" in caplog.text and "GiB/s" in caplog.text
    store.close()


def test_shm_ls_and_rm(tables, tmp_path, capsys):
    from engram_sglang.tools.cli import main

    dir_a, _, _, _ = tables
    store = _open(dir_a, tmp_path)
    (copy,) = _copies(tmp_path)
    assert main(["shm", "ls", "--shm-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith(copy.name))
    assert line.split()[2:] == ["1", "-", copy.name.split("-")[1], "1", "alive", "(pids", f"{os.getpid()})"]  # not NUMA-bound
    assert main(["shm", "rm", "--shm-dir", str(tmp_path), copy.name]) == 2
    assert "in use by a running server" in capsys.readouterr().err and copy.exists()
    store.close()  # the last holder removed it
    store = _open(dir_a, tmp_path, keep=True)
    store.close()
    assert main(["shm", "rm", "--shm-dir", str(tmp_path), copy.name]) == 0
    assert list(tmp_path.iterdir()) == []


def test_the_keep_setting_reaches_the_store_options():
    from engram_sglang.serving.settings import ServeSettings

    env = {"ENGRAM_PLACEMENT": "host", "ENGRAM_HOST_SHARED": "on"}
    assert ServeSettings.from_env({**env, "ENGRAM_HOST_KEEP": "on"}).store_options()["keep"] is True
    assert "keep" not in ServeSettings.from_env(env).store_options()  # off: open_store's default


# --------------------------------------------------------- waits on a copy's lock (issue 22 item 4)
LOCKER = """
    import os, sys, time
    from pathlib import Path
    from engram_sglang.core.stores import shmcopy
    fd = shmcopy.lock(Path({copy!r}))
    print("locked", flush=True)
    if {beat_for}:  # a holder at work: beats as a fill does, then leaves
        t0 = time.monotonic()
        while time.monotonic() - t0 < {beat_for}:
            os.utime(fd)
            time.sleep(0.05)
    else:
        sys.stdin.readline()
    os.close(fd)
"""


def _locker(copy: Path, beat_for: float = 0) -> subprocess.Popen:
    code = textwrap.dedent(LOCKER).format(copy=str(copy), beat_for=beat_for)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.readline().strip() == "locked"
    return proc


class _Unbounded(Exception):
    pass


@pytest.fixture
def bounded():
    """Fail (instead of hanging the suite) where a wait has no bound of its own."""
    def expire(*_):
        raise _Unbounded("the wait had no bound")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def short_waits(monkeypatch):
    from engram_sglang.core.stores import shmcopy

    monkeypatch.setattr(shmcopy, "LOCK_LOG_SECONDS", 0.2, raising=False)
    monkeypatch.setattr(shmcopy, "LOCK_STALL_SECONDS", 1.0, raising=False)
    monkeypatch.setattr(shmcopy, "LOCK_POLL_SECONDS", 0.02, raising=False)
    return shmcopy


def test_a_wait_behind_a_frozen_lock_holder_says_who_and_gives_up(tmp_path, short_waits, bounded, caplog,
                                                                    monkeypatch):
    import threading

    copy = tmp_path / "engram-0123456789abcdef-layer1.rows"
    holder = _locker(copy)
    try:
        os.kill(holder.pid, signal.SIGSTOP)
        with caplog.at_level(logging.WARNING, logger=short_waits.__name__):
            with pytest.raises(EngramError, match=rf"^{copy}\.lock: held by process {holder.pid} \(stopped\) with no "
                                                  rf"sign of progress for 1 s .*resume it \(kill -CONT\) or stop it"):
                short_waits.lock(copy)
        waits = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
        assert waits and all(f"{copy}.lock (the shared copy {copy}), held by process {holder.pid} (stopped)" in w
                             for w in waits), caplog.text
        # Resumed, it leaves, and the wait proceeds.
        monkeypatch.setattr(short_waits, "LOCK_STALL_SECONDS", 15.0)
        holder.stdin.write("\n")
        holder.stdin.flush()
        threading.Timer(0.5, os.kill, (holder.pid, signal.SIGCONT)).start()
        fd = short_waits.lock(copy)
        os.close(fd)
    finally:
        os.kill(holder.pid, signal.SIGCONT)
        holder.stdin.close()
        holder.wait(timeout=30)


def test_a_holder_that_beats_is_waited_for_past_the_bound(tmp_path, short_waits, bounded):
    copy = tmp_path / "engram-0123456789abcdef-layer1.rows"
    holder = _locker(copy, beat_for=2.5)  # 2.5 x the bound, beating as a fill does
    try:
        os.close(short_waits.lock(copy))
    finally:
        holder.wait(timeout=30)


# ------------------------------------------------- a fill interrupted by a signal (issue 22 item 6)
SLOW_FILLER = """
    import time
    from engram_sglang.core.stores import hostmem, open_store, shmcopy
    from tests.support.tables import small_config
    hostmem._FILL_CHUNK = 4096  # many chunks, each a little slow
    beat = shmcopy._Progress.__call__
    def slow(self, done):
        if done == 4096:
            print("filling", flush=True)
        time.sleep(0.01)
        beat(self, done)
    shmcopy._Progress.__call__ = slow
    open_store({table_dir!r}, "host", cfg=small_config(200, layer_ids=(1,), n_heads=2), shared=True, shm_dir={shm!r})
    print("filled", flush=True)
"""


def _slow_filler(table_dir, shm) -> subprocess.Popen:
    code = textwrap.dedent(SLOW_FILLER).format(table_dir=str(table_dir), shm=str(shm))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.readline().strip() == "filling"
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_a_fill_interrupted_by_a_signal_leaves_nothing_and_dies_by_it(tables, tmp_path, sig):
    dir_a, _, _, _ = tables
    proc = _slow_filler(dir_a, tmp_path)
    assert any(".tmp." in p.name for p in tmp_path.iterdir())
    proc.send_signal(sig)
    assert proc.wait(timeout=60) == -sig, "did not die by the signal"
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_failed_open_leaves_no_sidecars(tables, tmp_path, monkeypatch):
    from engram_sglang.core.stores import hostmem

    dir_a, _, _, _ = tables

    def broken(*a, **kw):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(hostmem, "fill_from_file", broken)
    with pytest.raises(OSError):
        _open(dir_a, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# ------------------------------------ sidecars without a copy, odd things at a copy's name (item 7)
def test_shm_ls_lists_and_rm_removes_sidecars_without_a_copy(tmp_path, capsys):
    from engram_sglang.tools.cli import main

    name = "engram-0123456789abcdef-layer1.rows"
    for suffix in (".lock", ".users"):  # as a failed open of an older version left them
        (tmp_path / f"{name}{suffix}").touch(mode=0o600)
    assert main(["shm", "ls", "--shm-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for suffix in ("lock", "users"):
        line = next(ln for ln in out.splitlines() if ln.startswith(f"{name}.{suffix}"))
        assert line.endswith(f"{suffix} sidecar, no copy: nobody holds it (shm rm or prune)"), line
    held = _locker(tmp_path / name)  # a fill in progress holds the lock: refused
    try:
        assert main(["shm", "rm", "--shm-dir", str(tmp_path), f"{name}.lock"]) == 2
        err = capsys.readouterr().err
        assert f"held by a server filling or opening the copy (processes {held.pid})" in err and len(err.splitlines()) == 1
    finally:
        held.stdin.close()
        held.wait(timeout=30)
    assert main(["shm", "rm", "--shm-dir", str(tmp_path), f"{name}.lock", f"{name}.users"]) == 0
    assert list(tmp_path.iterdir()) == []


def test_shm_rm_of_a_directory_named_like_a_copy_is_one_line(tmp_path, capsys):
    from engram_sglang.tools.cli import main

    name = "engram-0123456789abcdef-layer1.rows"
    (tmp_path / name).mkdir()
    assert main(["shm", "rm", "--shm-dir", str(tmp_path), name]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path / name}: is a directory, not a shared copy" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == [name], "left a new .lock"


# ------------------------------------------------------------- shm prune (issue 25 item 4)
def _names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_shm_prune_removes_what_no_process_uses(tables, tmp_path, capsys):
    from engram_sglang.tools.cli import main

    dir_a, _, dir_b, _ = tables
    held = _holder(dir_a, tmp_path)  # A's copy: in use, never pruned
    try:
        in_use = _names(tmp_path)
        killed = _slow_filler(dir_b, tmp_path)  # SIGKILL mid-fill: B's .tmp.PID and sidecars stay
        killed.kill()
        killed.wait(timeout=60)
        (tmp_path / "engram-0123456789abcdef-layer1.rows.users").touch(mode=0o600)
        left = sorted(set(_names(tmp_path)) - set(in_use))
        assert len(left) == 4 and any(f".tmp.{killed.pid}" in n for n in left), left
        args = ["shm", "prune", "--shm-dir", str(tmp_path)]
        assert main([*args, "--dry-run"]) == 0
        out = capsys.readouterr().out.splitlines()
        assert sorted(ln.split()[2].rsplit("/", 1)[1] for ln in out[:-1]) == left and _names(tmp_path) == sorted(
            in_use + left)
        assert out[-1].startswith(f"{tmp_path}: would prune 4 file(s), ")
        assert main(args) == 0
        out = capsys.readouterr().out.splitlines()
        assert [ln.split()[0] for ln in out[:-1]] == ["removed"] * 4 and f"(process {killed.pid} is gone)" in "".join(out)
        assert _names(tmp_path) == in_use
    finally:
        held.stdin.close()
        held.wait(timeout=60)


def test_shm_prune_by_age_and_by_table_version(tables, tmp_path, capsys):
    from engram_sglang.tools.cli import main

    dir_a, _, dir_b, _ = tables
    for d in (dir_a, dir_b):  # kept copies no server holds
        _open(d, tmp_path, keep=True).close()
    (copy_a,) = [p for p in _copies(tmp_path) if p.name.split("-")[1] == _open_name(dir_a)]
    args = ["shm", "prune", "--shm-dir", str(tmp_path)]
    assert main([*args, "--older-than", "1d"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("pruned 0 file(s), 0.000 GiB") and len(_copies(tmp_path)) == 2
    assert main([*args, "--table-dir", str(dir_a)]) == 0  # B holds another version of A's layer 1
    out = capsys.readouterr().out
    assert "another version of layer 1 than the table directory's" in out and _copies(tmp_path) == [copy_a]
    assert main(args) == 0
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(SystemExit, match="2"):  # argparse's one line
        main([*args, "--older-than", "soon"])


def _open_name(table_dir) -> str:
    from engram_sglang.core.stores.shmadmin import table_identities

    return table_identities(table_dir)[1]


def test_a_leftover_whose_pid_now_names_a_later_process_is_reclaimed(tmp_path, monkeypatch):
    import time

    from engram_sglang.core.stores import shmcopy

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        tmp = tmp_path / f"engram-0123456789abcdef-layer1.rows.tmp.{sleeper.pid}"
        tmp.touch(mode=0o600)
        assert shmcopy.reclaim_leftovers(tmp_path) == [] and tmp.exists()  # its filler may be at work
        # The PID reused (a container restarted): the process holding it started after the file.
        monkeypatch.setattr(shmcopy, "_started_at", lambda pid: time.time() + 60, raising=False)
        assert shmcopy.reclaim_leftovers(tmp_path) == [tmp] and not tmp.exists()
    finally:
        sleeper.kill()
        sleeper.wait()


# ------------------------------------- a stop by the process group's SIGTERM (issue 25 item 1)
GROUP_HOLDER = """
    import signal, subprocess, sys, time
    from tests.support.tables import small_config
    from engram_sglang.core.stores import hostmem, open_store, shmcopy
    {prelude}
    # A sibling in the same process group, as SGLang's schedulers and detokenizer are.
    sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    cfg = small_config(200, layer_ids={layers}, n_heads=2)
    store = open_store({table_dir!r}, "host", cfg=cfg, shared=True, shm_dir={shm!r})
    print("holding", flush=True)
    sys.stdin.readline()
"""


def _group_holder(table_dir, shm, prelude: str = "", layers=(1,)) -> subprocess.Popen:
    code = textwrap.dedent(GROUP_HOLDER).format(table_dir=str(table_dir), shm=str(shm), layers=layers,
                                                prelude=textwrap.dedent(prelude).strip())
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    return proc


def _stop_group(proc: subprocess.Popen) -> tuple[int, str, str]:
    os.killpg(proc.pid, signal.SIGTERM)  # the whole group: systemd KillMode=control-group, kill -- -PGID
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err


def test_a_sigterm_to_the_process_group_releases_the_copy(tables, tmp_path):
    dir_a, _, _, _ = tables
    proc = _group_holder(dir_a, tmp_path)
    assert proc.stdout.readline().strip() == "holding"
    assert len(_copies(tmp_path)) == 1
    rc, _, err = _stop_group(proc)
    assert rc == -signal.SIGTERM, err  # still dies by the signal
    assert _names(tmp_path) == [], "the copy (or its sidecars) outlived the stop"


def test_a_python_sigterm_handler_is_still_called_after_the_release(tables, tmp_path):
    dir_a, _, _, _ = tables
    theirs = """
        import os
        def theirs(signum, frame):
            print("theirs", flush=True)
            os._exit(3)  # no exit handlers: released before it or not at all
        signal.signal(signal.SIGTERM, theirs)
    """
    proc = _group_holder(dir_a, tmp_path, prelude=theirs)
    assert proc.stdout.readline().strip() == "holding"
    rc, out, err = _stop_group(proc)
    assert (rc, out.strip()) == (3, "theirs"), err
    assert _names(tmp_path) == []


def test_a_sigterm_during_another_layers_fill_removes_both(tmp_path):
    cfg = small_config(200, layer_ids=(1, 3), n_heads=2)
    layout = EngramLayout(cfg)
    rng = np.random.default_rng(3)
    rows = {L: rng.integers(0, 256, (layout.rows(L), ROW_BYTES), dtype=np.uint8) for L in (1, 3)}
    table_dir = write_tables(tmp_path / "t", cfg, rows, chunk_rows=64, progress=False)
    shm = tmp_path / "shm"
    shm.mkdir()
    slow = """
        hostmem._FILL_CHUNK = 4096
        beat = shmcopy._Progress.__call__
        def slow(self, done):
            if "layer 3" in self.what:
                if done == 4096:
                    print("filling", flush=True)
                time.sleep(0.01)
            beat(self, done)
        shmcopy._Progress.__call__ = slow
    """
    proc = _group_holder(table_dir, shm, prelude=slow, layers=(1, 3))
    assert proc.stdout.readline().strip() == "filling"
    assert any(".tmp." in n for n in _names(shm)) and any(n.endswith("-layer1.rows") for n in _names(shm))
    rc, _, err = _stop_group(proc)
    assert rc == -signal.SIGTERM, err
    assert _names(shm) == [], "left layer 1's copy or layer 3's fill behind"


def test_a_copy_whose_lock_stays_busy_at_a_stop_is_left_and_the_stop_is_not_held_up(tables, tmp_path):
    import time

    dir_a, _, _, _ = tables
    proc = _group_holder(dir_a, tmp_path, prelude="shmcopy.RELEASE_LOCK_SECONDS = 0.5")
    assert proc.stdout.readline().strip() == "holding"
    (copy,) = _copies(tmp_path)
    locker = _locker(copy)  # e.g. another rank checking it, stuck
    try:
        t0 = time.monotonic()
        rc, _, err = _stop_group(proc)
        assert rc == -signal.SIGTERM and time.monotonic() - t0 < 30, err
        assert "stays: its lock was busy for 0 s while stopping" in err, err
        assert copy.exists()
    finally:
        locker.stdin.close()
        locker.wait(timeout=30)


def test_the_release_handler_is_there_only_while_a_copy_is_held(tables, tmp_path):
    from engram_sglang.core.stores import shmcopy

    dir_a, _, _, _ = tables
    before = signal.getsignal(signal.SIGTERM)
    store = _open(dir_a, tmp_path)
    assert signal.getsignal(signal.SIGTERM) is shmcopy._release_on_signal
    store.close()
    assert signal.getsignal(signal.SIGTERM) is before
