"""The profile file: each Engram layer's hottest rows with their read counts, for a hot-row
cache to pre-warm from (`HotRowCache(profile=...)`, stores/cache.py).

`engram-sglang profile` (profiling.py, a tool) counts the reads and picks the rows; the file
format lives here, in the core, because the stores read it. A record file (recordfile.py) of
format engram-profile-v1: per layer L `ids_L` (int32 when the rows fit), `counts_L` (uint32
when they fit), `reads_L` and `rows_L` (int64 scalars); `meta` with the config's
fingerprint and hash fields.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, NamedTuple, Optional

import numpy as np

from .errors import EngramError
from .recordfile import Record, RecordFormat, read_record, write_record

PROFILE = RecordFormat("engram-profile", 1, "profile")
FORMAT = PROFILE.tag
MAX_PROFILE_ROWS = 1 << 32  # entries of one layer's arrays in a profile file


class ProfileLayer(NamedTuple):
    """One layer of a profile: the hottest rows by count descending, their counts, the
    layer's total reads and its table rows."""

    ids: np.ndarray
    counts: np.ndarray
    reads: int
    rows: int


def write_profile_rows(path: str | os.PathLike, cfg, layers: Mapping[int, ProfileLayer], meta: dict) -> Path:
    """Write a profile of Engram config `cfg` (an EngramConfig): `layers` by layer id."""
    arrays = {}
    for layer_id, p in layers.items():
        counts = np.asarray(p.counts)
        small = counts.size == 0 or counts.max() < 2**32
        arrays[f"ids_{layer_id}"] = np.asarray(p.ids).astype(np.int32 if p.rows < 2**31 else np.int64)
        arrays[f"counts_{layer_id}"] = counts.astype(np.uint32 if small else np.int64)
        arrays[f"reads_{layer_id}"] = np.int64(p.reads)
        arrays[f"rows_{layer_id}"] = np.int64(p.rows)
    meta = {"fingerprint": cfg.fingerprint(), "hash_fields": cfg.hash_fields(), **meta}
    return write_record(path, PROFILE, arrays, meta)


class Profile:
    """A profile file: `layer(L)` -> (row ids by count descending, counts, total reads)."""

    def __init__(self, path: Path, record: Record, meta: dict):
        self.path, self.record, self.meta = path, record, meta

    @property
    def layer_ids(self) -> list[int]:
        return self.record.numbered("ids_")

    def layer(self, layer_id: int) -> tuple[np.ndarray, np.ndarray, int]:
        """(row ids >= 0, their counts, total reads) of one layer, each array's shape and type
        checked before it is read (a broken or hostile file is one line, never a huge read)."""
        if f"ids_{layer_id}" not in self.record.files:
            raise EngramError(f"{self.path}: no rows of Engram layer {layer_id} (profiled layers: {self.layer_ids})")
        where = f"{self.path}: layer {layer_id}"
        n = None
        for key in (f"ids_{layer_id}", f"counts_{layer_id}"):
            shape, dtype = self.record.header(key, where)
            if len(shape) != 1 or dtype.kind not in "iu" or shape[0] > MAX_PROFILE_ROWS or n not in (None, shape[0]):
                raise EngramError(f"{where}: {key} must be integers [n] (n the same for ids and counts, at most "
                                  f"2^32), found {dtype} {list(shape)}")
            n = shape[0]
        shape, dtype = self.record.header(f"reads_{layer_id}", where)
        if shape != () or dtype.kind not in "iu":
            raise EngramError(f"{where}: reads_{layer_id} must be one integer, found {dtype} {list(shape)}")
        ids = self.record.array(f"ids_{layer_id}", where).astype(np.int64)
        counts = self.record.array(f"counts_{layer_id}", where).astype(np.int64)
        reads = int(self.record.array(f"reads_{layer_id}", where))
        if n and int(ids.min()) < 0:
            raise EngramError(f"{where}: row id {int(ids.min())} is negative")
        return ids, counts, reads

    def close(self) -> None:
        self.record.close()


def read_profile(path: str | os.PathLike, fingerprint: Optional[str] = None) -> Profile:
    """Open a profile file; with `fingerprint`, refuse one made for another Engram config."""
    record = read_record(path, PROFILE)
    meta = record.meta
    if fingerprint is not None and meta.get("fingerprint") != fingerprint:
        record.close()
        raise EngramError(f"{record.path}: profiled for Engram config {meta.get('fingerprint')}, but the tables are "
                          f"built for {fingerprint}: its row ids mean other n-grams; profile again with this model")
    return Profile(record.path, record, meta)
