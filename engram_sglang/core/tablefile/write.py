"""Writing a table directory: streamed chunk by chunk into a fresh directory beside the
target, checked by opening it, then swapped in whole under a lock on the parent.

Before anything is written, dead writers' directories beside the target are removed
(leftovers.py) and the filesystem must have room for the whole table; the layer files
themselves are written by layerfile.py, on a thread pool.

Modes are set explicitly, whatever the writer's umask: directory 0755, files 0644, so that a
server of another uid (a container user reading a `:ro` mount) can open them; mkdtemp's 0700
would refuse it."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Mapping, Optional

from ..config import EngramConfig
from ..errors import TableFormatError
from ..hashing import EngramLayout
from ..rowformat import PAYLOAD_BYTES, ROW_BYTES, SCALE_BYTES
from . import leftovers
from .fileformat import CHUNK_ROWS, DATA_OFFSET, FORMAT, MANIFEST, VERSION, RowSource, _is_count, layer_file_name
from .layerfile import FILE_MODE, write_layer
from .progress import Progress
from .provenance import check_provenance
from .read import open_tables, read_manifest

DIR_MODE = 0o755
MAX_THREADS = 8


def default_threads() -> int:
    """Chunks in flight: the CPUs this process may use, at least 2 (one reads while
    another writes, even on one CPU), at most MAX_THREADS."""
    return max(2, min(MAX_THREADS, len(os.sched_getaffinity(0))))


def write_tables(
    out_dir: str | os.PathLike,
    cfg: EngramConfig,
    rows_by_layer: Mapping[int, RowSource],
    *,
    chunk_rows: int = CHUNK_ROWS,
    progress: Optional[bool] = None,
    provenance: Optional[dict] = None,
    threads: Optional[int] = None,
    direct: bool = True,
) -> Path:
    """Write every Engram layer's packed rows into `out_dir` and its manifest.

    `rows_by_layer[L]` is a uint8 [R, 264] array/tensor (a memory map is fine), a
    layerfile.RowFill, or an iterable of such chunks, R = the layout's row count for layer
    L. `provenance`: the checkpoint the rows came from (provenance.checkpoint_provenance),
    None for none. `threads`: chunks in flight (default_threads() when None; 1 writes on
    this thread alone); `direct`: O_DIRECT where the filesystem takes it. `progress`:
    progress.Progress's.
    """
    out = Path(out_dir)
    layout = EngramLayout(cfg)
    missing = [L for L in cfg.layer_ids if L not in rows_by_layer]
    if missing:
        raise TableFormatError(f"write_tables: no rows given for Engram layer(s) {missing} of {cfg.source}")
    if not _is_count(chunk_rows):
        raise TableFormatError(f"write_tables: chunk_rows must be an integer >= 1, got {chunk_rows!r}")
    threads = default_threads() if threads is None else threads
    if not _is_count(threads):
        raise TableFormatError(f"write_tables: threads must be an integer >= 1, got {threads!r}")
    if provenance is not None:
        check_provenance(provenance, "write_tables")
    # Beside the real target (a symlink's), so the final swap is a rename on one filesystem.
    target = Path(os.path.realpath(out))
    _check_target(target)
    leftovers.reclaim(target.parent, _sibling_stem(target))  # (before the space check: they free some)
    data_bytes = sum(layout.rows(L) * ROW_BYTES for L in cfg.layer_ids)
    _check_space(target, data_bytes + len(cfg.layer_ids) * DATA_OFFSET + (1 << 20))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=_sibling_prefix(target, "writing"), dir=target.parent))
        held = leftovers.hold(work)
    except OSError as e:
        raise TableFormatError(f"{out}: cannot create a table directory there ({e.strerror})") from None
    bar = Progress(data_bytes, f"writing {target}", progress)
    pool = ThreadPoolExecutor(threads, thread_name_prefix="engram-write") if threads > 1 else None
    ok = False
    try:
        _write_into(work, cfg, layout, rows_by_layer, chunk_rows, bar, provenance, pool, threads, direct)
        open_tables(work, cfg)  # what was written must open before it replaces anything
        os.chmod(work, DIR_MODE)  # (its files got FILE_MODE as they were written)
        _swap_in(work, target)
        ok = True
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    finally:
        if pool is not None:
            pool.shutdown()
        os.close(held)
        bar.close(ok)
    return out


def _check_space(target: Path, need: int) -> None:
    """Room for the whole table on the target's filesystem, before a byte is written (the
    old directory it replaces is freed only after the swap)."""
    probe = next((p for p in (target.parent, *target.parent.parents) if os.path.isdir(p)), None)
    if probe is None:
        return
    try:
        st = os.statvfs(probe)
    except OSError:
        return  # the write's own errors say what is wrong
    if st.f_blocks == 0:
        return  # a filesystem that reports no sizes (some FUSE mounts): nothing to compare
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise TableFormatError(f"{target}: needs {need / 2**30:.1f} GiB, its filesystem ({probe}) has "
                               f"{free / 2**30:.1f} GiB free; free some or write the tables elsewhere")


def _sibling_prefix(target: Path, what: str) -> str:
    """A hidden sibling's name prefix: a hash of the target's name, not the name itself, so that
    any name the filesystem takes (255 bytes) leaves room for the sibling's (~40 bytes)."""
    return f"{_sibling_stem(target)}{what}-{os.getpid()}-"


def _sibling_stem(target: Path) -> str:
    return f".engram-{hashlib.sha1(os.fsencode(target.name)).hexdigest()[:12]}."


def _write_into(out: Path, cfg, layout, rows_by_layer, chunk_rows, progress, provenance, pool, threads, direct) -> None:
    layers = []
    for layer_id in cfg.layer_ids:
        expected = layout.rows(layer_id)
        path = out / layer_file_name(layer_id)
        try:
            checksums = write_layer(path, layer_id, cfg, expected, rows_by_layer[layer_id], chunk_rows, progress,
                                    pool=pool, threads=threads, direct=direct)
        except OSError as e:  # a full disk, a quota
            raise TableFormatError(f"{path}: cannot write the layer file ({e.strerror or e})") from None
        layers.append({"layer_id": layer_id, "file": path.name, "rows": expected, "checksums": checksums})
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "row_bytes": ROW_BYTES,
        "payload_bytes": PAYLOAD_BYTES,
        "scale_bytes": SCALE_BYTES,
        "data_offset": DATA_OFFSET,
        "chunk_rows": chunk_rows,
        "checksum": "xxh3_64",
        "config_fingerprint": cfg.fingerprint(),
        "config": {**cfg.hash_fields(), "engram_num_embeddings": list(layout.num_embeddings)},
        "layers": layers,
    }
    if provenance is not None:  # optional: older manifests lack it
        manifest["provenance"] = provenance
    try:
        _atomic_write(out / MANIFEST, json.dumps(manifest, indent=1).encode())
        _fsync_dir(out)
    except OSError as e:
        raise TableFormatError(f"{out / MANIFEST}: cannot write the manifest ({e.strerror or e})") from None


def _is_table_entry(name: str) -> bool:
    return name == MANIFEST or re.fullmatch(r"layer-\d+\.rows(\.tmp)?|manifest\.json\.tmp", name) is not None


def _check_target(target: Path) -> None:
    """A directory may be replaced only if it holds nothing but a table (or nothing)."""
    if not os.path.lexists(target):
        return
    if not target.is_dir():
        raise TableFormatError(f"{target}: exists and is not a directory; give a table directory to write")
    try:
        others = sorted(n for n in os.listdir(target) if not _is_table_entry(n))
    except OSError as e:
        raise TableFormatError(f"{target}: cannot list it ({e.strerror})") from None
    if others:
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        raise TableFormatError(
            f"{target}: holds files that are not a table's ({shown}); not replacing it: "
            f"remove them or write to another directory"
        )


_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_cwd = -100
    if renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: the filesystem cannot; rename instead
        return False
    raise OSError(err, os.strerror(err), str(b))


def _swap_in(work: Path, target: Path) -> None:
    """Replace `target` by the complete directory `work` (same parent). Under a lock on the
    parent, so two writers swap one after the other and the later one's directory stays
    whole; readers see the old directory or the new one (an exchange where the filesystem
    has it; else the old one is renamed aside first, a moment without either)."""
    _fsync_dir(work)
    lock = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _check_target(target)  # again: another writer may have put something there meanwhile
        try:
            if not os.path.lexists(target):
                os.rename(work, target)
            elif _exchange(work, target):
                pass  # `work` now holds the old directory
            else:
                aside = Path(tempfile.mkdtemp(prefix=_sibling_prefix(target, "old"), dir=target.parent))
                os.rename(target, aside / "old")
                os.rename(work, target)
                work.mkdir()  # the caller's clean-up removes `work`: let it hold the old one
                os.rename(aside / "old", work / "old")
                aside.rmdir()
        except OSError as e:
            raise TableFormatError(f"{target}: cannot put the written tables in place ({e.strerror})") from None
        _fsync_dir(target.parent)
    finally:
        os.close(lock)  # releases the lock
    shutil.rmtree(work, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_layer(path, layer_id, cfg, expected, source, chunk_rows, progress) -> list[str]:
    """One layer file on this thread (tests forge directories with it)."""
    return write_layer(path, layer_id, cfg, expected, source, chunk_rows, progress)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            os.fchmod(f.fileno(), FILE_MODE)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # (a read-only filesystem refuses even this)
            tmp.unlink()
        raise


def record_provenance(table_dir: str | os.PathLike, provenance: dict, *, expect_layers=None) -> Optional[dict]:
    """Put `provenance` into an existing table directory's manifest, nothing else changed
    (`tables verify --model DIR --record`): the new manifest is written beside the old one
    and renamed over it (a reader sees one or the other), under the lock writers swap
    directories under. `expect_layers`: the manifest's "layers" as verified; a directory
    swapped meanwhile is refused. Returns the provenance replaced, None where there was none."""
    check_provenance(provenance, "record_provenance")
    root = Path(os.path.realpath(table_dir))
    mpath = root / MANIFEST
    try:
        lock = os.open(root.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise TableFormatError(f"{root.parent}: cannot open the directory to lock it ({e.strerror})") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        manifest, _ = read_manifest(root)
        if expect_layers is not None and manifest["layers"] != expect_layers:
            raise TableFormatError(f"{root}: the tables were replaced while they were verified; run it again")
        old = manifest.get("provenance")
        manifest["provenance"] = provenance
        try:
            _atomic_write(mpath, json.dumps(manifest, indent=1).encode())
            _fsync_dir(root)
        except OSError as e:
            raise TableFormatError(f"{mpath}: cannot rewrite the manifest ({e.strerror or e}); "
                                   f"record it where the directory is writable") from None
    finally:
        os.close(lock)
    return old
