"""Packed table files: one directory per model, one file of packed 264-byte rows per layer.

    DIR/manifest.json      format version, config fingerprint, rows per layer, chunk checksums
    DIR/layer-{L}.rows     a 4 KiB header page, then rows end to end (data page-aligned)

Written once (convert from a checkpoint, or the demo's generator), streamed chunk by chunk
so memory does not grow with the table, into a fresh directory beside the target that is
checked, then swapped in whole: a failed write leaves the old directory as it was, and of
two writers into one directory the later swap wins with a complete directory of its own.
Opened read-only as memory maps after every size, layout and fingerprint check of manifest
and headers (nothing in them is trusted: a manifest may be edited, truncated, or name a
FIFO); `verify_tables` re-reads the checksums.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import re
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Optional, Union

import numpy as np
import torch
import xxhash
from tqdm.auto import tqdm

from .config import EngramConfig
from .errors import EngramConfigError, TableFormatError
from .fileio import inside, open_regular, read_regular
from .hashing import EngramLayout
from .rowformat import PAYLOAD_BYTES, ROW_BYTES, SCALE_BYTES, pack

FORMAT = "engram-sglang packed rows"
VERSION = 1
MANIFEST = "manifest.json"
DATA_OFFSET = 4096  # header page; rows start page-aligned
CHUNK_ROWS = 1 << 18  # rows per checksum (~66 MiB): a verify error names a small range
_MAGIC = b"ENGRAMRW"
_HEADER = struct.Struct("<8sII")  # magic, format version, header JSON length
MAX_MANIFEST_BYTES = 16 << 20  # DeepSeek-V4.1's manifest is ~60 KB (a checksum per 2^18 rows)
_CHECKSUM = re.compile(r"[0-9a-f]{16}")

RowSource = Union[np.ndarray, torch.Tensor, Iterable[Union[np.ndarray, torch.Tensor]]]


def _no_bar(progress: Optional[bool]) -> Optional[bool]:
    """tqdm's `disable`: None shows a bar only on a terminal."""
    return None if progress is None else not progress


def layer_file_name(layer_id: int) -> str:
    return f"layer-{layer_id}.rows"


@dataclass(frozen=True)
class LayerInfo:
    layer_id: int
    path: Path
    rows: int
    checksums: tuple[str, ...]


class Tables(Mapping[int, np.ndarray]):
    """Layer id -> read-only memory-mapped uint8 [rows, 264] view of an opened table dir."""

    def __init__(self, root: Path, manifest: dict, layers: dict[int, LayerInfo], maps: dict[int, np.ndarray]):
        self.root, self.manifest, self.layers, self._maps = root, manifest, layers, maps

    def __getitem__(self, layer_id: int) -> np.ndarray:
        return self._maps[layer_id]

    def __iter__(self):
        return iter(self._maps)

    def __len__(self) -> int:
        return len(self._maps)

    @property
    def fingerprint(self) -> str:
        return self.manifest["config_fingerprint"]

    @property
    def config(self) -> EngramConfig:
        return EngramConfig.from_dict(self.manifest["config"], source=str(self.root / MANIFEST))


# --------------------------------------------------------------------------- write
def write_tables(
    out_dir: str | os.PathLike,
    cfg: EngramConfig,
    rows_by_layer: Mapping[int, RowSource],
    *,
    chunk_rows: int = CHUNK_ROWS,
    progress: Optional[bool] = None,
) -> Path:
    """Write every Engram layer's packed rows into `out_dir` and its manifest.

    `rows_by_layer[L]` is a uint8 [R, 264] array/tensor (a memory map is fine) or an
    iterable of such chunks, R = the layout's row count for layer L.
    """
    out = Path(out_dir)
    layout = EngramLayout(cfg)
    missing = [L for L in cfg.layer_ids if L not in rows_by_layer]
    if missing:
        raise TableFormatError(f"write_tables: no rows given for Engram layer(s) {missing} of {cfg.source}")
    if not _is_count(chunk_rows):
        raise TableFormatError(f"write_tables: chunk_rows must be an integer >= 1, got {chunk_rows!r}")
    # Beside the real target (a symlink's), so the final swap is a rename on one filesystem.
    target = Path(os.path.realpath(out))
    _check_target(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{target.name}.writing-{os.getpid()}-", dir=target.parent))
    except OSError as e:
        raise TableFormatError(f"{out}: cannot create a table directory there ({e.strerror})") from None
    try:
        _write_into(work, cfg, layout, rows_by_layer, chunk_rows, progress)
        open_tables(work, cfg)  # what was written must open before it replaces anything
        _swap_in(work, target)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return out


def _write_into(out: Path, cfg, layout, rows_by_layer, chunk_rows, progress) -> None:
    layers = []
    for layer_id in cfg.layer_ids:
        expected = layout.rows(layer_id)
        path = out / layer_file_name(layer_id)
        try:
            checksums = _write_layer(path, layer_id, cfg, expected, rows_by_layer[layer_id], chunk_rows, progress)
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
                aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-{os.getpid()}-", dir=target.parent))
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


def _chunks_of(source: RowSource, chunk_rows: int) -> Iterator[np.ndarray]:
    if isinstance(source, (np.ndarray, torch.Tensor)):
        for lo in range(0, source.shape[0], chunk_rows):
            yield _as_rows(source[lo : lo + chunk_rows])
    else:
        for chunk in source:
            yield _as_rows(chunk)


def _as_rows(chunk) -> np.ndarray:
    a = chunk.contiguous().numpy() if isinstance(chunk, torch.Tensor) else np.ascontiguousarray(chunk)
    if a.dtype != np.uint8 or a.ndim != 2 or a.shape[1] != ROW_BYTES:
        raise TableFormatError(f"row chunks must be uint8 [n, {ROW_BYTES}], got {a.dtype} {a.shape}")
    return a


def _write_layer(path, layer_id, cfg, expected, source, chunk_rows, progress) -> list[str]:
    tmp = path.with_name(path.name + ".tmp")
    header = json.dumps(
        {"layer_id": layer_id, "rows": expected, "row_bytes": ROW_BYTES, "config_fingerprint": cfg.fingerprint()}
    ).encode()
    page = _HEADER.pack(_MAGIC, VERSION, len(header)) + header
    checksums, hasher, in_chunk, written = [], xxhash.xxh3_64(), 0, 0
    bar = tqdm(total=expected * ROW_BYTES, unit="B", unit_scale=True, desc=path.name, disable=_no_bar(progress))
    try:
        with open(tmp, "wb") as f:
            f.write(page.ljust(DATA_OFFSET, b"\0"))
            for rows in _chunks_of(source, chunk_rows):
                if written + rows.shape[0] > expected:
                    raise TableFormatError(
                        f"{path}: layer {layer_id} got more than the {expected} rows its layout has"
                    )
                f.write(memoryview(rows).cast("B"))
                # Checksums cover fixed chunk_rows ranges whatever size the input chunks have.
                lo = 0
                while lo < rows.shape[0]:
                    take = min(rows.shape[0] - lo, chunk_rows - in_chunk)
                    hasher.update(memoryview(rows[lo : lo + take]).cast("B"))
                    lo, in_chunk = lo + take, in_chunk + take
                    if in_chunk == chunk_rows:
                        checksums.append(hasher.hexdigest())
                        hasher, in_chunk = xxhash.xxh3_64(), 0
                written += rows.shape[0]
                bar.update(rows.nbytes)
            if written != expected:
                raise TableFormatError(f"{path}: layer {layer_id} got {written} rows, its layout has {expected}")
            if in_chunk:
                checksums.append(hasher.hexdigest())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
    return checksums


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---------------------------------------------------------------------------- open
def read_manifest(table_dir: str | os.PathLike) -> tuple[dict, dict[int, LayerInfo]]:
    """The manifest of a table directory, every field checked (types, the config block
    against its fingerprint, each layer's rows against that config's layout, file names);
    returns (manifest, layer id -> LayerInfo)."""
    root = Path(table_dir)
    mpath = root / MANIFEST
    if not root.is_dir():
        raise TableFormatError(f"{root}: table directory does not exist")
    try:
        text = read_regular(mpath, MAX_MANIFEST_BYTES, TableFormatError, "manifest")
    except FileNotFoundError:
        raise TableFormatError(f"{mpath}: missing (not a table directory, or its writing did not finish)") from None
    try:  # (apart from the read: TableFormatError is a ValueError too)
        manifest = json.loads(text)
    except (ValueError, RecursionError) as e:  # ValueError: also not UTF-8, or an int of > 4300 digits
        raise TableFormatError(f"{mpath}: not valid JSON ({type(e).__name__}: {str(e)[:80]})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise TableFormatError(f"{mpath}: not an engram-sglang table manifest (format {manifest.get('format') if isinstance(manifest, dict) else None!r})")
    if not _same_int(manifest.get("version"), VERSION):
        raise TableFormatError(f"{mpath}: format version {manifest.get('version')!r}, this engram-sglang reads version {VERSION}")
    for key, want in (("row_bytes", ROW_BYTES), ("payload_bytes", PAYLOAD_BYTES), ("scale_bytes", SCALE_BYTES),
                      ("data_offset", DATA_OFFSET)):
        if not _same_int(manifest.get(key), want):
            raise TableFormatError(f"{mpath}: {key} expected {want}, found {manifest.get(key)!r}")
    if manifest.get("checksum") != "xxh3_64":
        raise TableFormatError(f"{mpath}: checksum expected 'xxh3_64', found {manifest.get('checksum')!r}")
    chunk_rows = manifest.get("chunk_rows")
    if not _is_count(chunk_rows):
        raise TableFormatError(f"{mpath}: chunk_rows must be an integer >= 1, found {chunk_rows!r}")
    try:
        cfg = _manifest_config(manifest, mpath)
        layout = EngramLayout(cfg)
    except EngramConfigError as e:  # the block names the manifest; one error class for a bad table dir
        raise TableFormatError(str(e)) from None
    entries = manifest.get("layers")
    if not isinstance(entries, list) or not entries:
        raise TableFormatError(f"{mpath}: layers must be a non-empty list, found {_short(entries)}")
    layers: dict[int, LayerInfo] = {}
    for i, e in enumerate(entries):
        info = _layer_entry(e, i, root, mpath, chunk_rows)
        if info.layer_id in layers:
            raise TableFormatError(f"{mpath}: layer {info.layer_id} is listed twice")
        layers[info.layer_id] = info
    if sorted(layers) != sorted(cfg.layer_ids):
        raise TableFormatError(f"{mpath}: lists layers {sorted(layers)}, its config block has {sorted(cfg.layer_ids)}")
    _check_rows(layers, layout, mpath, "its own config block")
    return manifest, layers


def _same_int(v, want: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v == want


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _one_line(text: str, limit: int = 120) -> str:
    """A library's words about a file we were handed, kept to one line: they may quote the
    file (safetensors quotes a header's dtype, newline and all), so control characters are
    escaped and long text is cut."""
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return text.encode("unicode_escape").decode("ascii")


def _plain_name(name) -> bool:
    """A file name inside the directory itself: no separator, not `.`/`..`, and printable (a
    NUL or a lone surrogate cannot be handed to the OS, a newline would split the one-line
    error naming the file, and no name we write has either)."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and name.isprintable()


def _manifest_config(manifest: dict, mpath: Path) -> EngramConfig:
    """The manifest's config block, which must hash to the fingerprint stated beside it."""
    fp, block = manifest.get("config_fingerprint"), manifest.get("config")
    if not isinstance(fp, str):
        raise TableFormatError(f"{mpath}: config_fingerprint must be a string, found {_short(fp)}")
    if not isinstance(block, dict):
        raise TableFormatError(f"{mpath}: config must be an object of engram_* fields, found {_short(block)}")
    cfg = EngramConfig.from_dict(block, source=f"{mpath} (config block)")
    if cfg.fingerprint() != fp:
        raise TableFormatError(
            f"{mpath}: the config block's fingerprint is {cfg.fingerprint()}, config_fingerprint says {_short(fp)} "
            f"(the manifest was edited or is corrupt); convert the tables again"
        )
    return cfg


def _layer_entry(e, i: int, root: Path, mpath: Path, chunk_rows: int) -> LayerInfo:
    if not isinstance(e, dict):
        raise TableFormatError(f"{mpath}: layers[{i}] must be an object, found {_short(e)}")
    layer_id, name, rows, sums = e.get("layer_id"), e.get("file"), e.get("rows"), e.get("checksums")
    if not isinstance(layer_id, int) or isinstance(layer_id, bool) or layer_id < 0:
        raise TableFormatError(f"{mpath}: layers[{i}].layer_id must be an integer >= 0, found {_short(layer_id)}")
    where = f"{mpath}: layer {layer_id}"
    if not _is_count(rows):
        raise TableFormatError(f"{where}: rows must be an integer >= 1, found {_short(rows)}")
    # A plain name: the manifest may only point at files of its own directory.
    if not _plain_name(name):
        raise TableFormatError(f"{where}: file must be a plain file name inside {root}, found {_short(name)}")
    path = root / name
    if os.path.lexists(path) and not inside(root, path):
        raise TableFormatError(f"{where}: file {name} is a symlink leading out of {root} (to {os.path.realpath(path)})")
    n_chunks = -(-rows // chunk_rows)
    if not isinstance(sums, list) or len(sums) != n_chunks:
        found = f"{len(sums)}" if isinstance(sums, list) else _short(sums)
        raise TableFormatError(
            f"{where}: checksums must list {n_chunks} ({rows} rows in chunks of {chunk_rows}), found {found}"
        )
    for k, c in enumerate(sums):
        if not isinstance(c, str) or not _CHECKSUM.fullmatch(c):
            raise TableFormatError(f"{where}: checksums[{k}] must be 16 hex digits (xxh3_64), found {_short(c)}")
    return LayerInfo(layer_id, path, rows, tuple(sums))


def _check_rows(layers: Mapping[int, LayerInfo], layout: EngramLayout, mpath: Path, whose: str) -> None:
    for layer_id, info in sorted(layers.items()):
        want = layout.rows(layer_id)
        if info.rows != want:
            raise TableFormatError(
                f"{mpath}: layer {layer_id} has {info.rows} rows, the layout of {whose} has {want}; "
                f"these tables do not belong to that config (convert them again)"
            )


def open_tables(table_dir: str | os.PathLike, cfg: Optional[EngramConfig] = None) -> Tables:
    """Check a table directory and map every layer file read-only.

    With `cfg`, the tables must have been built for that config (same fingerprint, its
    layers, and its layout's row count for each). Raises TableFormatError with one line
    naming the file and the expected vs found value.
    """
    root = Path(table_dir)
    manifest, layers = read_manifest(root)
    mpath = root / MANIFEST
    if cfg is not None:
        if manifest.get("config_fingerprint") != cfg.fingerprint():
            raise TableFormatError(
                f"{mpath}: tables were built for config {manifest.get('config_fingerprint')} "
                f"({_describe(manifest.get('config', {}))}), this model's config {cfg.fingerprint()} "
                f"({_describe(cfg.hash_fields())}); convert the tables again for this model"
            )
        want = set(cfg.layer_ids)
        if set(layers) != want:
            raise TableFormatError(f"{mpath}: holds layers {sorted(layers)}, the config wants {sorted(want)}")
        _check_rows(layers, EngramLayout(cfg), mpath, f"config {cfg.source}")
    maps = {}
    for layer_id, info in layers.items():
        _check_layer_file(info, manifest)
        try:
            maps[layer_id] = np.memmap(info.path, dtype=np.uint8, mode="r", offset=DATA_OFFSET,
                                       shape=(info.rows, ROW_BYTES))
        except (OSError, ValueError) as e:  # replaced between the check and the map
            raise TableFormatError(f"{info.path}: cannot map the layer file ({e})") from None
    return Tables(root, manifest, layers, maps)


def _describe(fields: Mapping) -> str:
    keys = ("engram_layer_ids", "engram_max_ngram_size", "engram_n_heads", "engram_vocab_size", "engram_compressed_vocab_size")
    return ", ".join(f"{k.removeprefix('engram_')}={fields.get(k)}" for k in keys)


def _check_layer_file(info: LayerInfo, manifest: dict) -> None:
    path = info.path
    want = DATA_OFFSET + info.rows * ROW_BYTES
    try:
        fd = open_regular(path, TableFormatError, "layer file")
    except FileNotFoundError:
        raise TableFormatError(f"{path}: layer file missing (the manifest lists it)") from None
    try:
        size = os.fstat(fd).st_size
        page = os.pread(fd, DATA_OFFSET, 0)
    except OSError as e:
        raise TableFormatError(f"{path}: cannot read ({e.strerror})") from None
    finally:
        os.close(fd)
    if size < want:
        raise TableFormatError(
            f"{path}: truncated: {info.rows} rows of {ROW_BYTES} B expected ({want} bytes), "
            f"file has {size} bytes ({max(0, size - DATA_OFFSET) / ROW_BYTES:.2f} rows)"
        )
    if size > want:
        raise TableFormatError(
            f"{path}: over-long: {info.rows} rows of {ROW_BYTES} B expected ({want} bytes), file has {size} bytes"
        )
    if len(page) < DATA_OFFSET:
        raise TableFormatError(f"{path}: header page ends early ({len(page)} of {DATA_OFFSET} bytes)")
    magic, version, hlen = _HEADER.unpack_from(page)
    if magic != _MAGIC:
        raise TableFormatError(f"{path}: not an engram-sglang layer file (magic {magic!r})")
    if version != VERSION:
        raise TableFormatError(f"{path}: header format version {version}, this engram-sglang reads version {VERSION}")
    if hlen > DATA_OFFSET - _HEADER.size:
        raise TableFormatError(f"{path}: corrupt header page (header length {hlen} > {DATA_OFFSET - _HEADER.size})")
    try:
        header = json.loads(page[_HEADER.size : _HEADER.size + hlen])
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise TableFormatError(f"{path}: corrupt header page") from None
    if not isinstance(header, dict):
        raise TableFormatError(f"{path}: corrupt header page (not a JSON object)")
    for key, want_v in (
        ("layer_id", info.layer_id),
        ("rows", info.rows),
        ("row_bytes", ROW_BYTES),
        ("config_fingerprint", manifest.get("config_fingerprint")),
    ):
        got = header.get(key)
        if got != want_v or type(got) is not type(want_v):
            raise TableFormatError(f"{path}: header {key} is {_short(got)}, the manifest says {want_v!r}")


# -------------------------------------------------------------------------- verify
def verify_tables(
    table_dir: str | os.PathLike, cfg: Optional[EngramConfig] = None, *, progress: Optional[bool] = None
) -> dict[int, int]:
    """Re-read every chunk and compare its checksum; returns layer id -> rows verified."""
    tables = open_tables(table_dir, cfg)
    chunk_rows = int(tables.manifest["chunk_rows"])
    done = {}
    for layer_id, info in tables.layers.items():
        rows = tables[layer_id]
        n_chunks = len(info.checksums)  # one per chunk_rows rows (read_manifest checked)
        fd = os.open(info.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        finally:
            os.close(fd)
        for i in tqdm(range(n_chunks), desc=f"verify {info.path.name}", disable=_no_bar(progress)):
            lo, hi = i * chunk_rows, min(info.rows, (i + 1) * chunk_rows)
            got = xxhash.xxh3_64(memoryview(np.ascontiguousarray(rows[lo:hi])).cast("B")).hexdigest()
            if got != info.checksums[i]:
                raise TableFormatError(
                    f"{info.path}: checksum mismatch in chunk {i} (rows {lo}..{hi - 1}): "
                    f"expected {info.checksums[i]}, found {got}"
                )
        done[layer_id] = info.rows
    return done


def inspect_tables(table_dir: str | os.PathLike) -> str:
    """A human summary of a table directory (no checksum pass)."""
    tables = open_tables(table_dir)
    cfg = tables.config
    lines = [
        f"table directory {tables.root}",
        f"  format {FORMAT} v{VERSION}, {ROW_BYTES} B rows, config {tables.fingerprint}",
        f"  {_describe(cfg.hash_fields())}, head_dim={cfg.head_dim}",
    ]
    total = 0
    for layer_id, info in sorted(tables.layers.items()):
        nbytes = info.rows * ROW_BYTES
        total += nbytes
        lines.append(f"  layer {layer_id:>3}: {info.rows:>12,} rows  {nbytes / 2**30:9.3f} GiB  {len(info.checksums)} chunks  {info.path.name}")
    lines.append(f"  total: {total / 2**30:.3f} GiB")
    return "\n".join(lines)


# ------------------------------------------------------------------------- convert
_INDEX = "model.safetensors.index.json"


def _tensor_names(layer_id: int) -> dict[str, list[str]]:
    base = f"layers.{layer_id}.engram.embed"
    return {kind: [f"{base}.{kind}", f"model.{base}.{kind}"] for kind in ("weight", "scale")}


def _shard_keys(shard: Path, safe_open) -> list[str]:
    """Tensor names of one shard; a shard that is not a readable safetensors file is one line."""
    with _open_shard(shard, safe_open) as f:
        return list(f.keys())


class _open_shard:
    """safe_open of a regular file, its errors (SafetensorError, OSError) as one line."""

    def __init__(self, shard: Path, safe_open):
        self.shard, self.safe_open, self.f = shard, safe_open, None

    def __enter__(self):
        from safetensors import SafetensorError

        try:
            os.close(open_regular(self.shard, TableFormatError, "checkpoint shard"))
            self.f = self.safe_open(self.shard, framework="pt").__enter__()
        except FileNotFoundError:
            raise TableFormatError(f"{self.shard}: checkpoint shard missing") from None
        except (SafetensorError, OSError) as e:
            raise TableFormatError(f"{self.shard}: not a readable safetensors file ({_one_line(str(e))})") from None
        return self.f

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)


def _index_checkpoint(ckpt: Path, safe_open) -> dict[str, Path]:
    """Tensor name -> shard file, from the index when present, else by reading every header."""
    index = ckpt / _INDEX
    if os.path.lexists(index):
        try:
            text = read_regular(index, MAX_MANIFEST_BYTES, TableFormatError, "checkpoint index")
        except FileNotFoundError:  # lexists: a symlink to nowhere
            raise TableFormatError(f"{index}: a symlink to a missing file ({os.path.realpath(index)})") from None
        try:  # (apart from the read: TableFormatError is a ValueError too)
            raw = json.loads(text)
        except (ValueError, RecursionError) as e:  # ValueError: bad JSON, not UTF-8, or an int of > 4300 digits
            raise TableFormatError(f"{index}: unreadable index ({type(e).__name__})") from None
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict):
            raise TableFormatError(f"{index}: no weight_map object (tensor name -> shard file)")
        out = {}
        for name, shard in weight_map.items():
            # Shards sit beside the index: a plain file name, never a path out of the checkpoint.
            if not _plain_name(shard):
                raise TableFormatError(f"{index}: tensor {_short(name)} maps to {_short(shard)}, not a shard file name")
            out[name] = ckpt / shard
        return out
    shards = sorted(ckpt.glob("*.safetensors"))
    if not shards:
        raise TableFormatError(f"{ckpt}: no *.safetensors files")
    names = {}
    for shard in shards:
        names.update({k: shard for k in _shard_keys(shard, safe_open)})
    return names


def convert_checkpoint(
    ckpt_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    cfg: Optional[EngramConfig] = None,
    *,
    chunk_rows: int = 1 << 16,
    progress: Optional[bool] = None,
) -> Path:
    """Pack a checkpoint's `layers.{L}.engram.embed.weight` (fp8 [R, 256]) and `.scale`
    (e8m0 [R, 8]) tensors, with or without the `model.` prefix and in any shards, into a
    table directory. The config comes from CHECKPOINT/config.json unless given.

    Every tensor's shard, dtype and shape are checked before anything is written, and the
    tables are written beside `out_dir` and swapped in only when complete (write_tables):
    a checkpoint that fails leaves an existing `out_dir` as it was."""
    from safetensors import safe_open

    ckpt = Path(ckpt_dir)
    if not ckpt.is_dir():
        raise TableFormatError(f"{ckpt}: checkpoint directory does not exist")
    if not _is_count(chunk_rows):
        raise TableFormatError(f"convert: chunk_rows must be an integer >= 1, got {chunk_rows!r}")
    cfg = cfg or EngramConfig.from_pretrained(ckpt)
    layout = EngramLayout(cfg)
    where = _index_checkpoint(ckpt, safe_open)
    sources = {}
    for layer_id in cfg.layer_ids:
        found = {}
        for kind, candidates in _tensor_names(layer_id).items():
            name = next((c for c in candidates if c in where), None)
            if name is None:
                raise TableFormatError(
                    f"{ckpt}: no tensor {candidates[0]} (nor {candidates[1]}) in {len(set(where.values()))} shard(s)"
                )
            found[kind] = (name, where[name])
        _check_tensors(found, layout.rows(layer_id), safe_open)
        sources[layer_id] = _layer_chunks(found, layout.rows(layer_id), chunk_rows, safe_open)
    return write_tables(out_dir, cfg, sources, chunk_rows=CHUNK_ROWS, progress=progress)


def _layer_tensors(found):
    (wname, wfile), (sname, sfile) = found["weight"], found["scale"]
    return ((wname, wfile, PAYLOAD_BYTES, ("F8_E4M3", "U8")), (sname, sfile, SCALE_BYTES, ("F8_E8M0", "U8")))


def _check_tensors(found, expected_rows: int, safe_open) -> None:
    """Dtype and shape of one layer's weight and scale tensors."""
    for name, shard, width, dtypes in _layer_tensors(found):
        with _open_shard(shard, safe_open) as f:
            if name not in f.keys():
                raise TableFormatError(f"{shard}: no tensor {name} (the checkpoint index says it is there)")
            sl = f.get_slice(name)
            dtype, shape = sl.get_dtype(), list(sl.get_shape())
        if dtype not in dtypes:
            raise TableFormatError(f"{shard}: {name} has dtype {dtype}, expected {dtypes[0]}")
        if shape != [expected_rows, width]:
            raise TableFormatError(f"{shard}: {name} has shape {shape}, expected [{expected_rows}, {width}]")


def _layer_chunks(found, expected_rows, chunk_rows, safe_open) -> Iterator[np.ndarray]:
    """Stream packed chunks of one layer from its (possibly different) weight and scale shards."""
    from safetensors import SafetensorError

    (wname, wfile, _, _), (sname, sfile, _, _) = _layer_tensors(found)
    with _open_shard(wfile, safe_open) as fw, _open_shard(sfile, safe_open) as fs:
        w, s = fw.get_slice(wname), fs.get_slice(sname)
        for lo in range(0, expected_rows, chunk_rows):
            hi = min(expected_rows, lo + chunk_rows)
            try:
                chunk = pack(w[lo:hi], s[lo:hi]).numpy()
            except (SafetensorError, OSError) as e:  # a shard changed or failed under us
                raise TableFormatError(f"{wfile} / {sfile}: reading rows {lo}..{hi - 1} of {wname} failed ({_one_line(str(e))})") from None
            yield chunk
