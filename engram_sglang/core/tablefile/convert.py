"""Converting a checkpoint's Engram tensors (fp8 weight and e8m0 scale, any shards) into a
table directory, every tensor checked before anything is written.

The checkpoint is read once: each worker of write_tables reads its chunk's weight and scale
bytes straight from the shards (os.pread at the offsets the safetensors header gives, which
safe_open has checked) and interleaves them into packed rows (rowformat.pack's layout)."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path
from typing import Optional

import numpy as np

from ..config import EngramConfig
from ..errors import TableFormatError
from ..fileio import open_regular, retry_transient, tries_text
from ..hashing import EngramLayout
from ..rowformat import PAYLOAD_BYTES, ROW_BYTES, SCALE_BYTES
from .fileformat import CHUNK_ROWS, _is_count, _one_line
from .provenance import _shard_header, checkpoint_provenance, read_index
from .write import write_tables


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
    index = read_index(ckpt)
    if index is not None:
        return {name: ckpt / shard for name, shard in index[1].items()}
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
    threads: Optional[int] = None,
    checksum_rows: int = CHUNK_ROWS,
) -> Path:
    """Pack a checkpoint's `layers.{L}.engram.embed.weight` (fp8 [R, 256]) and `.scale`
    (e8m0 [R, 8]) tensors, with or without the `model.` prefix and in any shards, into a
    table directory. The config comes from CHECKPOINT/config.json unless given; the
    checkpoint's identity is recorded in the manifest (provenance.py). `chunk_rows`: rows
    per read; `threads`: chunks in flight (write_tables); `checksum_rows`: rows per checksum
    (the manifest's chunk_rows), smaller only in tests.

    Every tensor's shard, dtype and shape are checked before anything is written, and the
    tables are written beside `out_dir` and swapped in only when complete (write_tables):
    a checkpoint that fails leaves an existing `out_dir` as it was. Returns the directory
    written, resolved (`out_dir` "." names the old, replaced directory afterwards)."""
    from safetensors import safe_open

    ckpt = Path(ckpt_dir)
    if not ckpt.is_dir():
        raise TableFormatError(f"{ckpt}: checkpoint directory does not exist")
    if not _is_count(chunk_rows):
        raise TableFormatError(f"convert: chunk_rows must be an integer >= 1, got {chunk_rows!r}")
    cfg = cfg or EngramConfig.from_pretrained(ckpt)
    layout = EngramLayout(cfg)
    where = _index_checkpoint(ckpt, safe_open)
    found_by_layer = {}
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
        found_by_layer[layer_id] = found
    provenance = checkpoint_provenance(ckpt)  # recorded in the manifest, checked at start-up
    # The path written, resolved now: `.` or `sub/../x` may name another directory after the swap.
    written = Path(os.path.realpath(out_dir))
    _check_out_parent(Path(out_dir), written)
    with contextlib.ExitStack() as stack:
        sources = {L: stack.enter_context(_LayerReader(found, layout.rows(L), chunk_rows))
                   for L, found in found_by_layer.items()}
        write_tables(out_dir, cfg, sources, chunk_rows=checksum_rows, progress=progress, provenance=provenance,
                     threads=threads)
    return written


def _check_out_parent(out: Path, written: Path) -> None:
    """The output's nearest existing ancestor must be a directory (`FILE/out`)."""
    for parent in written.parents:
        if os.path.lexists(parent):
            if not parent.is_dir():
                raise TableFormatError(f"{out}: {parent} is not a directory; name a table directory in a directory")
            return


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


def _data_offset(shard: Path, name: str, nbytes: int) -> int:
    """Where tensor `name`'s bytes start in `shard`: after the 8-byte length and the header,
    at its data_offsets (safe_open has checked the header; the size is checked again here)."""
    head = _shard_header(shard)
    try:
        begin, end = json.loads(head[8:])[name]["data_offsets"]
    except (ValueError, KeyError, TypeError) as e:
        raise TableFormatError(f"{shard}: no data_offsets for {name} in the header ({type(e).__name__})") from None
    if not (isinstance(begin, int) and isinstance(end, int) and end - begin == nbytes):
        raise TableFormatError(f"{shard}: {name} spans bytes {begin!r}..{end!r}, expected {nbytes} bytes")
    return len(head) + begin


class _LayerReader:
    """One layer's packed rows, any range on any thread, from its weight and scale tensors
    (possibly in different shards): a layerfile.RowFill."""

    def __init__(self, found, rows: int, piece_rows: int):
        self.rows, self.piece_rows = rows, piece_rows
        self.tensors = [(name, shard, width) for name, shard, width, _ in _layer_tensors(found)]
        self.fds: list[int] = []
        self.offsets: list[int] = []
        self.scratch = threading.local()  # each worker's read buffers

    def __enter__(self):
        try:
            for name, shard, width in self.tensors:
                offset = _data_offset(shard, name, self.rows * width)
                try:
                    fd = open_regular(shard, TableFormatError, "checkpoint shard")
                except FileNotFoundError:
                    raise TableFormatError(f"{shard}: checkpoint shard missing") from None
                self.fds.append(fd)
                self.offsets.append(offset)
                os.posix_fadvise(fd, offset, self.rows * width, os.POSIX_FADV_SEQUENTIAL)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        for fd in self.fds:
            os.close(fd)
        self.fds = []

    def fill(self, lo: int, out: np.ndarray) -> None:
        bufs = getattr(self.scratch, "bufs", None)
        if bufs is None:
            bufs = self.scratch.bufs = [np.empty(self.piece_rows * w, np.uint8) for _, _, w in self.tensors]
        col = 0
        for (name, shard, width), fd, offset, buf in zip(self.tensors, self.fds, self.offsets, bufs):
            for a in range(0, out.shape[0], self.piece_rows):
                n = min(self.piece_rows, out.shape[0] - a)
                view = buf[: n * width]
                try:
                    _pread_into(fd, view, offset + (lo + a) * width)
                except OSError as e:
                    raise TableFormatError(f"{shard}: reading rows {lo + a}..{lo + a + n - 1} of {name} failed "
                                           f"({_one_line(e.strerror or str(e))}, {tries_text(e)})") from None
                out[a : a + n, col : col + width] = view.reshape(n, width)
            col += width
        assert col == ROW_BYTES


def _pread_into(fd: int, view: np.ndarray, offset: int) -> None:
    """Fill `view` from `fd` at `offset` (short reads read on, transient errors are retried);
    a file that ends first is an OSError."""
    mv, got = memoryview(view).cast("B"), 0
    while got < len(mv):
        n = retry_transient(lambda: os.preadv(fd, [mv[got:]], offset + got))
        if n == 0:
            raise OSError(0, f"the file ends {len(mv) - got} bytes early (changed since it was checked?)")
        got += n
