"""Packed table files on real disk: write, open, verify, convert, and every bad-input case."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from conftest import small_config
from engram_sglang import EngramLayout
from engram_sglang.errors import TableFormatError
from engram_sglang.rowformat import ROW_BYTES, split
from engram_sglang.tablefile import (
    DATA_OFFSET,
    MANIFEST,
    convert_checkpoint,
    inspect_tables,
    layer_file_name,
    open_tables,
    verify_tables,
    write_tables,
)

CFG = small_config(500)


def random_tables(gen: torch.Generator, cfg=CFG) -> dict[int, np.ndarray]:
    layout = EngramLayout(cfg)
    return {
        L: torch.randint(0, 256, (layout.rows(L), ROW_BYTES), dtype=torch.uint8, generator=gen).numpy()
        for L in cfg.layer_ids
    }


@pytest.fixture
def written(tmp_path, rng):
    tables = random_tables(rng)
    out = write_tables(tmp_path / "tables", CFG, tables, chunk_rows=1000, progress=False)
    return out, tables


def test_round_trip_page_aligned_read_only(written):
    out, tables = written
    opened = open_tables(out, CFG)
    assert sorted(opened) == sorted(CFG.layer_ids)
    for L, rows in tables.items():
        assert opened[L].shape == rows.shape and np.array_equal(opened[L], rows)
        # First and last rows, read straight from the file at the page-aligned offset.
        raw = (out / layer_file_name(L)).read_bytes()
        assert raw[DATA_OFFSET : DATA_OFFSET + ROW_BYTES] == rows[0].tobytes()
        assert raw[-ROW_BYTES:] == rows[-1].tobytes()
        with pytest.raises(ValueError):
            opened[L][0, 0] = 1  # read-only mapping
    assert verify_tables(out, CFG, progress=False) == {L: r.shape[0] for L, r in tables.items()}
    assert not list(out.glob("*.tmp"))
    text = inspect_tables(out)
    assert "layer   1:" in text and "total:" in text


def test_chunked_source_gives_identical_files_and_checksums(tmp_path, written):
    out, tables = written
    # An iterator of odd-sized chunks (a streamed conversion) writes the same bytes.
    def pieces(rows):
        return (rows[i : i + 777] for i in range(0, len(rows), 777))

    chunks = {L: pieces(rows) for L, rows in tables.items()}
    other = write_tables(tmp_path / "again", CFG, chunks, chunk_rows=1000, progress=False)
    a, b = json.loads((out / MANIFEST).read_text()), json.loads((other / MANIFEST).read_text())
    assert a["layers"] == b["layers"] and len(a["layers"][0]["checksums"]) == 13
    for L in tables:
        assert (out / layer_file_name(L)).read_bytes() == (other / layer_file_name(L)).read_bytes()


def test_verify_names_the_corrupt_chunk(written):
    out, tables = written
    path = out / layer_file_name(3)
    data = bytearray(path.read_bytes())
    row = 2500  # in chunk 2 (rows 2000..2999)
    data[DATA_OFFSET + row * ROW_BYTES + 17] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(TableFormatError, match=r"layer-3.rows: checksum mismatch in chunk 2 \(rows 2000\.\.2999\)"):
        verify_tables(out, progress=False)


def test_truncated_and_over_long_files(written):
    out, tables = written
    path = out / layer_file_name(1)
    rows = tables[1].shape[0]
    full = path.read_bytes()
    path.write_bytes(full[:-100])
    with pytest.raises(TableFormatError, match=rf"layer-1.rows: truncated: {rows} rows of 264 B expected \({DATA_OFFSET + rows * 264} bytes\), file has {len(full) - 100} bytes"):
        open_tables(out)
    path.write_bytes(full + b"\0" * 264)
    with pytest.raises(TableFormatError, match=rf"layer-1.rows: over-long: {rows} rows of 264 B expected"):
        open_tables(out)


def test_manifest_problems(written):
    out, _ = written
    mpath = out / MANIFEST
    manifest = json.loads(mpath.read_text())
    mpath.write_text(json.dumps({**manifest, "row_bytes": 263}))
    with pytest.raises(TableFormatError, match="row_bytes expected 264, found 263"):
        open_tables(out)
    mpath.write_text(json.dumps({**manifest, "version": 99}))
    with pytest.raises(TableFormatError, match="format version 99, this engram-sglang reads version 1"):
        open_tables(out)
    mpath.write_text(json.dumps(manifest))
    other = small_config(501)
    with pytest.raises(TableFormatError, match="tables were built for config .*compressed_vocab_size=500.* this model's config .*compressed_vocab_size=501"):
        open_tables(out, other)
    (out / layer_file_name(3)).unlink()
    with pytest.raises(TableFormatError, match="layer-3.rows: layer file missing"):
        open_tables(out)
    mpath.unlink()
    with pytest.raises(TableFormatError, match="manifest.json: missing"):
        open_tables(out)
    with pytest.raises(TableFormatError, match="table directory does not exist"):
        open_tables(out / "nope")


def test_wrong_row_counts_and_interrupted_writes(tmp_path, rng):
    tables = random_tables(rng)
    short = {**tables, 3: tables[3][:-1]}
    with pytest.raises(TableFormatError, match=rf"layer 3 got {tables[3].shape[0] - 1} rows, its layout has {tables[3].shape[0]}"):
        write_tables(tmp_path / "t", CFG, short, progress=False)
    long = {**tables, 1: np.concatenate([tables[1], tables[1][:1]])}
    with pytest.raises(TableFormatError, match=f"layer 1 got more than the {tables[1].shape[0]} rows"):
        write_tables(tmp_path / "t", CFG, long, progress=False)
    with pytest.raises(TableFormatError, match=r"row chunks must be uint8 \[n, 264\]"):
        write_tables(tmp_path / "t", CFG, {**tables, 1: tables[1][:, :263]}, progress=False)
    # A failed write leaves no manifest (nothing vouches for it) and no temporary files.
    assert not (tmp_path / "t" / MANIFEST).exists()
    assert not list((tmp_path / "t").glob("*.tmp"))


# ------------------------------------------------------------------------ convert
def make_checkpoint(path, tables, *, prefix="model.", index=True):
    """A small DeepSeek-style checkpoint: fp8 weight + e8m0 scale per layer, split so that
    layer 3's weight and scale sit in different shards."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"text_config": CFG.hash_fields()}))
    w1, s1 = split(torch.from_numpy(tables[1]))
    w3, s3 = split(torch.from_numpy(tables[3]))
    shards = {
        "model-00001-of-00002.safetensors": {
            f"{prefix}layers.1.engram.embed.weight": w1,
            f"{prefix}layers.1.engram.embed.scale": s1,
            f"{prefix}layers.3.engram.embed.weight": w3,
            f"{prefix}layers.0.mlp.weight": torch.zeros(4, 4),
        },
        "model-00002-of-00002.safetensors": {f"{prefix}layers.3.engram.embed.scale": s3},
    }
    for name, tensors in shards.items():
        save_file(tensors, path / name)
    if index:
        weight_map = {k: name for name, tensors in shards.items() for k in tensors}
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


@pytest.mark.parametrize("prefix,index", [("model.", True), ("", False)])
def test_convert_from_sharded_checkpoint(tmp_path, rng, prefix, index):
    tables = random_tables(rng)
    ckpt = make_checkpoint(tmp_path / "ckpt", tables, prefix=prefix, index=index)
    out = convert_checkpoint(ckpt, tmp_path / "tables", chunk_rows=999, progress=False)
    opened = open_tables(out, CFG)
    for L, rows in tables.items():
        assert np.array_equal(opened[L], rows)
    verify_tables(out, CFG, progress=False)


def test_convert_missing_or_wrong_tensors(tmp_path, rng):
    tables = random_tables(rng)
    ckpt = make_checkpoint(tmp_path / "ckpt", tables, index=False)
    shard2 = ckpt / "model-00002-of-00002.safetensors"
    shard2.unlink()
    with pytest.raises(TableFormatError, match=r"no tensor layers.3.engram.embed.scale \(nor model.layers.3.engram.embed.scale\) in 1 shard"):
        convert_checkpoint(ckpt, tmp_path / "t", progress=False)
    save_file({"model.layers.3.engram.embed.scale": torch.zeros(10, 8)}, shard2)
    with pytest.raises(TableFormatError, match="layers.3.engram.embed.scale has dtype F32, expected F8_E8M0"):
        convert_checkpoint(ckpt, tmp_path / "t", progress=False)
    save_file({"model.layers.3.engram.embed.scale": torch.zeros(10, 8, dtype=torch.uint8).view(torch.float8_e8m0fnu)}, shard2)
    with pytest.raises(TableFormatError, match=rf"has shape \[10, 8\], expected \[{tables[3].shape[0]}, 8\]"):
        convert_checkpoint(ckpt, tmp_path / "t", progress=False)
