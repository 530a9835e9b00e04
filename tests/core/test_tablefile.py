"""Packed table files on real disk: write, open, verify, convert, and every bad-input case."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engram_sglang import EngramLayout
from engram_sglang.core.errors import TableFormatError
from engram_sglang.core.rowformat import ROW_BYTES, split
from engram_sglang.core.tablefile import (
    DATA_OFFSET,
    MANIFEST,
    convert_checkpoint,
    inspect_tables,
    layer_file_name,
    open_tables,
    verify_tables,
    write_tables,
)
from tests.support.tables import small_config

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


# ---------------------------------------------------------------- hostile inputs
def edit_manifest(out, change):
    mpath = out / MANIFEST
    manifest = json.loads(mpath.read_text())
    change(manifest)
    mpath.write_text(json.dumps(manifest))


def snapshot(path):
    """Every file under `path` with its bytes, and the names beside it."""
    files = {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}
    return files, sorted(p.name for p in path.parent.iterdir())


def forge(out, cfg, rows_by_layer, config_block=None):
    """A self-consistent table directory (headers, checksums, manifest) of any row counts:
    what a buggy or hostile writer could leave."""
    from engram_sglang.core import tablefile
    from engram_sglang.core.tablefile.write import _write_layer

    out.mkdir()
    layers = []
    for L, rows in rows_by_layer.items():
        path = out / layer_file_name(L)
        sums = _write_layer(path, L, cfg, rows.shape[0], rows, 1000, False)
        layers.append({"layer_id": L, "file": path.name, "rows": rows.shape[0], "checksums": sums})
    block = config_block or {**cfg.hash_fields(), "engram_num_embeddings": list(EngramLayout(cfg).num_embeddings)}
    (out / MANIFEST).write_text(json.dumps({
        "format": tablefile.FORMAT, "version": 1, "row_bytes": 264, "payload_bytes": 256, "scale_bytes": 8,
        "data_offset": DATA_OFFSET, "chunk_rows": 1000, "checksum": "xxh3_64",
        "config_fingerprint": cfg.fingerprint(), "config": block, "layers": layers}))
    return out


def test_row_counts_are_checked_against_the_layout(tmp_path, rng):
    """A table of 500 rows for a layout of more (ids past row 500 would read as zero rows
    on a GPU) is refused by open_tables with and without a config, and by every placement."""
    from engram_sglang.core.errors import EngramError
    from engram_sglang.core.stores import open_store

    tables = random_tables(rng)
    short = forge(tmp_path / "short", CFG, {1: tables[1][:500], 3: tables[3]})
    want = EngramLayout(CFG).rows(1)
    for cfg in (None, CFG):
        with pytest.raises(TableFormatError, match=f"layer 1 has 500 rows, the layout of .* has {want}"):
            verify_tables(short, cfg, progress=False)
    for placement in ("device", "host", "disk"):
        with pytest.raises(EngramError, match="layer 1 has 500 rows"):
            open_store(short, placement, cfg=CFG)
    # A config block that states the short counts disagrees with its own prime layout.
    block = {**CFG.hash_fields(), "engram_num_embeddings": [500, EngramLayout(CFG).rows(3)]}
    lying = forge(tmp_path / "lying", CFG, {1: tables[1][:500], 3: tables[3]}, config_block=block)
    with pytest.raises(EngramError, match=r"manifest.json \(config block\): engram_num_embeddings is \[500, "):
        open_tables(lying)
    # Row counts longer than the layout, too.
    long = forge(tmp_path / "long", CFG, {1: np.concatenate([tables[1], tables[1][:7]]), 3: tables[3]})
    with pytest.raises(TableFormatError, match=f"layer 1 has {want + 7} rows"):
        open_tables(long, CFG)


def _set_layer(key, value, index=0):
    def change(m):
        m["layers"][index][key] = value
    return change


@pytest.mark.parametrize("change,message", [
    (lambda m: m.update(layers=[]), "layers must be a non-empty list, found \\[\\]"),
    (lambda m: m.update(layers={"1": {}}), "layers must be a non-empty list"),
    (lambda m: m.pop("layers"), "layers must be a non-empty list, found None"),
    (lambda m: m["layers"].pop(), r"lists layers \[1\], its config block has \[1, 3\]"),
    (lambda m: m["layers"].append(m["layers"][0]), "layer 1 is listed twice"),
    (lambda m: m["config"].update(engram_n_heads=5), "the config block's fingerprint is .* config_fingerprint says"),
    (lambda m: m.update(config_fingerprint="0123456789abcdef"), "config_fingerprint says '?0123456789abcdef"),
    (lambda m: m.update(config_fingerprint=7), "config_fingerprint must be a string, found 7"),
    (lambda m: m.update(config=[1]), "config must be an object of engram_\\* fields, found \\[1\\]"),
    (lambda m: m["config"].pop("engram_n_heads"), r"\(config block\): missing Engram field\(s\) engram_n_heads"),
    (lambda m: m["config"].update(engram_n_heads=10**9), "engram_n_heads must be an integer >= 1 \\(and <= 64\\)"),
    (lambda m: m.update(version=True), "format version True, this engram-sglang reads version 1"),
    (lambda m: m.update(version="1"), "format version '1'"),
    (lambda m: m.update(version=1.0), "format version 1.0"),
    (lambda m: m.update(row_bytes=264.0), "row_bytes expected 264, found 264.0"),
    (lambda m: m.update(data_offset=True), "data_offset expected 4096, found True"),
    (lambda m: m.update(chunk_rows=0), "chunk_rows must be an integer >= 1, found 0"),
    (lambda m: m.update(chunk_rows="1000"), "chunk_rows must be an integer >= 1, found '1000'"),
    (lambda m: m.update(checksum="md5"), "checksum expected 'xxh3_64', found 'md5'"),
    (_set_layer("rows", "890"), "layer 1: rows must be an integer >= 1, found '890'"),
    (_set_layer("rows", 890.9), "layer 1: rows must be an integer >= 1, found 890.9"),
    (_set_layer("rows", True), "layer 1: rows must be an integer >= 1, found True"),
    (_set_layer("rows", -5), "layer 1: rows must be an integer >= 1, found -5"),
    (_set_layer("rows", None), "layer 1: rows must be an integer >= 1, found None"),
    (_set_layer("layer_id", True), r"layers\[0\].layer_id must be an integer >= 0, found True"),
    (_set_layer("layer_id", "1"), r"layers\[0\].layer_id must be an integer >= 0, found '1'"),
    (_set_layer("checksums", "abc"), "layer 1: checksums must list 1 .* found 'abc'"),
    (_set_layer("checksums", []), "layer 1: checksums must list 1 .* found 0"),
    (_set_layer("checksums", [5]), r"layer 1: checksums\[0\] must be 16 hex digits \(xxh3_64\), found 5"),
    (_set_layer("checksums", ["zz" * 8]), r"checksums\[0\] must be 16 hex digits"),
    (lambda m: m["layers"].__setitem__(0, "layer-1.rows"), r"layers\[0\] must be an object, found 'layer-1.rows'"),
])
def test_malformed_manifests_get_one_line(tmp_path, rng, change, message):
    out = write_tables(tmp_path / "t", CFG, random_tables(rng), progress=False)
    edit_manifest(out, change)
    with pytest.raises(TableFormatError, match=message) as e:
        verify_tables(out, progress=False)
    assert "\n" not in str(e.value) and str(out / MANIFEST) in str(e.value)


@pytest.mark.parametrize("text", ["[]", "7", '"x"', "null", "{", "\udcff", "[" * 50000, '{"format": 1}'])
def test_manifest_that_is_not_an_object(tmp_path, text):
    (tmp_path / MANIFEST).write_bytes(text.encode(errors="surrogateescape"))
    with pytest.raises(TableFormatError, match="manifest.json: not (valid JSON|an engram-sglang table manifest)"):
        open_tables(tmp_path)


def test_header_page_is_checked(tmp_path, rng):
    """The version word, the header length and the header JSON's shape and types."""
    import struct

    out = write_tables(tmp_path / "t", CFG, random_tables(rng), progress=False)
    path = out / layer_file_name(1)
    good = path.read_bytes()

    def with_page(page: bytes, match: str):
        path.write_bytes(page.ljust(DATA_OFFSET, b"\0") + good[DATA_OFFSET:])
        with pytest.raises(TableFormatError, match=match):
            open_tables(out)

    magic, version, hlen = struct.unpack_from("<8sII", good)
    header = good[16 : 16 + hlen]
    with_page(struct.pack("<8sII", magic, 2, hlen) + header, "layer-1.rows: header format version 2, this engram-sglang reads version 1")
    with_page(struct.pack("<8sII", magic, 1, 1 << 31) + header, "corrupt header page \\(header length 2147483648")
    for bad in (b"[1, 2]", b"null", b"\xff\xfe"):
        with_page(struct.pack("<8sII", magic, 1, len(bad)) + bad, "corrupt header page")
    fields = json.loads(header)
    for key, value in (("rows", str(fields["rows"])), ("rows", float(fields["rows"])), ("layer_id", True)):
        bad = json.dumps({**fields, key: value}).encode()
        with_page(struct.pack("<8sII", magic, 1, len(bad)) + bad, f"header {key} is {value!r}, the manifest says")
    path.write_bytes(good)
    open_tables(out)


def _alarm(seconds):
    """Turn a hang into a failure: SIGALRM interrupts a blocking open/read of the main thread."""
    import signal

    class Hung(Exception):  # not TimeoutError: that is an OSError, which the code may catch
        pass

    def fire(*_):
        raise Hung(f"hung for {seconds} s")

    signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)


def test_fifos_and_other_non_regular_files_are_refused_without_blocking(tmp_path, rng):
    import os
    import signal

    from engram_sglang.core.stores import open_store

    out = write_tables(tmp_path / "t", CFG, random_tables(rng), progress=False)
    _alarm(20)
    try:
        path = out / layer_file_name(3)
        path.unlink()
        os.mkfifo(path)
        for call in (lambda: verify_tables(out, progress=False), lambda: inspect_tables(out),
                     lambda: open_store(out, "disk", cfg=CFG), lambda: open_store(out, "host", cfg=CFG)):
            with pytest.raises(TableFormatError, match="layer-3.rows: the layer file is a FIFO, not a regular file"):
                call()
        path.unlink()
        path.mkdir()
        with pytest.raises(TableFormatError, match="layer-3.rows: the layer file is a directory"):
            open_tables(out)
        path.rmdir()
        path.symlink_to("/dev/zero")
        with pytest.raises(TableFormatError, match="layer 3: file layer-3.rows is a symlink leading out of"):
            open_tables(out)
        mpath = out / MANIFEST
        mpath.unlink()
        os.mkfifo(mpath)
        with pytest.raises(TableFormatError, match="manifest.json: the manifest is a FIFO, not a regular file"):
            open_tables(out)
    finally:
        signal.alarm(0)


def test_manifest_may_only_name_files_of_its_directory(tmp_path, rng):
    import shutil

    tables = random_tables(rng)
    out = write_tables(tmp_path / "t", CFG, tables, progress=False)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(out / layer_file_name(1), elsewhere / layer_file_name(1))
    sub = out / "sub"
    for name in ("../elsewhere/layer-1.rows", str(elsewhere / layer_file_name(1)), "sub/layer-1.rows", "..", ".",
                 "", 5, None, "layer-1.rows\0x"):
        edit_manifest(out, _set_layer("file", name))
        with pytest.raises(TableFormatError, match="layer 1: file must be a plain file name inside"):
            open_tables(out)
    # A symlink whose target lies outside the directory, directly or through a subdirectory.
    edit_manifest(out, _set_layer("file", "escape.rows"))
    (out / "escape.rows").symlink_to(elsewhere / layer_file_name(1))
    with pytest.raises(TableFormatError, match="file escape.rows is a symlink leading out of"):
        open_tables(out)
    sub.symlink_to(elsewhere)
    (out / "escape2.rows").symlink_to(sub / layer_file_name(1))
    edit_manifest(out, _set_layer("file", "escape2.rows"))
    with pytest.raises(TableFormatError, match="file escape2.rows is a symlink leading out of"):
        open_tables(out)
    # A symlink to another name inside the directory is the same file: fine.
    (out / "alias.rows").symlink_to(layer_file_name(1))
    edit_manifest(out, _set_layer("file", "alias.rows"))
    assert np.array_equal(open_tables(out, CFG)[1], tables[1])


# ------------------------------------------------------- writing never destroys
def test_a_failed_write_or_convert_leaves_the_old_directory_untouched(tmp_path, rng):
    tables = random_tables(rng)
    ckpt = make_checkpoint(tmp_path / "ckpt", tables)
    out = convert_checkpoint(ckpt, tmp_path / "out" / "tables", progress=False)
    before = snapshot(out)
    other = random_tables(rng)
    # Layer 1 is written whole before layer 3 fails, mid-way through its rows.
    def failing():
        yield other[3][:1500]
        raise TableFormatError("source failed mid-layer")

    for bad in ({1: other[1], 3: other[3][:-1]}, {1: other[1], 3: failing()},
                {1: other[1], 3: np.zeros((other[3].shape[0], 263), np.uint8)}):
        with pytest.raises(TableFormatError):
            write_tables(out, CFG, bad, chunk_rows=1000, progress=False)
        assert snapshot(out) == before
    # A bad checkpoint: a tensor of the wrong shape, and a shard that is not safetensors.
    bad_ckpt = make_checkpoint(tmp_path / "bad", other)
    save_file({"model.layers.3.engram.embed.scale": torch.zeros(10, 8, dtype=torch.uint8)},
              bad_ckpt / "model-00002-of-00002.safetensors")
    with pytest.raises(TableFormatError, match=r"has shape \[10, 8\]"):
        convert_checkpoint(bad_ckpt, out, progress=False)
    assert snapshot(out) == before
    (bad_ckpt / "model-00002-of-00002.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(TableFormatError, match="model-00002-of-00002.safetensors: not a readable safetensors file"):
        convert_checkpoint(bad_ckpt, out, progress=False)
    assert snapshot(out) == before
    verify_tables(out, CFG, progress=False)
    # A good convert replaces it whole.
    convert_checkpoint(make_checkpoint(tmp_path / "good2", other), out, progress=False)
    assert all(np.array_equal(open_tables(out, CFG)[L], other[L]) for L in other)
    assert sorted(p.name for p in out.parent.iterdir()) == sorted(before[1])


def test_writing_refuses_to_replace_what_is_not_a_table(tmp_path, rng):
    tables = random_tables(rng)
    target = tmp_path / "home"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(TableFormatError, match=r"home: holds files that are not a table's \(notes.txt\); not replacing it"):
        write_tables(target, CFG, tables, progress=False)
    assert (target / "notes.txt").read_text() == "mine"
    (tmp_path / "file").write_text("x")
    with pytest.raises(TableFormatError, match="file: exists and is not a directory"):
        write_tables(tmp_path / "file", CFG, tables, progress=False)
    # An empty directory, and a symlink to a table directory (replaced where it points).
    (tmp_path / "empty").mkdir()
    write_tables(tmp_path / "empty", CFG, tables, progress=False)
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    other = random_tables(rng)
    write_tables(tmp_path / "link", CFG, other, progress=False)
    assert (tmp_path / "link").is_symlink()
    assert np.array_equal(open_tables(tmp_path / "empty", CFG)[1], other[1])


def test_concurrent_writers_never_mix_contents(tmp_path, rng):
    """Two writers into one directory, forced to interleave chunk by chunk: the result is
    one writer's tables whole (the later swap wins), and it verifies."""
    import threading

    a, b = random_tables(rng), random_tables(rng)
    out = tmp_path / "t"
    barrier = threading.Barrier(2, timeout=30)

    def lockstep(rows):
        for lo in range(0, rows.shape[0], 500):
            barrier.wait()
            yield rows[lo : lo + 500]

    errors = []

    def writer(tables):
        try:
            write_tables(out, CFG, {L: lockstep(r) for L, r in tables.items()}, chunk_rows=1000, progress=False)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=writer, args=(t,)) for t in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    verify_tables(out, CFG, progress=False)
    got = open_tables(out, CFG)
    winner = a if np.array_equal(got[1], a[1]) else b
    assert all(np.array_equal(got[L], winner[L]) for L in CFG.layer_ids)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]  # no temporary directory left


def test_concurrent_converts_never_mix_contents(tmp_path, rng):
    from concurrent.futures import ThreadPoolExecutor

    sources = [random_tables(rng) for _ in range(3)]
    ckpts = [make_checkpoint(tmp_path / f"ckpt{i}", t) for i, t in enumerate(sources)]
    out = tmp_path / "tables"
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda c: convert_checkpoint(c, out, chunk_rows=333, progress=False), ckpts))
    verify_tables(out, CFG, progress=False)
    got = open_tables(out, CFG)
    assert sum(all(np.array_equal(got[L], t[L]) for L in CFG.layer_ids) for t in sources) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt0", "ckpt1", "ckpt2", "tables"]


def test_checkpoint_index_or_shard_that_is_not_a_file(tmp_path, rng):
    import os
    import signal

    ckpt = make_checkpoint(tmp_path / "ckpt", random_tables(rng))
    index = ckpt / "model.safetensors.index.json"
    _alarm(20)
    try:
        index.unlink()
        os.mkfifo(index)
        with pytest.raises(TableFormatError, match="index.json: the checkpoint index is a FIFO, not a regular file"):
            convert_checkpoint(ckpt, tmp_path / "t", progress=False)
        index.unlink()
        shard = ckpt / "model-00002-of-00002.safetensors"
        shard.unlink()
        os.mkfifo(shard)
        with pytest.raises(TableFormatError, match="00002.safetensors: the checkpoint shard is a FIFO"):
            convert_checkpoint(ckpt, tmp_path / "t", progress=False)
    finally:
        signal.alarm(0)
    assert not (tmp_path / "t").exists()
