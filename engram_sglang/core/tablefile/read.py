"""Opening a table directory: every field of the manifest and the layer headers checked
(nothing in them is trusted), then each layer file mapped read-only; verify and inspect."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping, Optional

import numpy as np
import xxhash
from tqdm.auto import tqdm

from ..config import EngramConfig
from ..errors import EngramConfigError, TableFormatError
from ..fileio import inside, open_regular, pread_full, read_regular, tries_text
from ..hashing import EngramLayout
from ..rowformat import PAYLOAD_BYTES, ROW_BYTES, SCALE_BYTES
from .fileformat import (
    _CHECKSUM,
    _HEADER,
    _MAGIC,
    DATA_OFFSET,
    FORMAT,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    VERSION,
    LayerInfo,
    _is_count,
    _no_bar,
    _plain_name,
    _same_int,
    _short,
)
from .provenance import check_provenance, describe


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
    if "provenance" in manifest:  # optional: manifests written before it lack it
        check_provenance(manifest["provenance"], str(mpath))
    return manifest, layers


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
        page = pread_full(fd, DATA_OFFSET, 0)
    except OSError as e:
        raise TableFormatError(f"{path}: cannot read the header page ({e.strerror}, {tries_text(e)})") from None
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
        f"  checkpoint {describe(tables.manifest.get('provenance'))}",
    ]
    total = 0
    for layer_id, info in sorted(tables.layers.items()):
        nbytes = info.rows * ROW_BYTES
        total += nbytes
        lines.append(f"  layer {layer_id:>3}: {info.rows:>12,} rows  {nbytes / 2**30:9.3f} GiB  {len(info.checksums)} chunks  {info.path.name}")
    lines.append(f"  total: {total / 2**30:.3f} GiB")
    return "\n".join(lines)
