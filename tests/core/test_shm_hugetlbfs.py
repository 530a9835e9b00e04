"""The node's shared copy on a hugetlbfs mount (issue 23, Deliver 2): the same copy, names,
locks and release as on a tmpfs, its file rounded up to the mount's page size, the room it
needs counted in free huge pages (a refusal or the tmpfs path's fallback in one line, never a
SIGBUS).

The logic runs everywhere (rounding, the room and its line, smaps' hugetlb fields, a copy
sized as on hugetlbfs in a plain directory); the real mount runs in a private mount namespace
(`unshare -m`, as root) and only where the node's free huge pages cover it: these tests never
change vm.nr_hugepages."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engram_sglang.core.errors import EngramConfigError
from engram_sglang.core.hashing import EngramLayout
from engram_sglang.core.rowformat import ROW_BYTES
from engram_sglang.core.stores import hostmem, open_store, shmcopy, thp
from engram_sglang.core.tablefile import write_tables
from tests.support.tables import small_config

ROOT = Path(__file__).resolve().parents[2]
CFG = small_config(200, layer_ids=(1,), n_heads=2)
ROWS = EngramLayout(CFG).rows(1)
PAGE = 2 << 20


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    rows = np.random.default_rng(7).integers(0, 256, (ROWS, ROW_BYTES), dtype=np.uint8)
    return write_tables(tmp_path_factory.mktemp("tables") / "t", CFG, {1: rows}, chunk_rows=64, progress=False), rows


# ------------------------------------------------------------------ pure logic
def test_a_copy_is_rounded_up_to_whole_huge_pages_only_on_hugetlbfs():
    assert shmcopy.copy_bytes(ROWS * ROW_BYTES, None) == ROWS * ROW_BYTES
    assert shmcopy.copy_bytes(1, PAGE) == PAGE and shmcopy.copy_bytes(PAGE, PAGE) == PAGE
    assert shmcopy.copy_bytes(PAGE + 1, PAGE) == 2 * PAGE
    assert shmcopy.copy_bytes(189 << 30, 1 << 30) == 189 << 30


def test_hugetlbfs_is_told_from_the_mount_table_text():
    text = "60 30 0:52 / /mnt/huge rw,relatime shared:40 - hugetlbfs none rw,pagesize=2M,size=4194304\n"
    plan = thp.shm_dir_pages("/mnt/huge/engram", text, "[never]", devno="0:52")
    assert (plan.fstype, plan.huge, plan.memory) == ("hugetlbfs", True, "hugetlbfs /mnt/huge")
    assert plan.fix == "" and plan.huge_option == ""


@pytest.mark.parametrize("free, reserved, blocks, mount_free, pages", [
    (64, 0, 0, 0, 64),    # no size= limit: statfs shows 0 blocks
    (64, 10, 0, 0, 54),   # reserved pages (mapped, not yet touched) are taken
    (64, 0, 8, 3, 3),     # the mount's size= limit binds
    (2, 5, 8, 8, 0),      # never negative
])
def test_the_room_is_the_unreserved_free_pages_within_the_mount_limit(free, reserved, blocks, mount_free, pages):
    assert thp.hugetlb_free_bytes(PAGE, free, reserved, blocks, mount_free) == pages * PAGE


def test_the_shortfall_is_one_line_naming_the_pages_and_both_fixes():
    line = thp.hugetlb_shortfall("/mnt/huge", 5 * PAGE - 7, PAGE, 3, 1, 4, 1)
    assert "\n" not in line
    assert line.startswith("/mnt/huge is hugetlbfs: it needs 5 huge pages of 2 MiB, the node has 2 free "
                           "(HugePages_Free 3, 1 reserved), the mount's size= allows 1 more;")
    assert "vm.nr_hugepages (or hugepages= at boot) and remount /mnt/huge with a larger size=" in line
    gib = thp.hugetlb_shortfall("/h", 1 << 30, 1 << 30, 0, 0, 0, 0)
    assert "1 huge pages of 1 GiB" in gib and "hugepages-1048576kB/nr_hugepages" in gib and "size=" not in gib


SMAPS = """\
7f0000000000-7f0000400000 r--s 00000000 00:28 33825                      /mnt/huge/engram-0123456789abcdef-layer1.rows
Size:               4096 kB
KernelPageSize:     2048 kB
MMUPageSize:        2048 kB
Rss:                   0 kB
ShmemPmdMapped:        0 kB
FilePmdMapped:         0 kB
Shared_Hugetlb:     2048 kB
Private_Hugetlb:    2048 kB
VmFlags: rd sh mr mw me ms de ht
7f0000400000-7f0000401000 r--p 00000000 fe:00 29763                      /usr/lib/x.so
Rss:                   4 kB
"""


def test_a_hugetlbfs_mappings_pages_are_its_hugetlb_fields_not_its_rss():
    report = hostmem.huge_page_report(0x7F0000000000 + 5, shmem=True, smaps=SMAPS)
    assert (report.mapped_kib, report.huge_kib, report.coverage, report.page_kib) == (4096, 4096, 1.0, 2048)


# ------------------------------------------------------------------ the copy, sized as on hugetlbfs
@pytest.fixture
def as_hugetlbfs(monkeypatch):
    """A plain directory taken for a hugetlbfs mount of 2 MiB pages with `pool` free pages."""
    pool = {"free": 64, "reserved": 0}
    monkeypatch.setattr(shmcopy, "huge_page_bytes", lambda d: PAGE)
    monkeypatch.setattr(thp, "hugetlb_pool", lambda page: (pool["free"], pool["reserved"]))
    return pool


def _open(table_dir, shm, **kw):
    return open_store(table_dir, "host", cfg=CFG, **{"shared": True, "shm_dir": shm, **kw})[1]


def test_a_copy_sized_in_huge_pages_serves_the_rows_and_zeros_the_rest(table, tmp_path, as_hugetlbfs, caplog):
    table_dir, rows = table
    a = _open(table_dir, tmp_path)
    b = _open(table_dir, tmp_path)  # the same copy, mapped
    (copy,) = tmp_path.glob("engram-*-layer1.rows")
    assert copy.stat().st_size == PAGE > ROWS * ROW_BYTES
    assert np.array_equal(a.table.numpy(), rows) and np.array_equal(b.table.numpy(), rows)
    assert a.table.shape == (ROWS, ROW_BYTES)  # the pages' tail is never served
    assert not copy.read_bytes()[ROWS * ROW_BYTES:].strip(b"\0")
    b.close()
    a.close()
    assert list(tmp_path.iterdir()) == []  # the last holder removed it and its sidecars
    kept = _open(table_dir, tmp_path, keep=True)
    kept.close()
    with caplog.at_level(logging.INFO, logger="engram_sglang.core.stores.shmcopy"):
        again = _open(table_dir, tmp_path)  # a copy nobody holds: checked, its size the rounded one
    assert "checked against the manifest's checksums" in caplog.text
    assert np.array_equal(again.table.numpy(), rows)
    again.close()


def test_too_few_free_huge_pages_refuse_in_one_line_or_fall_back_as_on_tmpfs(table, tmp_path, as_hugetlbfs, caplog):
    table_dir, rows = table
    as_hugetlbfs.update(free=3, reserved=3)
    with pytest.raises(EngramConfigError) as e:
        _open(table_dir, tmp_path, shared="require")
    msg = str(e.value)
    assert "\n" not in msg and f"{tmp_path} is hugetlbfs: it needs 1 huge pages of 2 MiB, the node has 0 free" in msg
    assert "vm.nr_hugepages" in msg and "--shm-size" not in msg
    assert list(tmp_path.iterdir()) == []
    with caplog.at_level(logging.WARNING):
        store = _open(table_dir, tmp_path)
    assert not store.shared and np.array_equal(store.table.numpy(), rows)
    assert "keeping a private copy of this rank's rows instead (for one copy per node: " in caplog.text
    assert "is hugetlbfs: it needs 1 huge pages" in caplog.text
    store.close()


# ------------------------------------------------------------------ a real hugetlbfs mount
NEED_PAGES = 3  # the copy (one page), then a limited mount's filler and its copy's try


def _free_huge_pages() -> int:
    free, reserved = thp.hugetlb_pool(PAGE)
    return free - reserved


REAL = r"""
import json, os, subprocess, sys
from pathlib import Path
import numpy as np
from engram_sglang.core.errors import EngramError
from engram_sglang.core.stores import open_store
from engram_sglang.tools.cli import main
table_dir, mnt, small = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
rows = np.load(sys.argv[4])
subprocess.run(["mount", "-t", "hugetlbfs", "-o", "pagesize=2M", "none", str(mnt)], check=True)
out = {}
def open_(shm, **kw):
    return open_store(table_dir, "host", **{"shared": True, "shm_dir": shm, **kw})[1]
a, b = open_(mnt), open_(mnt)
(copy,) = mnt.glob("engram-*-layer1.rows")
out["size"] = copy.stat().st_size
out["same"] = bool(np.array_equal(a.table.numpy(), rows) and np.array_equal(b.table.numpy(), rows))
int(a.table.sum())  # resident, as a GPU's registration makes it
r = a.memory.huge_pages_report()
out["report"] = [r.mapped_kib, r.huge_kib, r.page_kib]
a.huge = r
st = a.stats()
out["stats"] = [st["page_size_kib"], st["huge_page_coverage"], st["page_memory"]]
out["line"] = a.describe()
out["ls"] = main(["shm", "ls", "--shm-dir", str(mnt)])
out["rm_in_use"] = main(["shm", "rm", "--shm-dir", str(mnt), copy.name])
b.close(); a.close()
out["left"] = sorted(os.listdir(mnt))
k = open_(mnt, keep=True); k.close()
out["kept"] = sorted(os.listdir(mnt))
out["rm"] = main(["shm", "rm", "--shm-dir", str(mnt), copy.name])
out["after_rm"] = sorted(os.listdir(mnt))
# A mount whose size= is taken: refused in one line before any page is touched
subprocess.run(["mount", "-t", "hugetlbfs", "-o", "pagesize=2M,size=2M", "none", str(small)], check=True)
fd = os.open(small / "filler", os.O_RDWR | os.O_CREAT, 0o600)
os.posix_fallocate(fd, 0, 2 << 20)
try:
    open_(small, shared="require")
    out["refused"] = None
except EngramError as e:
    out["refused"] = str(e)
# Past that check (another server took the pages meanwhile): the fill's mapping is refused, one line
from engram_sglang.core.stores import thp
thp.hugetlbfs_free_bytes = lambda d, page: 1 << 40
try:
    open_(small, shared="require")
    out["fill_refused"] = None
except EngramError as e:
    out["fill_refused"] = str(e)
os.close(fd)
(small / "filler").unlink()
out["small_left"] = sorted(os.listdir(small))
print(json.dumps(out))
"""


def test_a_copy_on_a_real_hugetlbfs_mount(table, tmp_path, capfd):
    """Filled, shared, measured (2048 kB pages, all of it), listed and removed by `shm ls|rm`,
    released by the last holder; a full mount refused in one line."""
    if _free_huge_pages() < NEED_PAGES:
        pytest.skip(f"needs a hugetlbfs mount with {NEED_PAGES} free huge pages of 2 MiB (HugePages_Free less "
                    f"reserved is {_free_huge_pages()}; these tests never change vm.nr_hugepages)")
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip(f"needs a hugetlbfs mount with {NEED_PAGES} free huge pages: cannot make one in a private "
                    f"mount namespace here (unshare -m needs root)")
    table_dir, rows = table
    mnt, small = tmp_path / "huge", tmp_path / "small"
    mnt.mkdir()
    small.mkdir()
    np.save(tmp_path / "rows.npy", rows)
    run = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c", REAL, str(table_dir),
                          str(mnt), str(small), str(tmp_path / "rows.npy")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.splitlines()[-1])
    assert got["size"] == PAGE and got["same"]
    assert got["report"] == [2048, 2048, 2048]
    assert got["stats"][:2] == [2048, 1.0] and got["stats"][2].startswith("hugetlbfs ")
    assert "huge pages 100% (hugetlbfs " in got["line"]
    assert got["ls"] == 0 and got["rm_in_use"] == 2
    assert got["left"] == []
    name = next(n for n in got["kept"] if n.endswith(".rows"))
    assert got["rm"] == 0 and got["after_rm"] == [] and name.startswith("engram-")
    assert got["refused"] is not None and "\n" not in got["refused"], got["refused"]
    assert "is hugetlbfs: it needs 1 huge pages of 2 MiB" in got["refused"]
    assert "the mount's size= allows 0 more" in got["refused"] and got["small_left"] == []
    assert got["fill_refused"] is not None and "\n" not in got["fill_refused"], got["fill_refused"]
    assert ": no huge pages for a 0.00 GiB shared table on this host: " in got["fill_refused"]
