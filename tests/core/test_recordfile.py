"""Record files (engram_sglang/core/recordfile.py): the one npz-with-metadata reader and writer of
the profile, the planner's trace and the gate statistics. Atomic writes, no pickles, one line
per broken file, and files written by the code before it (inline here, np.savez_compressed
with the layout of that time) still load. Also: the core modules that read these files
import no tool."""

from __future__ import annotations

import ast
import io
import json
import os
import pickle
import zipfile
from pathlib import Path

import numpy as np
import pytest

from engram_sglang.core.errors import EngramError
from engram_sglang.core.recordfile import RecordFormat, read_record, write_record
from tests.support.tables import small_config

ROOT = Path(__file__).resolve().parents[2]
FMT = RecordFormat("engram-test", 2, "test record", missing_hint=" (make one)")
CFG = small_config(400)


def meta_bytes(obj) -> np.ndarray:
    return np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)


def npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def one_line(e: pytest.ExceptionInfo, path) -> str:
    msg = str(e.value)
    assert str(path) in msg and "\n" not in msg, msg
    return msg


# ------------------------------------------------------------------------ round trip
def test_round_trip_keeps_arrays_and_meta_format_first(tmp_path):
    arrays = {"a": np.arange(5, dtype=np.int32), "b": np.float32(2.5), "c": np.zeros((2, 0), np.int64)}
    path = write_record(tmp_path / "r.npz", FMT, arrays, {"x": 1, "format": "ignored"})
    with read_record(path, FMT, required=("a", "b")) as r:
        assert list(r.meta) == ["format", "x"] and r.meta == {"format": "engram-test-v2", "x": 1}
        assert sorted(r.files) == ["a", "b", "c"]
        for k, v in arrays.items():
            got = r.array(k)
            assert got.dtype == v.dtype and np.array_equal(got, v)
        assert r.header("a") == ((5,), np.dtype(np.int32))
    assert sorted(os.listdir(path.parent)) == ["r.npz"]  # no temporary file left


def test_numbered_arrays_ignore_other_names(tmp_path):
    path = write_record(tmp_path / "r.npz", FMT, {"ids_3": np.zeros(1), "ids_10": np.zeros(1), "ids_x": np.zeros(1),
                                                 "idsy_1": np.zeros(1), "counts_3": np.zeros(1)}, {})
    with read_record(path, FMT) as r:
        assert r.numbered("ids_") == [3, 10]


def test_the_writer_refuses_object_arrays_and_the_meta_name(tmp_path):
    with pytest.raises(ValueError, match="objects"):
        write_record(tmp_path / "o.npz", FMT, {"a": np.array([{"x": 1}], dtype=object)}, {})
    with pytest.raises(ValueError, match="metadata"):
        write_record(tmp_path / "m.npz", FMT, {"meta": np.zeros(3, np.uint8)}, {})
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------------ atomic write
def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = write_record(tmp_path / "r.npz", FMT, {"a": np.arange(3)}, {"v": "old"})
    before = path.read_bytes()
    seen = []

    def broken(f, **arrays):  # writes part of an archive, then the disk fills
        f.write(b"PK\x03\x04 half an archive")
        seen.append(sorted(os.listdir(tmp_path)))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez_compressed", broken)
    with pytest.raises(EngramError) as e:
        write_record(path, FMT, {"a": np.arange(4)}, {"v": "new"})
    assert "cannot write the test record file (No space left on device)" in one_line(e, path)
    assert len(seen[0]) == 2  # the temporary file existed beside the target while it was written
    assert sorted(os.listdir(tmp_path)) == ["r.npz"] and path.read_bytes() == before

    def interrupted(f, **arrays):
        f.write(b"PK")
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez_compressed", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_record(path, FMT, {"a": np.arange(4)}, {})
    assert sorted(os.listdir(tmp_path)) == ["r.npz"] and path.read_bytes() == before


def test_a_failed_rename_leaves_no_temporary(tmp_path, monkeypatch):
    def refuse(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(EngramError, match="Permission denied"):
        write_record(tmp_path / "r.npz", FMT, {"a": np.arange(3)}, {})
    assert not list(tmp_path.iterdir())


def test_writing_into_a_missing_directory_is_one_line_and_makes_none(tmp_path):
    with pytest.raises(EngramError) as e:
        write_record(tmp_path / "no" / "such" / "r.npz", FMT, {"a": np.arange(3)}, {})
    assert "cannot write the test record file (No such file or directory)" in one_line(e, tmp_path / "no")
    assert not list(tmp_path.iterdir())


def test_writing_onto_a_directory_is_one_line(tmp_path):
    (tmp_path / "d.npz").mkdir()
    with pytest.raises(EngramError) as e:
        write_record(tmp_path / "d.npz", FMT, {"a": np.arange(3)}, {})
    assert "cannot write the test record file" in one_line(e, tmp_path / "d.npz")
    assert [p.name for p in tmp_path.iterdir()] == ["d.npz"]


# ------------------------------------------------------------------------ reading broken files
class Exploit:
    """Unpickling this writes a marker file: proof that a pickle ran."""

    marker: Path

    def __reduce__(self):
        return (Path.write_text, (self.marker, "ran"))


def test_pickles_are_refused_and_never_run(tmp_path):
    Exploit.marker = tmp_path / "ran"
    whole = tmp_path / "whole.npz"
    whole.write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(EngramError) as e:
        read_record(whole, FMT)
    assert "not an engram test record file" in one_line(e, whole)
    # An .npz whose array is a pickled object array (np.savez writes one by default).
    inner = tmp_path / "inner.npz"
    np.savez(inner, a=np.array([Exploit()], dtype=object), meta=meta_bytes({"format": FMT.tag}))
    with read_record(inner, FMT) as r:
        with pytest.raises(EngramError) as e:
            r.array("a")
    assert "unreadable" in one_line(e, inner)
    # ... and a pickled meta entry.
    meta = tmp_path / "meta.npz"
    np.savez(meta, meta=np.array([Exploit()], dtype=object))
    with pytest.raises(EngramError) as e:
        read_record(meta, FMT)
    one_line(e, meta)
    assert not Exploit.marker.exists()
    Path.write_text(Exploit.marker, "ran")  # the control: the marker is what a pickle that ran leaves
    assert Exploit.marker.exists()


@pytest.mark.parametrize("why, make, want", [
    ("missing", None, "no such test record file (make one)"),
    ("not a zip", lambda p: p.write_bytes(b"hello"), "not an engram test record file (ValueError: not an .npz"),
    ("one array", lambda p: p.write_bytes(npy_bytes(np.arange(3))), "not an .npz archive"),
    ("truncated", lambda p: p.write_bytes(b"PK\x03\x04" + bytes(40)), "not an engram test record file"),
    ("no meta", lambda p: np.savez(p, a=np.arange(3)), "no meta entry"),
    ("meta not bytes", lambda p: np.savez(p, meta=np.arange(3)), "its meta entry is int64 [3], not JSON bytes"),
    ("meta not JSON", lambda p: np.savez(p, meta=np.frombuffer(b"\xff{", np.uint8)), "UnicodeDecodeError"),
    ("meta a list", lambda p: np.savez(p, meta=meta_bytes([1])), "its meta is list, not an object"),
    ("another format", lambda p: np.savez(p, meta=meta_bytes({"format": "engram-profile-v1"})),
     "format 'engram-profile-v1', want engram-test-v2"),
    ("older version", lambda p: np.savez(p, meta=meta_bytes({"format": "engram-test-v1"})),
     "format 'engram-test-v1', want engram-test-v2"),
    ("newer version", lambda p: np.savez(p, meta=meta_bytes({"format": "engram-test-v3"})),
     "format 'engram-test-v3' is newer than this engram-sglang reads (engram-test-v2)"),
    ("no format", lambda p: np.savez(p, meta=meta_bytes({})), "format None, want engram-test-v2"),
    ("required missing", lambda p: np.savez(p, b=np.arange(2), meta=meta_bytes({"format": "engram-test-v2"})),
     "no array 'a'"),
    ("a directory", lambda p: p.mkdir(), "the test record file is a directory, not a regular file"),
    ("a FIFO", lambda p: os.mkfifo(p), "the test record file is a FIFO, not a regular file"),
])
def test_broken_files_are_one_line(tmp_path, why, make, want):
    path = tmp_path / "r.npz"
    if make is not None:
        make(path)
    with pytest.raises(EngramError) as e:
        read_record(path, FMT, required=("a",))
    assert want in one_line(e, path), why


def test_a_huge_meta_entry_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "r.npz"
    np.savez_compressed(path, meta=np.zeros((1 << 24) + 1, np.uint8))
    with pytest.raises(EngramError, match="its meta entry is over 16 MiB"):
        read_record(path, FMT)


def test_a_missing_or_corrupt_array_is_one_line(tmp_path):
    good = write_record(tmp_path / "g.npz", FMT, {"a": np.arange(1000)}, {})
    bad = tmp_path / "b.npz"
    with zipfile.ZipFile(good) as zin, zipfile.ZipFile(bad, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            zout.writestr(info, data[: len(data) // 2] if info.filename == "a.npy" else data,
                          compress_type=zipfile.ZIP_STORED)
    with read_record(bad, FMT) as r:
        with pytest.raises(EngramError) as e:
            r.array("a", where=f"{bad}: layer 1")
        assert "layer 1: unreadable" in one_line(e, bad)
        with pytest.raises(EngramError, match="missing array 'z'"):
            r.array("z")
        with pytest.raises(EngramError, match="missing array 'z'"):
            r.header("z")


def test_each_format_raises_its_own_error_type(tmp_path):
    from engram_sglang.core.planning.data import PlannerError
    from engram_sglang.core.planning.disk import TRACE

    with pytest.raises(PlannerError, match="no such trace file .write one with engram-sglang profile"):
        read_record(tmp_path / "none.npz", TRACE)


# ------------------------------------------------------------------------ files the old code wrote
def old_profile(path, cfg, layers: dict, meta: dict) -> Path:
    """What profiling.write_profile wrote before record files (commit 012ca7e), inline."""
    arrays = {}
    for L, (ids, counts, reads, rows) in layers.items():
        arrays[f"ids_{L}"] = ids.astype(np.int32 if rows < 2**31 else np.int64)
        arrays[f"counts_{L}"] = counts.astype(np.uint32 if counts.size == 0 or counts.max() < 2**32 else np.int64)
        arrays[f"reads_{L}"] = np.int64(reads)
        arrays[f"rows_{L}"] = np.int64(rows)
    meta = {"format": "engram-profile-v1", "fingerprint": cfg.fingerprint(), "hash_fields": cfg.hash_fields(), **meta}
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez_compressed(path, **arrays)
    return path


def old_trace(path, fingerprint, ids_by_layer, meta) -> Path:
    """What planning/disk.py write_trace wrote before record files, inline."""
    arrays = {f"ids_{L}": ids.astype(np.int32) for L, ids in ids_by_layer.items()}
    meta = {"format": "engram-trace-v1", "fingerprint": fingerprint, **meta}
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez_compressed(path, **arrays)
    return path


def old_gate_stats(path, fingerprint, layers, meta) -> Path:
    """What analysis/skip.py write_gate_stats wrote before record files, inline."""
    arrays = {}
    for L, (rows, gate, reads) in layers.items():
        arrays[f"rows_{L}"], arrays[f"gate_{L}"], arrays[f"reads_{L}"] = rows, gate, reads
    meta = {"format": "engram-gate-stats-v1", "fingerprint": fingerprint, **meta}
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez_compressed(path, **arrays)
    return path


def members(path) -> dict[str, tuple]:
    """Each archive member's dtype, shape and bytes (the meta's bytes are its JSON)."""
    with np.load(path, allow_pickle=False) as d:
        return {k: (d[k].dtype, d[k].shape, d[k].tobytes()) for k in d.files}


def profile_layers():
    rng = np.random.default_rng(0)
    out = {}
    for L, rows in zip(CFG.layer_ids, (5000, 7000)):
        ids = rng.choice(rows, 50, replace=False).astype(np.int64)
        counts = np.sort(rng.integers(2, 1000, 50))[::-1].astype(np.int64)
        out[L] = (ids, counts, int(counts.sum()) + 17, rows)
    return out


def test_an_old_profile_loads_and_the_new_writer_writes_the_same_file(tmp_path):
    from engram_sglang.core.profile_format import ProfileLayer, read_profile, write_profile_rows

    layers = profile_layers()
    meta = {"model": "m", "tokens": 123, "skew": {"1": {"all": 0.5}}}
    old = old_profile(tmp_path / "old.npz", CFG, layers, meta)
    prof = read_profile(old, CFG.fingerprint())
    assert prof.layer_ids == list(CFG.layer_ids) and prof.meta["tokens"] == 123
    for L, (ids, counts, reads, _) in layers.items():
        got = prof.layer(L)
        assert np.array_equal(got[0], ids) and np.array_equal(got[1], counts) and got[2] == reads
    prof.close()
    new = write_profile_rows(tmp_path / "new.npz", CFG, {L: ProfileLayer(*v) for L, v in layers.items()}, meta)
    assert members(new) == members(old)  # the same names, dtypes, shapes, values and meta JSON
    # The control: a change of layout is seen.
    changed = old_profile(tmp_path / "changed.npz", CFG, layers, {**meta, "tokens": 124})
    assert members(changed) != members(old)


def test_an_old_profile_prewarms_the_hot_row_cache(tmp_path):
    """The stores read an old profile (through profile_format, not the profiling tool)."""
    pytest.importorskip("engram_sglang.core.ops", reason="the gather_dequant op (engram_sglang.core.ops) is not built yet")
    from engram_sglang.core.hashing import EngramLayout
    from engram_sglang.core.stores import open_store
    from engram_sglang.core.stores.cache import wrap_stores
    from engram_sglang.core.tablefile import write_tables
    from tests.support.tables import random_rows

    layout = EngramLayout(CFG)
    table_dir = write_tables(tmp_path / "t", CFG, random_rows(CFG), progress=False)
    hot = np.arange(40, dtype=np.int64) * 7
    counts = np.arange(100, 60, -1, dtype=np.int64)
    layers = {L: (hot % layout.rows(L), counts, int(counts.sum()), layout.rows(L)) for L in CFG.layer_ids}
    path = old_profile(tmp_path / "p.npz", CFG, layers, {})
    stores = wrap_stores(open_store(table_dir, "host", cfg=CFG), 64 * 1024, profile=path,
                         fingerprint=CFG.fingerprint(), maintain_every=0)
    try:
        assert all(s.stats()["cache_prewarmed"] > 0 for s in stores.values())
    finally:
        for s in stores.values():
            s.close()


def test_an_old_trace_loads_and_the_new_writer_writes_the_same_file(tmp_path):
    from engram_sglang.core.planning.disk import read_trace, write_trace

    rng = np.random.default_rng(1)
    ids = {L: rng.integers(0, 5000, (6, 4, CFG.hash_columns)) for L in CFG.layer_ids}
    old = old_trace(tmp_path / "old.npz", CFG.fingerprint(), ids, {"streams": 4, "steps": 6})
    got, meta = read_trace(old, CFG.fingerprint())
    assert meta["streams"] == 4 and all(np.array_equal(got[L], ids[L]) and got[L].dtype == np.int64 for L in ids)
    new = write_trace(tmp_path / "new.npz", CFG.fingerprint(), ids, {"streams": 4, "steps": 6})
    assert members(new) == members(old)


def test_an_old_gate_statistics_file_loads_and_the_new_writer_writes_the_same_file(tmp_path):
    from types import SimpleNamespace

    from engram_sglang.tools.analysis.skip import read_gate_stats, write_gate_stats

    hash_ids = np.array([[[3, 5]], [[5, 9]]], dtype=np.int64)  # [tokens, layers, columns]
    corpus = SimpleNamespace(hash_ids=hash_ids, gates=np.array([[0.2], [0.6]], dtype=np.float32))
    rows = np.array([3, 5, 9], np.int64)
    gate = np.array([0.2, 0.4, 0.6], np.float32)
    old = old_gate_stats(tmp_path / "old.npz", "fp", {7: (rows, gate, np.array([1, 2, 1], np.int64))}, {"docs": 1})
    got = read_gate_stats(old, "fp")
    assert np.array_equal(got[7][0], rows) and np.allclose(got[7][1], gate)
    new = write_gate_stats(tmp_path / "new", corpus, [7], "fp", {"docs": 1})
    assert new == tmp_path / "new.npz"
    assert members(new).keys() == members(old).keys()
    assert members(new)["meta"] == members(old)["meta"] and members(new)["rows_7"] == members(old)["rows_7"]
    assert np.allclose(read_gate_stats(new, "fp")[7][1], gate)


# ------------------------------------------------------------------------ rooms
CORE_READERS = ("core/recordfile", "core/profile_format", "core/stores/cache")
TOOLS = ("tools", "testing")
ALLOWED_IN_RECORDFILE = {"__future__", "dataclasses", "json", "os", "re", "secrets", "zipfile", "zlib", "pathlib",
                         "typing", "numpy", "engram_sglang.core.errors", "engram_sglang.core.fileio",
                         "engram_sglang.core.recordfile"}


def imported(path: Path, source: str | None = None) -> set[str]:
    """Every module a file imports (also inside functions), relative imports resolved."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            out.add(".".join(base + ([node.module] if node.module else [])))
    return out


def tools_in(found: set[str]) -> set[str]:
    return {m for m in found for t in TOOLS if m == f"engram_sglang.{t}" or m.startswith(f"engram_sglang.{t}.")}


def test_the_record_modules_import_only_the_stdlib_numpy_and_the_core():
    for name in ("recordfile", "profile_format"):
        found = imported(ROOT / "engram_sglang" / "core" / f"{name}.py")
        assert found <= ALLOWED_IN_RECORDFILE, (name, found - ALLOWED_IN_RECORDFILE)


def test_the_core_readers_import_no_tool():
    for name in CORE_READERS:
        path = ROOT / "engram_sglang" / f"{name}.py"
        assert not tools_in(imported(path)), name
    # The control: the rule sees a tool imported inside a function, as stores/cache.py once did.
    path = ROOT / "engram_sglang" / "core" / "stores" / "cache.py"
    before = path.read_text().replace("from ..profile_format import", "from ...tools.profiling import")
    assert tools_in(imported(path, before)) == {"engram_sglang.tools.profiling"}
