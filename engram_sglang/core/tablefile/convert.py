"""Converting a checkpoint's Engram tensors (fp8 weight and e8m0 scale, any shards) into a
table directory, every tensor checked before anything is written."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from ..config import EngramConfig
from ..errors import TableFormatError
from ..fileio import open_regular
from ..hashing import EngramLayout
from ..rowformat import PAYLOAD_BYTES, SCALE_BYTES, pack
from .fileformat import CHUNK_ROWS, _is_count, _one_line
from .provenance import checkpoint_provenance, read_index
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
) -> Path:
    """Pack a checkpoint's `layers.{L}.engram.embed.weight` (fp8 [R, 256]) and `.scale`
    (e8m0 [R, 8]) tensors, with or without the `model.` prefix and in any shards, into a
    table directory. The config comes from CHECKPOINT/config.json unless given; the
    checkpoint's identity is recorded in the manifest (provenance.py).

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
    provenance = checkpoint_provenance(ckpt)  # recorded in the manifest, checked at start-up
    # The path written, resolved now: `.` or `sub/../x` may name another directory after the swap.
    written = Path(os.path.realpath(out_dir))
    _check_out_parent(Path(out_dir), written)
    write_tables(out_dir, cfg, sources, chunk_rows=CHUNK_ROWS, progress=progress, provenance=provenance)
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
