"""Fuzz a table directory: manifest.json, each layer file's header page and size, and what
the paths are (regular file, directory, FIFO, symlink out of the directory, ...), through
`verify_tables` (which opens through `open_tables`) and `inspect_tables`, the parsers
behind `engram-sglang tables verify/inspect` and every placement's open.

Beyond the rule (fuzz/fuzz_common.py), a directory that verifies must be what a reader may
trust: its layer files are regular files inside it, its rows are the baseline's bytes,
with a config its layers and row counts are that config's layout, and without one the
config block its manifest declares is valid, matches its fingerprint and verifies too.

    python -m fuzz.fuzz_tables -runs=2000 -seed=1 NEW_DIR fuzz/corpus/tables
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import atheris
import numpy as np

from fuzz.fuzz_common import RuleBroken, Scratch, dump_json, edit_bytes, edit_json, fuzz_main, instrumented, keep_rule, pick_kind, place  # isort: skip (one line)

with instrumented():
    from engram_sglang.core.config import EngramConfig
    from engram_sglang.core.hashing import EngramLayout
    from engram_sglang.core.tablefile import DATA_OFFSET, MANIFEST, inspect_tables, open_tables, verify_tables, write_tables  # isort: skip

# Two layers of 8 and 18 rows: every file is a few KiB, so a run is parsing, not I/O.
TINY = EngramConfig(layer_ids=(0, 2), max_ngram_size=2, n_heads=2, head_dim=256, vocab_size=3,
                    compressed_vocab_size=3, pad_token_id=0)
OTHER = EngramConfig(layer_ids=(0, 2), max_ngram_size=2, n_heads=2, head_dim=256, vocab_size=3,
                     compressed_vocab_size=3, pad_token_id=1)
_HEADER = struct.Struct("<8sII")  # magic, version, header JSON length (tablefile's layout)

scratch = Scratch("tables")


def _baseline() -> tuple[bytes, dict[int, bytes], dict[int, np.ndarray]]:
    """A valid table directory for TINY, as bytes: manifest, layer files, rows."""
    rng = np.random.default_rng(0)
    rows = {L: rng.integers(0, 256, (n, 264), dtype=np.uint8) for L, n in zip(TINY.layer_ids, EngramLayout(TINY).num_embeddings)}
    out = write_tables(scratch.fresh() / "t", TINY, rows, progress=False)
    files = {L: (out / f"layer-{L}.rows").read_bytes() for L in TINY.layer_ids}
    return (out / MANIFEST).read_bytes(), files, rows


BASE_MANIFEST, BASE_FILES, BASE_ROWS = _baseline()
NAMES = ("layer-0.rows", "layer-2.rows", "link.rows", "../outside/layer-0.rows", "sub/layer-0.rows", "manifest.json")


def _edit_layer_file(data: bytes, fdp: atheris.FuzzedDataProvider) -> bytes:
    """Edit one region of a layer file: the header struct, its JSON, the rows, or the whole."""
    region = fdp.ConsumeIntInRange(0, 3)
    if region == 0:
        return edit_bytes(data[: _HEADER.size], fdp) + data[_HEADER.size :]
    if region == 1:
        magic, version, hlen = _HEADER.unpack_from(data)
        header = edit_json(json.loads(data[_HEADER.size : _HEADER.size + hlen]), fdp, NAMES)
        blob = dump_json(header)
        page = _HEADER.pack(magic, version, len(blob)) + blob
        return page.ljust(DATA_OFFSET, b"\0") + data[DATA_OFFSET:] if len(page) <= DATA_OFFSET else page + data[DATA_OFFSET:]
    if region == 2:
        return data[:DATA_OFFSET] + edit_bytes(data[DATA_OFFSET:], fdp)
    return edit_bytes(data, fdp)


def make_tables(fdp: atheris.FuzzedDataProvider, root: Path) -> Path:
    """The table directory an input describes, at root/t; valid copies sit in root/outside."""
    table_dir, outside = root / "t", root / "outside"
    table_dir.mkdir()
    for L, data in BASE_FILES.items():
        place(outside / f"layer-{L}.rows", data, "file", outside)
    (table_dir / "link.rows").symlink_to(outside / "layer-0.rows")
    extra = (*NAMES, str(outside / "layer-0.rows"))

    mode = fdp.ConsumeIntInRange(0, 2)
    manifest = BASE_MANIFEST
    if mode in (0, 2):
        manifest = dump_json(edit_json(json.loads(manifest), fdp, extra))
    if mode in (1, 2):
        manifest = edit_bytes(manifest, fdp)
    place(table_dir / MANIFEST, manifest, pick_kind(fdp), outside)
    for L, data in BASE_FILES.items():
        if fdp.ConsumeBool():
            data = _edit_layer_file(data, fdp)
        place(table_dir / f"layer-{L}.rows", data, pick_kind(fdp), outside)
    return table_dir


def check(table_dir: Path, cfg) -> None:
    """The rule for verify and inspect, and what a directory that verifies must be."""
    names = [table_dir]
    done, err = keep_rule(lambda: verify_tables(table_dir, cfg, progress=False), names)
    keep_rule(lambda: inspect_tables(table_dir), names)
    if err is not None:
        return
    tables = open_tables(table_dir, cfg)
    root = table_dir.resolve()
    for L, info in tables.layers.items():
        real = info.path.resolve()
        if real.parent != root or not real.is_file():
            raise RuleBroken(f"verified, but layer {L} reads {info.path} (-> {real}), not a file in {root}")
        if L not in BASE_ROWS or not np.array_equal(tables[L], BASE_ROWS[L]):
            raise RuleBroken(f"verified, but layer {L} holds other rows than were written")
    want = cfg
    if cfg is None:
        want, err = keep_rule(lambda: tables.config, names)
        if err is not None:
            raise RuleBroken(f"verified, but its manifest's config block is invalid: {err}")
        if want.fingerprint() != tables.fingerprint:
            raise RuleBroken(f"verified, but its config block has fingerprint {want.fingerprint()}, the manifest says {tables.fingerprint}")
        _, err = keep_rule(lambda: verify_tables(table_dir, want, progress=False), names)
        if err is not None:
            raise RuleBroken(f"verified alone, but not for the config its manifest declares: {err}")
    layout = EngramLayout(want)
    got = {L: info.rows for L, info in tables.layers.items()}
    if got != {L: layout.rows(L) for L in want.layer_ids}:
        raise RuleBroken(f"verified, but holds rows {got} for a layout of {dict(zip(want.layer_ids, layout.num_embeddings))}")


def test_one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    cfg = fdp.PickValueInList([None, TINY, OTHER])
    check(make_tables(fdp, scratch.fresh()), cfg)


if __name__ == "__main__":
    fuzz_main(test_one_input)
