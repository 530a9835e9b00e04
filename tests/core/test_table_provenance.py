"""Table directories a server of another uid can read (modes), and the checkpoint they came from
(the manifest's provenance), on real files: convert, record, old manifests, hostile blocks."""

from __future__ import annotations

import hashlib
import json
import os
import stat

import pytest
import torch
from safetensors.torch import save_file

from engram_sglang.core.errors import TableFormatError
from engram_sglang.core.tablefile import (
    MANIFEST,
    checkpoint_hash,
    checkpoint_provenance,
    convert_checkpoint,
    inspect_tables,
    open_tables,
    read_manifest,
    record_provenance,
    write_tables,
)
from engram_sglang.core.tablefile.provenance import HEADERS, INDEX, revision
from tests.core.test_tablefile import CFG, make_checkpoint, random_tables


@pytest.fixture
def umask_077():
    """The strictest umask a convert may run under (mkdtemp's 0700 and 0600 files without the chmod)."""
    old = os.umask(0o077)
    yield
    os.umask(old)


def modes(root):
    """Path -> permission bits of a directory and everything in it."""
    found = {root: stat.S_IMODE(os.stat(root).st_mode)}
    for path in root.rglob("*"):
        found[path] = stat.S_IMODE(os.lstat(path).st_mode)
    return found


@pytest.mark.parametrize("index", [True, False])
def test_converted_tables_are_0755_and_0644_under_any_umask(tmp_path, rng, umask_077, index):
    ckpt = make_checkpoint(tmp_path / "ckpt", random_tables(rng), index=index)
    out = convert_checkpoint(ckpt, tmp_path / "tables", progress=False)
    found = modes(out)
    assert sorted(p.name for p in found if p != out) == sorted([MANIFEST, "layer-1.rows", "layer-3.rows"])
    assert {p: m for p, m in found.items() if m != (0o755 if p == out else 0o644)} == {}
    # Replacing the directory (the exchange path) gives the same modes; recording rewrites the manifest 0644.
    convert_checkpoint(ckpt, out, progress=False)
    record_provenance(out, checkpoint_provenance(ckpt))
    assert modes(out) == found
    # Negative control: what the same umask gives a directory made without the chmod.
    os.mkdir(tmp_path / "plain", 0o777)
    assert stat.S_IMODE(os.stat(tmp_path / "plain").st_mode) == 0o700


@pytest.mark.parametrize("index", [True, False])
def test_convert_records_the_checkpoint(tmp_path, rng, index):
    ckpt = make_checkpoint(tmp_path / "ckpt", random_tables(rng), index=index)
    out = convert_checkpoint(ckpt, tmp_path / "tables", progress=False)
    prov = read_manifest(out)[0]["provenance"]
    shards = sorted(p.name for p in ckpt.glob("*.safetensors"))
    assert prov["shards"] == [{"name": n, "bytes": (ckpt / n).stat().st_size} for n in shards]
    assert prov["revision"] is None
    if index:  # `sha256sum model.safetensors.index.json`
        assert prov["hashed"] == INDEX
        assert prov["checkpoint_sha256"] == hashlib.sha256((ckpt / INDEX).read_bytes()).hexdigest()
    else:  # every shard's 8-byte length + JSON header, in name order
        heads = b""
        for n in shards:
            raw = (ckpt / n).read_bytes()
            heads += raw[: 8 + int.from_bytes(raw[:8], "little")]
        assert prov["hashed"] == HEADERS and prov["checkpoint_sha256"] == hashlib.sha256(heads).hexdigest()
    assert checkpoint_hash(ckpt) == (prov["checkpoint_sha256"], prov["hashed"], shards)
    assert f"checkpoint sha256 {prov['checkpoint_sha256']}" in inspect_tables(out)
    # A checkpoint of other tensors (other headers, another index) hashes differently; the hash is of
    # names, dtypes, shapes and offsets, not of the values (a few KB read, whatever the checkpoint's size).
    other = make_checkpoint(tmp_path / "other", random_tables(rng, CFG), index=index)
    assert checkpoint_hash(other) == checkpoint_hash(ckpt)
    save_file({"extra": torch.zeros(3)}, other / "model-00002-of-00002.safetensors")
    if index:
        (other / INDEX).write_text(json.dumps({"weight_map": {"extra": "model-00002-of-00002.safetensors"}}))
    assert checkpoint_hash(other)[0] != prov["checkpoint_sha256"]


def test_tables_without_provenance_still_open_and_recording_adds_only_it(tmp_path, rng):
    ckpt = make_checkpoint(tmp_path / "ckpt", random_tables(rng), index=False)
    tables = random_tables(rng)
    out = write_tables(tmp_path / "tables", CFG, tables, chunk_rows=1000, progress=False)
    before = json.loads((out / MANIFEST).read_text())
    assert "provenance" not in before  # what older versions wrote
    open_tables(out, CFG)
    assert "checkpoint not recorded" in inspect_tables(out)
    layer_bytes = {p.name: p.read_bytes() for p in out.glob("layer-*.rows")}
    inode = os.stat(out / MANIFEST).st_ino
    assert record_provenance(out, checkpoint_provenance(ckpt), expect_layers=before["layers"]) is None
    after = json.loads((out / MANIFEST).read_text())
    assert after.pop("provenance") == checkpoint_provenance(ckpt) and after == before
    assert os.stat(out / MANIFEST).st_ino != inode  # a new file renamed over the old one
    assert {p.name: p.read_bytes() for p in out.glob("layer-*.rows")} == layer_bytes
    assert not list(out.glob("*.tmp"))
    open_tables(out, CFG)
    # A directory replaced since it was verified is refused, the manifest left as it was.
    with pytest.raises(TableFormatError, match="replaced while they were verified"):
        record_provenance(out, checkpoint_provenance(ckpt), expect_layers=[])
    # Replacing a recorded provenance returns the old one.
    assert record_provenance(out, {**checkpoint_provenance(ckpt), "revision": "v2"})["revision"] is None


def test_a_manifest_that_cannot_be_rewritten_is_one_line_and_left_as_it_was(tmp_path, rng):
    ckpt = make_checkpoint(tmp_path / "ckpt", random_tables(rng), index=True)
    out = write_tables(tmp_path / "tables", CFG, random_tables(rng), progress=False)
    before = (out / MANIFEST).read_bytes()
    # (a read-only mount says "Read-only file system"; a directory in the new manifest's place
    # fails the same write, also for root, whom a 0555 directory does not stop)
    (out / (MANIFEST + ".tmp")).mkdir()
    with pytest.raises(TableFormatError, match=r"manifest.json: cannot rewrite the manifest \(Is a directory\); record"):
        record_provenance(out, checkpoint_provenance(ckpt))
    assert (out / MANIFEST).read_bytes() == before


def _with_provenance(out, block):
    m = json.loads((out / MANIFEST).read_text())
    m["provenance"] = block
    (out / MANIFEST).write_text(json.dumps(m))


GOOD = {"checkpoint_sha256": "a" * 64, "hashed": INDEX, "shards": [{"name": "m.safetensors", "bytes": 1}],
        "revision": None}


@pytest.mark.parametrize("block, message", [
    ("x", "provenance must be an object"),
    ({**GOOD, "checkpoint_sha256": "A" * 64}, "checkpoint_sha256 must be 64 hex digits"),
    ({**GOOD, "hashed": "weights"}, "provenance.hashed must be"),
    ({**GOOD, "shards": {}}, "provenance.shards must be a list"),
    ({**GOOD, "shards": [{"name": "../x", "bytes": 1}]}, r"provenance.shards\[0\] must be"),
    ({**GOOD, "shards": [{"name": "x", "bytes": True}]}, r"provenance.shards\[0\] must be"),
    ({**GOOD, "revision": "a\nb"}, "provenance.revision must be"),
])
def test_a_malformed_provenance_block_is_one_line(tmp_path, rng, block, message):
    out = write_tables(tmp_path / "tables", CFG, random_tables(rng), progress=False)
    _with_provenance(out, GOOD)
    open_tables(out, CFG)  # the good block opens
    _with_provenance(out, block)
    with pytest.raises(TableFormatError, match=message) as e:
        open_tables(out, CFG)
    assert "\n" not in str(e.value)


def test_a_shard_the_index_lists_but_that_is_absent_still_converts(tmp_path, rng):
    """(a partial download: only the shards with Engram tensors) its size is recorded as null"""
    ckpt = make_checkpoint(tmp_path / "ckpt", random_tables(rng), index=True)
    index = json.loads((ckpt / INDEX).read_text())
    index["weight_map"]["model.layers.9.mlp.weight"] = "model-00009-of-00009.safetensors"
    (ckpt / INDEX).write_text(json.dumps(index))
    out = convert_checkpoint(ckpt, tmp_path / "tables", progress=False)
    shards = read_manifest(out)[0]["provenance"]["shards"]
    assert shards[-1] == {"name": "model-00009-of-00009.safetensors", "bytes": None}
    assert all(isinstance(s["bytes"], int) for s in shards[:-1])


def test_no_checkpoint_and_broken_shards(tmp_path):
    (tmp_path / "empty").mkdir()
    assert checkpoint_hash(tmp_path / "empty") is None
    with pytest.raises(TableFormatError, match="no model.safetensors.index.json and no"):
        checkpoint_provenance(tmp_path / "empty")
    (tmp_path / "empty" / "x.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(TableFormatError, match=r"x.safetensors: not a safetensors file \(header length"):
        checkpoint_hash(tmp_path / "empty")
    (tmp_path / "empty" / "x.safetensors").write_bytes((100).to_bytes(8, "little") + b"{}")
    with pytest.raises(TableFormatError, match=r"header ends early \(2 of 100 bytes\)"):
        checkpoint_hash(tmp_path / "empty")


def test_the_revision_where_the_directory_says(tmp_path, rng):
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = tmp_path / "models--org--m" / "snapshots" / commit
    snap.parent.mkdir(parents=True)
    make_checkpoint(snap, random_tables(rng))
    assert checkpoint_provenance(snap)["revision"] == commit  # the Hugging Face cache
    local = make_checkpoint(tmp_path / "local", random_tables(rng))
    assert revision(local) is None
    meta = local / ".cache" / "huggingface" / "download"
    meta.mkdir(parents=True)
    (meta / "config.json.metadata").write_text(f"{commit}\netag\n1700000000.0\n")  # `hf download --local-dir`
    assert revision(local) == commit
    clone = make_checkpoint(tmp_path / "clone", random_tables(rng))
    (clone / ".git" / "refs" / "heads").mkdir(parents=True)
    (clone / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (clone / ".git" / "refs" / "heads" / "main").write_text(commit + "\n")
    assert revision(clone) == commit
    (clone / ".git" / "refs" / "heads" / "main").unlink()
    (clone / ".git" / "packed-refs").write_text(f"# pack-refs\n{commit} refs/heads/main\n")
    assert revision(clone) == commit
    (clone / ".git" / "HEAD").write_text("ref: ../../../etc/x\n")  # not a ref: ignored
    assert revision(clone) is None
    cfg = json.loads((clone / "config.json").read_text())
    (clone / "config.json").write_text(json.dumps({**cfg, "revision": "v1.0"}))
    assert revision(clone) == "v1.0"
