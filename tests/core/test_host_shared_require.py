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
