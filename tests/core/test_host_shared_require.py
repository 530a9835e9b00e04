"""`--engram-host-shared off|on|require`: where the shm dir cannot hold a layer's shared copy,
on keeps a private copy of the rank's rows (a warning), require stops start-up with one line;
0/1 still mean off/on. The shm dir's free space is patched (a tmpfs this small needs root to
mount), as test_stores.py's fallback test does; the tables and the store are real."""

from __future__ import annotations

import logging

import pytest

from engram_sglang.core.errors import EngramConfigError
from engram_sglang.core.stores import hostmem, open_store
from engram_sglang.serving.settings import ServeSettings
from tests.core.test_stores import CFG, table_dir  # noqa: F401


@pytest.mark.parametrize("raw, want", [("require", "require"), ("on", True), ("1", True), ("yes", True),
                                       ("off", False), ("0", False), ("", False)])
def test_host_shared_takes_off_on_require_and_0_1(raw, want):
    s = ServeSettings.from_env({"ENGRAM_PLACEMENT": "host", "ENGRAM_HOST_SHARED": raw})
    assert s.host_shared == want and s.store_options()["shared"] == want


def test_host_shared_refuses_other_words_in_one_line():
    with pytest.raises(EngramConfigError) as e:
        ServeSettings.from_env({"ENGRAM_HOST_SHARED": "always"})
    assert str(e.value) == ("ENGRAM_HOST_SHARED (--engram-host-shared) must be on/off (1/0, true/false), or require, "
                            "got 'always'")


def open_host(table_dir, shm, raw):
    options = ServeSettings.from_env({"ENGRAM_PLACEMENT": "host", "ENGRAM_HOST_SHARED": raw,
                                      "ENGRAM_SHM_DIR": str(shm)}).store_options()
    return open_store(table_dir, "host", cfg=CFG, **options)


def test_require_refuses_the_private_fallback_on_fallsback(table_dir, tmp_path, monkeypatch, caplog):  # noqa: F811
    root, _ = table_dir
    monkeypatch.setattr(hostmem, "shm_free_bytes", lambda d: 1 << 20)  # Docker's 64 MiB /dev/shm, 1 MiB free
    with pytest.raises(EngramConfigError) as e:
        open_host(root, tmp_path, "require")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"engram layer 1: {tmp_path} has 0.00 GiB free but the shared table "
                                              f"needs"), msg
    assert "--engram-host-shared require (ENGRAM_HOST_SHARED) refuses a private copy per rank" in msg
    assert "--shm-size=" in msg and "--engram-host-shared on to fall back" in msg
    assert not list(tmp_path.iterdir())  # nothing left behind
    with caplog.at_level(logging.WARNING):
        stores = open_host(root, tmp_path, "on")
    try:
        assert "keeping a private copy of this rank's rows instead" in caplog.text
        assert all(not s.stats()["shared"] for s in stores.values())
    finally:
        for s in stores.values():
            s.close()


def test_require_serves_the_shared_copy_where_it_fits(table_dir, tmp_path):  # noqa: F811
    root, _ = table_dir
    stores = open_host(root, tmp_path, "require")
    try:
        assert all(s.stats()["shared"] for s in stores.values()) and list(tmp_path.glob("engram-*-layer*.rows"))
    finally:
        for s in stores.values():
            s.close()


# ---------------------------------- what a fallback names, and the per-layer mix (issue 25 item 2)
def _other_tables(tmp_path, seed):
    import numpy as np

    from engram_sglang.core.hashing import EngramLayout
    from engram_sglang.core.rowformat import ROW_BYTES
    from engram_sglang.core.tablefile import write_tables

    rng, layout = np.random.default_rng(seed), EngramLayout(CFG)
    rows = {L: rng.integers(0, 256, (layout.rows(L), ROW_BYTES), dtype=np.uint8) for L in CFG.layer_ids}
    return write_tables(tmp_path / f"tables-{seed}", CFG, rows, progress=False)


def test_a_fallback_names_the_unheld_copies_and_their_sizes(table_dir, tmp_path, monkeypatch, caplog):  # noqa: F811
    root, _ = table_dir
    shm = tmp_path / "shm"
    shm.mkdir()
    for s in open_store(_other_tables(tmp_path, 1), "host", cfg=CFG, shared=True, shm_dir=shm, keep=True).values():
        s.close()  # kept: nobody holds them now (as a killed server's copies)
    kept = sorted(shm.glob("engram-*-layer*.rows"))
    held = open_store(_other_tables(tmp_path, 2), "host", cfg=CFG, shared=True, shm_dir=shm)  # in use: not named
    monkeypatch.setattr(hostmem, "shm_free_bytes", lambda d: 1 << 20)
    try:
        with caplog.at_level(logging.WARNING):
            stores = open_host(root, shm, "on")
        for s in stores.values():
            s.close()
    finally:
        for s in held.values():
            s.close()
    lines = [r.getMessage() for r in caplog.records if "keeping a private copy" in r.getMessage()]
    assert len(lines) == 2, lines  # one per layer
    nbytes = [p.stat().st_blocks * 512 for p in kept]  # memory, not the file's length
    assert 0 < sum(nbytes) < 2**30  # (so the sizes read in MiB)
    sizes = ", ".join(f"{p.name} ({n / 2**20:.1f} MiB)" for p, n in zip(kept, nbytes))
    for line in lines:
        assert "\n" not in line and line.endswith(
            f"; 2 unheld file(s) in {shm}, {sum(nbytes) / 2**20:.1f} MiB, which `engram-sglang shm prune --shm-dir {shm}` would "
            f"free: {sizes}"), line
    with pytest.raises(EngramConfigError, match="which `engram-sglang shm prune"):  # require names them too
        open_host(root, shm, "require")
    for p in kept:
        p.unlink()
    with caplog.at_level(logging.WARNING):
        caplog.clear()
        for s in open_host(root, shm, "on").values():
            s.close()
    assert f"no copy in {shm} is unheld (its space is in use)" in caplog.text


def test_a_shm_dir_that_fits_some_layers_gives_one_summary_line(table_dir, tmp_path, monkeypatch, caplog):  # noqa: F811
    root, _ = table_dir
    calls = []

    def free(d):  # room for the first layer's copy only
        calls.append(d)
        return 1 << 40 if len(calls) == 1 else 1 << 20

    monkeypatch.setattr(hostmem, "shm_free_bytes", free)
    with caplog.at_level(logging.WARNING):
        stores = open_host(root, tmp_path, "on")
    try:
        assert [s.stats()["shared"] for _, s in sorted(stores.items())] == [True, False]
        private_gib = stores[3].resident_bytes / 2**30
    finally:
        for s in stores.values():
            s.close()
    summary = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engram host tables:")]
    assert summary == [f"engram host tables: {tmp_path} had room for 1 of 2 shared layer copies: layers 1 share the "
                       f"node's copy, layers 3 keep a private copy of this rank's rows ({private_gib:.2f} GiB on this "
                       f"rank, one per rank; see each layer's warning for what the shm dir needs and what `shm prune` "
                       f"would free)"], caplog.text
