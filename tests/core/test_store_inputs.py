"""Bad placement inputs are one line, never a traceback or a silent change of plan: a shared
host table's directory that is missing or not a directory, and a shared table file (or its
lock) that is a directory, FIFO or other non-regular file."""

from __future__ import annotations

import os

import pytest
import torch

from engram_sglang.core.errors import EngramError
from engram_sglang.core.hashing import EngramLayout
from engram_sglang.core.rowformat import ROW_BYTES
from engram_sglang.core.stores import open_store, shmcopy
from engram_sglang.core.tablefile import open_tables, write_tables
from tests.support.tables import small_config

CFG = small_config(200, layer_ids=(1,), n_heads=2)


@pytest.fixture(scope="module")
def table_dir(tmp_path_factory):
    rows = torch.randint(0, 256, (EngramLayout(CFG).rows(1), ROW_BYTES), dtype=torch.uint8).numpy()
    return write_tables(tmp_path_factory.mktemp("t") / "t", CFG, {1: rows}, progress=False)


def test_a_missing_shm_directory_is_an_error_not_a_private_copy(table_dir, tmp_path):
    for shm_dir in (tmp_path / "nope", tmp_path / "file"):
        if shm_dir.name == "file":
            shm_dir.write_text("x")
        with pytest.raises(EngramError, match=f"{shm_dir}: the shared host table's directory .* does not exist or "
                                              "is not a directory"):
            open_store(table_dir, "host", cfg=CFG, shared=True, shm_dir=shm_dir)
    # Unshared, the directory is not used at all.
    open_store(table_dir, "host", cfg=CFG, shared=False, shm_dir=tmp_path / "nope")[1].close()


@pytest.mark.parametrize("suffix", ["", ".lock"])
@pytest.mark.parametrize("kind", ["directory", "FIFO"])
def test_shared_table_paths_that_are_not_files(table_dir, tmp_path, suffix, kind):
    tables = open_tables(table_dir)
    spec = shmcopy.Spec(tmp_path, 1, tables.layers[1].rows, tables.manifest["chunk_rows"], tables.layers[1].checksums)
    name = spec.path.name + suffix  # named by the rows' content (stores/shmcopy.py)
    path = tmp_path / name
    path.mkdir() if kind == "directory" else os.mkfifo(path)
    with pytest.raises(EngramError, match=f"{name}: is a {kind}, not a shared table file; remove it"):
        open_store(table_dir, "host", cfg=CFG, shared=True, shm_dir=tmp_path)
    # Removed, the shared table is made there.
    path.rmdir() if kind == "directory" else path.unlink()
    store = open_store(table_dir, "host", cfg=CFG, shared=True, shm_dir=tmp_path)[1]
    assert store.shared
    store.close()
