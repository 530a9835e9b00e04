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

The manifest may record the checkpoint the rows came from (`provenance`), which start-up
checks against the served model directory.

By concern: `fileformat` (names, header, constants), `read` (open, verify, inspect),
`write` (write_tables, record_provenance), `layerfile` (one layer file, chunks on a thread
pool, O_DIRECT), `progress` (bar or log lines), `leftovers` (dead writers' directories),
`convert` (from a checkpoint), `provenance` (the checkpoint's identity); this package
re-exports their names.
"""

from __future__ import annotations

from .convert import convert_checkpoint
from .fileformat import (
    CHUNK_ROWS,
    DATA_OFFSET,
    FORMAT,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    VERSION,
    LayerInfo,
    RowSource,
    layer_file_name,
)
from .provenance import checkpoint_hash, checkpoint_provenance
from .read import Tables, inspect_tables, open_tables, read_manifest, verify_tables
from .write import record_provenance, write_tables

__all__ = [
    "CHUNK_ROWS",
    "DATA_OFFSET",
    "FORMAT",
    "MANIFEST",
    "MAX_MANIFEST_BYTES",
    "VERSION",
    "LayerInfo",
    "RowSource",
    "Tables",
    "checkpoint_hash",
    "checkpoint_provenance",
    "convert_checkpoint",
    "inspect_tables",
    "layer_file_name",
    "open_tables",
    "read_manifest",
    "record_provenance",
    "verify_tables",
    "write_tables",
]
