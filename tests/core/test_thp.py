"""Whether host tables get huge pages (core/stores/thp.py): the mount-table reading over fixture
text, the verdict checked against this kernel in a private mount namespace, and the start-up
line, warning and statistics of real host stores."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from engram_sglang.core.stores import open_store, thp
from engram_sglang.core.stores.host import HostStore
from engram_sglang.core.tablefile import write_tables
from tests.support.tables import random_rows, small_config

CFG = small_config(400)
SHMEM = "always within_size advise [{}] deny force"  # the sysfs file's text


def mountinfo(super_options: str, fstype: str = "tmpfs", point: str = "/dev/shm", devno: str = "0:23") -> str:
    return textwrap.dedent(f"""\
        22 27 0:21 / /proc rw,relatime - proc proc rw
        27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard
        24 27 0:6 / /dev rw,relatime - devtmpfs devtmpfs rw,size=12335016k,mode=755
        25 24 {devno} / {point} rw,relatime shared:5 - {fstype} {fstype} {super_options}
        """)


# ------------------------------------------------------------------ the mount table
@pytest.mark.parametrize("options, shmem, huge, option, words", [
    ("rw,size=24683792k", "never", False, "never", "huge=never"),  # the kernel shows no huge= for never
    ("rw,size=24683792k,huge=never", "never", False, "never", "huge=never"),
    ("rw,size=64g,huge=always", "never", True, "always", "huge=always"),
    ("rw,size=64g,huge=within_size", "never", True, "within_size", "huge=within_size"),
    ("rw,size=64g,huge=advise", "never", False, "advise", "fallocate"),  # no mapping's advice reaches the copy
    ("rw,size=64g", "advise", False, "never", "sets no tmpfs mount unless deny or force"),  # shmem_enabled is not the mount's knob
    ("rw,size=64g", "always", False, "never", "sets no tmpfs mount unless deny or force"),
    ("rw,size=64g", "force", True, "never", "every tmpfs mount huge pages"),
    ("rw,size=64g,huge=within_size", "deny", False, "within_size", "off for every tmpfs mount"),
])
def test_a_tmpfs_gets_huge_pages_by_its_mount_option_unless_shmem_enabled_overrides(options, shmem, huge, option,
                                                                                     words):
    plan = thp.shm_dir_pages("/dev/shm", mountinfo(options), SHMEM.format(shmem))
    assert (plan.huge, plan.huge_option, plan.shmem_enabled, plan.fstype) == (huge, option, shmem, "tmpfs")
    assert plan.memory == "tmpfs /dev/shm" and words in plan.reason, plan
    if huge:
        assert plan.fix == ""
    elif shmem == "deny":
        assert plan.fix == "echo never > /sys/kernel/mm/transparent_hugepage/shmem_enabled (deny overrides every " \
                           "mount's huge=)"  # the mount already has huge=within_size: nothing more
    else:
        assert plan.fix.startswith("mount -o remount,huge=within_size /dev/shm ")
        assert "bind-mount a host tmpfs mounted with huge=within_size" in plan.fix  # Docker cannot set huge=


def test_deny_over_a_mount_without_huge_needs_both_fixes():
    plan = thp.shm_dir_pages("/dev/shm", mountinfo("rw,size=64g"), "deny")  # the bare value reads too
    assert plan.huge is False and plan.fix.startswith("echo never > /sys/kernel/mm/transparent_hugepage/shmem_enabled")
    assert "and mount -o remount,huge=within_size /dev/shm" in plan.fix


def test_a_dir_on_a_disk_file_system_is_page_cache_not_a_tmpfs():
    plan = thp.shm_dir_pages("/var/tmp/engram", mountinfo("rw,size=64g,huge=always"), SHMEM.format("always"))
    assert (plan.huge, plan.fstype, plan.mount_point, plan.huge_option) == (False, "ext4", "/", "")
    assert "not a tmpfs" in plan.reason and "page cache" in plan.reason
    assert plan.fix.startswith("give --engram-shm-dir a tmpfs mounted with huge=within_size")


def test_the_mount_holding_the_dir_is_the_longest_topmost_one_of_its_device():
    # A dir below the mount, and a look-alike name that is not below it.
    plan = thp.shm_dir_pages("/dev/shm/engram", mountinfo("rw,huge=always"), "never")
    assert plan.mount_point == "/dev/shm" and plan.huge
    assert thp.shm_dir_pages("/dev/shmx", mountinfo("rw,huge=always"), "never").fstype == "devtmpfs"
    # Two tmpfs stacked on /dev/shm (as on this machine): the later is on top; the directory's
    # device number picks the one it is on.
    stacked = mountinfo("rw,huge=within_size", devno="0:23") + "30 25 0:27 / /dev/shm rw - tmpfs tmpfs rw,size=1g\n"
    assert thp.shm_dir_pages("/dev/shm", stacked, "never").huge_option == "never"
    assert thp.shm_dir_pages("/dev/shm", stacked, "never", devno="0:23").huge_option == "within_size"
    # Escaped spaces in the mount point; /proc/mounts' format; no mount at all.
    spaced = mountinfo("rw,huge=within_size", point=r"/mnt/engram\040shm")
    assert thp.shm_dir_pages("/mnt/engram shm/x", spaced, "never").mount_point == "/mnt/engram shm"
    mounts = "tmpfs /dev/shm tmpfs rw,nosuid,nodev,huge=within_size 0 0\n/dev/vda / ext4 rw 0 0\n"
    assert thp.shm_dir_pages("/dev/shm", mounts, "never").huge is True
    assert thp.shm_dir_pages("/dev/shm", "", "never").huge is None


def test_hugetlbfs_is_huge_by_construction():
    assert thp.shm_dir_pages("/dev/hugepages", mountinfo("rw,pagesize=2M", "hugetlbfs", "/dev/hugepages"),
                             "never").huge is True


@pytest.mark.parametrize("enabled, huge_pages, huge, fix", [
    ("always [madvise] never", True, True, ""),
    ("[always] madvise never", True, True, ""),
    ("always madvise [never]", True, False, "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled"),
    ("always [madvise] never", False, False, "--engram-huge-pages on"),
    ("", True, None, ""),  # a kernel without THP
])
def test_a_private_copy_follows_transparent_hugepage_enabled(enabled, huge_pages, huge, fix):
    plan = thp.anonymous_pages(enabled, huge_pages=huge_pages)
    assert (plan.huge, plan.fix, plan.memory) == (huge, fix, "anonymous memory")


def test_measured_pages_overrule_the_expectation():
    huge = thp.shm_dir_pages("/dev/shm", mountinfo("rw,huge=within_size"), "never")
    assert thp.on_small_pages(huge, 0, 0) is False  # nothing resident: as expected
    assert thp.on_small_pages(huge, 4096, 0) is True  # resident, 0% huge: a copy filled before the remount
    assert thp.on_small_pages(huge, 4096, 4096) is False
    reason, fix = thp.measured_cause(huge, 0.0)
    assert "yet only 0% is on huge pages" in reason and "engram-sglang shm rm" in fix


def test_the_warning_is_one_line_naming_the_mount_its_option_the_knob_and_the_fix():
    plan = thp.shm_dir_pages("/dev/shm", mountinfo("rw,size=64g"), SHMEM.format("never"))
    line = thp.warning_line([(1, plan, 0.0, 189 << 30), (3, plan, 0.0, 1 << 30)])
    assert "\n" not in line and line.startswith("engram host tables on 4 KiB pages:")
    assert "layers 1, 3 in tmpfs /dev/shm (mount huge=never, shmem_enabled never" in line
    assert "fix: mount -o remount,huge=within_size /dev/shm" in line
    assert "190.00 GiB mapped costs ~380.0 MiB of GPU page tables" in line
    assert thp.warning_line([]) == ""


# ------------------------------------------------------------------ against this kernel
NAMESPACE_CHECK = r"""
import json, subprocess, sys
from engram_sglang.core.stores import open_store, thp
table_dir, mnt = sys.argv[1], sys.argv[2]
out = {}
for option in ("never", "advise", "within_size", "always"):
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size=64m,huge={option}", "tmpfs", mnt], check=True)
    stores = open_store(table_dir, "host", shared=True, shm_dir=mnt)
    store = stores[1]
    assert store.pages == thp.probe_dir(mnt)
    int(store.table.sum())  # every page resident: what a GPU's registration does
    report = store.memory.huge_pages_report()
    out[option] = [store.pages.huge, store.pages.huge_option, report.huge_kib]
    for s in stores.values():
        s.close()
    subprocess.run(["umount", mnt], check=True)
print(json.dumps(out))
"""


def test_the_expectation_matches_the_pages_this_kernel_gives(tmp_path):
    """A tmpfs per huge= value in a private user and mount namespace (unshare -rm): the verdict
    from the mount table is what smaps then shows of a shared copy filled there (one 2 MiB page
    fits a 3.1 MiB layer)."""
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare -rm (a user and mount namespace) is not allowed here")
    table_dir = write_tables(tmp_path / "t", CFG, random_rows(CFG), progress=False)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    run = subprocess.run(["unshare", "-rm", sys.executable, "-c", NAMESPACE_CHECK, str(table_dir), str(mnt)],
                         capture_output=True, text=True, timeout=300, cwd=os.getcwd())
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.splitlines()[-1])
    assert {k: v[:2] for k, v in got.items()} == {
        "never": [False, "never"], "advise": [False, "advise"],
        "within_size": [True, "within_size"], "always": [True, "always"]}
    for option, (huge, _, huge_kib) in got.items():
        assert (huge_kib >= 2048) == huge, got  # huge=advise: fallocate's pages stay 4 KiB


# ------------------------------------------------------------------ real host stores
@pytest.fixture(scope="module")
def table_dir(tmp_path_factory):
    return write_tables(tmp_path_factory.mktemp("tables") / "t", CFG, random_rows(CFG), progress=False)


def test_on_the_cpu_the_pages_are_an_info_line_and_no_warning(table_dir, tmp_path, caplog):
    """tmp_path is on a disk file system here (ext4: 4 KiB pages), but the CPU reads no table
    over UVA, so the start-up line says so at INFO and nothing warns."""
    with caplog.at_level(logging.INFO, logger="engram_sglang.core.stores"):
        stores = open_store(table_dir, "host", shared=True, shm_dir=tmp_path)
    try:
        store = stores[1]
        plan = thp.probe_dir(tmp_path)
        assert store.pages == plan
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
        line = next(r.getMessage() for r in caplog.records if r.name == "engram_sglang.core.stores"
                    and r.getMessage().startswith("engram layer 1:"))
        expect = {True: "huge", False: "4 KiB", None: "unknown"}[plan.huge]  # 4 KiB here (ext4)
        assert f"pages not resident yet ({expect} expected) ({plan.memory}" in line, line
        assert HostStore.start_up_warning(list(stores.values())) == ""
    finally:
        for s in stores.values():
            s.close()


def test_a_gpu_reading_tables_on_small_pages_gets_one_warning(table_dir, tmp_path):
    """The GPU case needs a GPU to open a store on; here the stores are real CPU stores whose
    `device` is set to a CUDA device afterwards (only the warning's choice reads it)."""
    stores = open_store(table_dir, "host", shared=True, shm_dir=tmp_path)
    try:
        for s in stores.values():
            s.device = torch.device("cuda", 0)
        line = HostStore.start_up_warning(list(stores.values()))
        plan = stores[1].pages
        assert line.startswith("engram host tables on 4 KiB pages:") and "\n" not in line
        assert f"layers 1, 3 in {plan.memory}" in line and f"fix: {plan.fix}" in line
        for s in stores.values():
            s.huge_pages = False  # --engram-huge-pages off: 4 KiB pages were asked for
        assert HostStore.start_up_warning(list(stores.values())) == ""
    finally:
        for s in stores.values():
            s.close()


def test_a_private_copy_measures_its_pages(table_dir):
    store = open_store(table_dir, "host")[1]
    try:
        stats, report = store.stats(), store.memory.huge_pages_report()
        assert report.mapped_kib * 1024 >= store.resident_bytes and stats["pages_measured"]
        assert stats["huge_page_coverage"] == pytest.approx(report.coverage)
        assert f"huge pages {report.coverage:.0%} (anonymous memory: THP " in store.describe()
        assert stats["page_memory"] == "anonymous memory" and stats["mount_huge"] is None
        assert stats["page_size_kib"] in (4, 2048) and stats["thp_enabled"] == store.pages.thp_enabled
    finally:
        store.close()
