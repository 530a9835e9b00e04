"""Packed table files: one directory per model, one file of packed 264-byte rows per layer.

    DIR/manifest.json      format version, config fingerprint, rows per layer, chunk checksums
    DIR/layer-{L}.rows     a 4 KiB header page, then rows end to end (data page-aligned)

Written once (convert from a checkpoint, or the demo's generator), streamed chunk by chunk
so memory does not grow with the table, each file under a temporary name renamed into
place, the manifest last: a directory with a manifest is complete. Opened read-only as
memory maps after every size and fingerprint check; `verify_tables` re-reads the checksums.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Optional, Union

import numpy as np
import torch
import xxhash
from tqdm.auto import tqdm

from .config import EngramConfig
from .errors import TableFormatError
from .hashing import EngramLayout
from .rowformat import PAYLOAD_BYTES, ROW_BYTES, SCALE_BYTES, pack

FORMAT = "engram-sglang packed rows"
VERSION = 1
MANIFEST = "manifest.json"
DATA_OFFSET = 4096  # header page; rows start page-aligned
CHUNK_ROWS = 1 << 18  # rows per checksum (~66 MiB): a verify error names a small range
_MAGIC = b"ENGRAMRW"
_HEADER = struct.Struct("<8sII")  # magic, format version, header JSON length

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
    out.mkdir(parents=True, exist_ok=True)
    # A stale manifest would vouch for files being rewritten: drop it first.
    (out / MANIFEST).unlink(missing_ok=True)
    layers = []
    for layer_id in cfg.layer_ids:
        expected = layout.rows(layer_id)
        path = out / layer_file_name(layer_id)
        checksums = _write_layer(path, layer_id, cfg, expected, rows_by_layer[layer_id], chunk_rows, progress)
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
    _atomic_write(out / MANIFEST, json.dumps(manifest, indent=1).encode())
    return out


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
    root = Path(table_dir)
    mpath = root / MANIFEST
    if not root.is_dir():
        raise TableFormatError(f"{root}: table directory does not exist")
    try:
        manifest = json.loads(mpath.read_text())
    except FileNotFoundError:
        raise TableFormatError(f"{mpath}: missing (not a table directory, or its writing did not finish)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TableFormatError(f"{mpath}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise TableFormatError(f"{mpath}: not an engram-sglang table manifest (format {manifest.get('format') if isinstance(manifest, dict) else None!r})")
    if manifest.get("version") != VERSION:
        raise TableFormatError(f"{mpath}: format version {manifest.get('version')!r}, this engram-sglang reads version {VERSION}")
    if manifest.get("row_bytes") != ROW_BYTES:
        raise TableFormatError(f"{mpath}: row_bytes expected {ROW_BYTES}, found {manifest.get('row_bytes')!r}")
    if manifest.get("data_offset") != DATA_OFFSET:
        raise TableFormatError(f"{mpath}: data_offset expected {DATA_OFFSET}, found {manifest.get('data_offset')!r}")
    try:
        layers = {
            int(e["layer_id"]): LayerInfo(int(e["layer_id"]), root / e["file"], int(e["rows"]), tuple(e["checksums"]))
            for e in manifest["layers"]
        }
    except (KeyError, TypeError, ValueError) as e:
        raise TableFormatError(f"{mpath}: malformed layers entry ({e!r})") from None
    return manifest, layers


def open_tables(table_dir: str | os.PathLike, cfg: Optional[EngramConfig] = None) -> Tables:
    """Check a table directory and map every layer file read-only.

    With `cfg`, the tables must have been built for that config (same fingerprint).
    Raises TableFormatError with one line naming the file and the expected vs found value.
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
    maps = {}
    for layer_id, info in layers.items():
        _check_layer_file(info, manifest)
        maps[layer_id] = np.memmap(info.path, dtype=np.uint8, mode="r", offset=DATA_OFFSET, shape=(info.rows, ROW_BYTES))
    return Tables(root, manifest, layers, maps)


def _describe(fields: Mapping) -> str:
    keys = ("engram_layer_ids", "engram_max_ngram_size", "engram_n_heads", "engram_vocab_size", "engram_compressed_vocab_size")
    return ", ".join(f"{k.removeprefix('engram_')}={fields.get(k)}" for k in keys)


def _check_layer_file(info: LayerInfo, manifest: dict) -> None:
    path = info.path
    want = DATA_OFFSET + info.rows * ROW_BYTES
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            page = f.read(DATA_OFFSET)
    except FileNotFoundError:
        raise TableFormatError(f"{path}: layer file missing (the manifest lists it)") from None
    except OSError as e:
        raise TableFormatError(f"{path}: cannot read ({e.strerror})") from None
    if size < want:
        raise TableFormatError(
            f"{path}: truncated: {info.rows} rows of {ROW_BYTES} B expected ({want} bytes), "
            f"file has {size} bytes ({max(0, size - DATA_OFFSET) / ROW_BYTES:.2f} rows)"
        )
    if size > want:
        raise TableFormatError(
            f"{path}: over-long: {info.rows} rows of {ROW_BYTES} B expected ({want} bytes), file has {size} bytes"
        )
    magic, version, hlen = _HEADER.unpack_from(page)
    if magic != _MAGIC:
        raise TableFormatError(f"{path}: not an engram-sglang layer file (magic {magic!r})")
    try:
        header = json.loads(page[_HEADER.size : _HEADER.size + hlen])
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise TableFormatError(f"{path}: corrupt header page") from None
    for key, want_v in (
        ("layer_id", info.layer_id),
        ("rows", info.rows),
        ("row_bytes", ROW_BYTES),
        ("config_fingerprint", manifest.get("config_fingerprint")),
    ):
        if header.get(key) != want_v:
            raise TableFormatError(f"{path}: header {key} is {header.get(key)!r}, the manifest says {want_v!r}")


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
        n_chunks = -(-info.rows // chunk_rows)
        if len(info.checksums) != n_chunks:
            raise TableFormatError(f"{info.path}: manifest has {len(info.checksums)} checksums, {n_chunks} chunks expected")
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
def _tensor_names(layer_id: int) -> dict[str, list[str]]:
    base = f"layers.{layer_id}.engram.embed"
    return {kind: [f"{base}.{kind}", f"model.{base}.{kind}"] for kind in ("weight", "scale")}


def _index_checkpoint(ckpt: Path) -> dict[str, Path]:
    """Tensor name -> shard file, from the index when present, else by reading every header."""
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise TableFormatError(f"{index}: unreadable index ({e!r})") from None
        return {name: ckpt / shard for name, shard in weight_map.items()}
    from safetensors import safe_open

    shards = sorted(ckpt.glob("*.safetensors"))
    if not shards:
        raise TableFormatError(f"{ckpt}: no *.safetensors files")
    names = {}
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            names.update({k: shard for k in f.keys()})
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
    table directory. The config comes from CHECKPOINT/config.json unless given."""
    from safetensors import safe_open

    ckpt = Path(ckpt_dir)
    if not ckpt.is_dir():
        raise TableFormatError(f"{ckpt}: checkpoint directory does not exist")
    cfg = cfg or EngramConfig.from_pretrained(ckpt)
    layout = EngramLayout(cfg)
    where = _index_checkpoint(ckpt)
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
        sources[layer_id] = _layer_chunks(found, layout.rows(layer_id), chunk_rows, safe_open)
    return write_tables(out_dir, cfg, sources, chunk_rows=CHUNK_ROWS, progress=progress)


def _layer_chunks(found, expected_rows, chunk_rows, safe_open) -> Iterator[np.ndarray]:
    """Stream packed chunks of one layer from its (possibly different) weight and scale shards."""
    (wname, wfile), (sname, sfile) = found["weight"], found["scale"]
    with safe_open(wfile, framework="pt") as fw, safe_open(sfile, framework="pt") as fs:
        w, s = fw.get_slice(wname), fs.get_slice(sname)
        for name, shard, sl, width, dtypes in (
            (wname, wfile, w, PAYLOAD_BYTES, ("F8_E4M3", "U8")),
            (sname, sfile, s, SCALE_BYTES, ("F8_E8M0", "U8")),
        ):
            shape = list(sl.get_shape())
            if sl.get_dtype() not in dtypes:
                raise TableFormatError(f"{shard}: {name} has dtype {sl.get_dtype()}, expected {dtypes[0]}")
            if shape != [expected_rows, width]:
                raise TableFormatError(f"{shard}: {name} has shape {shape}, expected [{expected_rows}, {width}]")
        for lo in range(0, expected_rows, chunk_rows):
            hi = min(expected_rows, lo + chunk_rows)
            yield pack(w[lo:hi], s[lo:hi]).numpy()
