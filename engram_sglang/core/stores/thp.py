"""Whether a host table gets transparent huge pages, and the exact fix where it does not.

On 4 KiB pages every random row the GPU reads over UVA misses its translation caches (host
lookups much slower), and mapping a table costs ~2 MiB of GPU page tables per GiB (8 bytes per
4 KiB page: ~400 MiB per rank for 189 GiB mapped whole). The knobs, as the kernel has them:

* A shared copy is a file in `--engram-shm-dir`. A tmpfs gives its files huge pages only by
  that MOUNT's `huge=` option (`never` where none is shown), unless
  /sys/kernel/mm/transparent_hugepage/shmem_enabled is `deny` (off for every mount) or
  `force` (on for every mount). Its other values govern memfd, SysV and shared anonymous
  memory, not tmpfs mounts. `huge=advise` does not reach the copy: its pages are allocated
  by fallocate (stores/shmcopy.py), which no madvise reaches (measured on Linux 6.18:
  advise + fallocate 0%, within_size and always 100%). A bind mount carries the mount's
  `huge=` (one superblock); Docker's `--tmpfs` and `--mount type=tmpfs` cannot set it (its
  tmpfs options are size, mode, uid, gid, nr_inodes, nr_blocks, mpol), nor can a Kubernetes
  emptyDir with medium Memory.
* A private copy is anonymous memory: transparent_hugepage/enabled (`madvise` or `always`;
  the store advises and collapses it) governs it, and nothing else.

Pure functions over the text of /proc/self/mountinfo (or /proc/mounts) and of the sysfs
knobs, so tests feed fixtures; `probe_dir` and `probe_anonymous` read this host's.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

THP_DIR = Path("/sys/kernel/mm/transparent_hugepage")
COVERAGE_FLOOR = 0.90  # of a table's resident pages on huge pages, else it counts as on 4 KiB pages
# Huge pages where the mount (or shmem_enabled=force) gives every page of the copy one.
HUGE_MOUNT_VALUES = ("always", "within_size")
FIX_HUGE = "within_size"  # huge pages for the copy (sized before it is filled), none for small files


@dataclass(frozen=True)
class Mount:
    mount_point: str
    fstype: str
    options: dict  # the superblock's options (huge= lives there), name -> value ("" for a flag)
    devno: str = ""  # "major:minor" (mountinfo only)


@dataclass(frozen=True)
class PagePlan:
    """What pages a host table in `memory` gets, before any is measured.

    huge : True / False, None where it cannot be told (no mount found, no THP in the kernel).
    huge_option : the tmpfs mount's huge= ("never" where it shows none); "" for anything else.
    reason : why, in a phrase; fix : the exact fix ("" where huge or none is known)."""

    huge: Optional[bool]
    memory: str  # "tmpfs /dev/shm", "ext4 /", "anonymous memory"
    mount_point: str = ""
    fstype: str = ""
    huge_option: str = ""
    shmem_enabled: str = ""
    thp_enabled: str = ""
    reason: str = ""
    fix: str = ""


def active_mode(text: str) -> str:
    """The bracketed (active) value of a sysfs THP knob's text ("always [madvise] never"), "" if none."""
    m = re.search(r"\[(\w+)\]", text or "")
    return m.group(1) if m else ""


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)  # mountinfo's \040 (space)


def _options(text: str) -> dict:
    return {k: v for k, _, v in (o.partition("=") for o in text.split(",") if o)}


def parse_mounts(text: str) -> list[Mount]:
    """The mounts of a /proc/self/mountinfo or /proc/mounts text, in its order (a later mount
    on the same point is on top)."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if "-" in fields[6:]:  # mountinfo: ID PARENT MAJ:MIN ROOT POINT OPTS [OPTIONAL...] - FSTYPE SOURCE SUPER
            dash = fields.index("-", 6)
            if len(fields) < dash + 4:
                continue
            mounts.append(Mount(_unescape(fields[4]), fields[dash + 1], _options(fields[dash + 3]), fields[2]))
        elif len(fields) >= 4:  # /proc/mounts: SOURCE POINT FSTYPE OPTS 0 0
            mounts.append(Mount(_unescape(fields[1]), fields[2], _options(fields[3])))
    return mounts


def mount_of(path: str, mounts: list[Mount], devno: str = "") -> Optional[Mount]:
    """The mount holding absolute, resolved `path`: the longest mount point above it, the last
    (topmost) of equals; among those of device `devno` where one is (a stacked or bind mount)."""
    path = "/" + path.strip("/")

    def above(point: str) -> bool:
        point = "/" + point.strip("/")
        return point == "/" or path == point or path.startswith(point + "/")

    found = [m for m in mounts if above(m.mount_point)]
    same_dev = [m for m in found if devno and m.devno == devno]
    found = same_dev or found
    best = None
    for m in found:
        if best is None or len(m.mount_point.rstrip("/")) >= len(best.mount_point.rstrip("/")):
            best = m
    return best


def _remount_fix(point: str) -> str:
    return (f"mount -o remount,huge={FIX_HUGE} {point} (as root where that mount is made: the host, or a container "
            f"with CAP_SYS_ADMIN; Docker cannot set huge=: bind-mount a host tmpfs mounted with huge={FIX_HUGE} and "
            f"point --engram-shm-dir at it), then restart")


def shm_dir_pages(path: str, mountinfo: str, shmem_enabled: str, *, devno: str = "") -> PagePlan:
    """The pages a shared copy in directory `path` (absolute, resolved) gets, from the text of
    /proc/self/mountinfo (or /proc/mounts) and of transparent_hugepage/shmem_enabled (raw
    sysfs text or the bare value); `devno` ("major:minor" of the directory) picks among
    stacked mounts."""
    shmem = active_mode(shmem_enabled) or (shmem_enabled or "").strip()
    mount = mount_of(path, parse_mounts(mountinfo), devno)
    if mount is None:
        return PagePlan(None, f"{path} (no mount found)", shmem_enabled=shmem,
                        reason=f"no mount holding {path} in the mount table")
    point, fs = mount.mount_point, mount.fstype
    memory = f"{fs} {point}"
    facts = dict(memory=memory, mount_point=point, fstype=fs, shmem_enabled=shmem)
    if fs == "hugetlbfs":
        return PagePlan(True, **facts, reason="hugetlbfs pages are huge by construction")
    if fs != "tmpfs":
        return PagePlan(False, **facts, reason=(
            f"{point} is {fs}, not a tmpfs: the copy is page cache of a file there, which no tmpfs huge= governs "
            f"(4 KiB pages as a rule)"), fix=(
            f"give --engram-shm-dir a tmpfs mounted with huge={FIX_HUGE} "
            f"(mount -t tmpfs -o size=NNNg,huge={FIX_HUGE} engram /mnt/engram-shm)"))
    huge = mount.options.get("huge", "never")  # the kernel shows huge= only where it is not never
    facts["huge_option"] = huge
    knob = f"shmem_enabled, now {shmem or 'unreadable'}, sets no tmpfs mount unless deny or force"
    if shmem == "deny":
        fix = f"echo never > {THP_DIR}/shmem_enabled (deny overrides every mount's huge=)"
        if huge not in HUGE_MOUNT_VALUES:
            fix += f", and {_remount_fix(point)}"
        return PagePlan(False, **facts, reason="shmem_enabled deny turns huge pages off for every tmpfs mount", fix=fix)
    if shmem == "force":
        return PagePlan(True, **facts, reason="shmem_enabled force gives every tmpfs mount huge pages (a testing setting)")
    if huge in HUGE_MOUNT_VALUES:
        return PagePlan(True, **facts, reason=f"tmpfs {point} has huge={huge}")
    if huge == "advise":
        reason = (f"tmpfs {point} has huge=advise, which the copy's pages never get (fallocate allocates them: "
                  f"no mapping's advice reaches them; {knob})")
    else:
        reason = f"tmpfs {point} has huge={huge} ({knob})"
    return PagePlan(False, **facts, reason=reason, fix=_remount_fix(point))


def anonymous_pages(enabled: str, *, huge_pages: bool = True) -> PagePlan:
    """The pages a private (anonymous) copy gets, from transparent_hugepage/enabled's text and
    whether the store advises huge pages (`--engram-huge-pages`)."""
    mode = active_mode(enabled) or (enabled or "").strip()
    facts = dict(memory="anonymous memory", thp_enabled=mode)
    if not huge_pages:
        return PagePlan(False, **facts, reason="--engram-huge-pages is off", fix="--engram-huge-pages on")
    if mode in ("always", "madvise"):
        return PagePlan(True, **facts, reason=f"transparent_hugepage/enabled is {mode}")
    if mode == "never":
        return PagePlan(False, **facts, reason="transparent_hugepage/enabled is never",
                        fix=f"echo madvise > {THP_DIR}/enabled")
    return PagePlan(None, **facts, reason="no transparent huge pages in this kernel (no sysfs knob)")


def read_knob(name: str) -> str:
    """The raw text of transparent_hugepage/`name` ("" where unreadable)."""
    try:
        return (THP_DIR / name).read_text()
    except OSError:
        return ""


def probe_dir(path: str | os.PathLike) -> PagePlan:
    """shm_dir_pages for `path` on this host."""
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
        devno = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    except OSError:
        devno = ""
    text = ""
    for source in ("/proc/self/mountinfo", "/proc/mounts"):
        try:
            text = Path(source).read_text()
            break
        except OSError:
            continue
    plan = shm_dir_pages(real, text, read_knob("shmem_enabled"), devno=devno)
    return PagePlan(**{**plan.__dict__, "thp_enabled": active_mode(read_knob("enabled"))})


def probe_anonymous(huge_pages: bool = True) -> PagePlan:
    """anonymous_pages on this host."""
    plan = anonymous_pages(read_knob("enabled"), huge_pages=huge_pages)
    return PagePlan(**{**plan.__dict__, "shmem_enabled": active_mode(read_knob("shmem_enabled"))})


def on_small_pages(plan: PagePlan, mapped_kib: int, huge_kib: int) -> Optional[bool]:
    """Whether a table is on 4 KiB pages: measured (smaps: `huge_kib` of `mapped_kib` resident)
    where any of it is resident, else as `plan` expects (None: cannot be told)."""
    if mapped_kib > 0:
        return huge_kib / mapped_kib < COVERAGE_FLOOR
    return None if plan.huge is None else not plan.huge


def measured_cause(plan: PagePlan, coverage: float) -> tuple[str, str]:
    """(reason, fix) for a table measured on small pages: the plan's, or where the plan expected
    huge pages, what leaves a table on small pages anyway."""
    if plan.huge is not True:
        return plan.reason, plan.fix
    if plan.memory == "anonymous memory":
        return (f"{plan.reason}, yet only {coverage:.0%} is on huge pages: memory too fragmented for them",
                "echo 1 > /proc/sys/vm/compact_memory before the start (or start before memory fragments)")
    return (f"{plan.reason}, yet only {coverage:.0%} is on huge pages: the copy was filled before that (kept, or "
            f"held by another server) or memory was too fragmented",
            "stop every server holding the copy, remove it (engram-sglang shm rm NAME) and restart, after "
            "echo 1 > /proc/sys/vm/compact_memory if memory is fragmented")


def warning_line(small: list[tuple[int, PagePlan, Optional[float], int]]) -> str:
    """The one start-up warning for tables a GPU reads over UVA on 4 KiB pages: entries
    (layer id, plan, measured huge-page share or None, bytes mapped), "" for none."""
    if not small:
        return ""
    causes: dict[tuple[str, str, str], tuple[PagePlan, list[int]]] = {}
    for layer, plan, coverage, _ in small:
        reason, fix = (plan.reason, plan.fix) if coverage is None else measured_cause(plan, coverage)
        causes.setdefault((plan.memory, reason, fix), (plan, []))[1].append(layer)
    parts = []
    for (memory, reason, fix), (plan, layers) in causes.items():
        knobs = f"mount huge={plan.huge_option}, " if plan.huge_option else ""
        knobs += f"shmem_enabled {plan.shmem_enabled or '?'}, enabled {plan.thp_enabled or '?'}"
        parts.append(f"layers {', '.join(map(str, sorted(layers)))} in {memory} ({knobs}): {reason}; "
                     f"fix: {fix or 'none known'}")
    gib = sum(mapped for *_, mapped in small) / 2**30
    return (f"engram host tables on 4 KiB pages: every random row read over UVA misses the GPU's translation "
            f"caches (much slower host lookups) and {gib:.2f} GiB mapped costs ~{gib * 2:.1f} MiB of GPU page "
            f"tables: " + " | ".join(parts))


# ------------------------------------------------------------- hugetlbfs room
def hugetlbfs_free_bytes(shm_dir: Path, huge_page: int) -> int:
    """Room for a shared copy in hugetlbfs `shm_dir` (of pages of `huge_page` bytes): the free
    huge pages of that size nobody has reserved, within the mount's size= limit if it has one."""
    st = os.statvfs(shm_dir)
    free, reserved = hugetlb_pool(huge_page)
    return hugetlb_free_bytes(huge_page, free, reserved, st.f_blocks, st.f_bavail)


def hugetlb_free_bytes(page: int, pool_free: int, pool_reserved: int, mount_blocks: int, mount_free: int) -> int:
    """Bytes a hugetlbfs file can still get: the pool's free pages less those reserved (mapped,
    not yet touched), and no more than the mount's free pages where it has a size= limit
    (statfs shows 0 blocks where it has none)."""
    pages = max(0, pool_free - pool_reserved)
    if mount_blocks > 0:
        pages = min(pages, max(0, mount_free))
    return pages * page


HUGEPAGES_SYSFS = Path("/sys/kernel/mm/hugepages")


def hugetlb_pool(page: int, root: Path = HUGEPAGES_SYSFS) -> tuple[int, int]:
    """(free, reserved) huge pages of size `page` on this host (sysfs; 0 where unreadable)."""
    out = []
    for name in ("free_hugepages", "resv_hugepages"):
        try:
            out.append(int((root / f"hugepages-{page >> 10}kB" / name).read_text()))
        except (OSError, ValueError):
            out.append(0)
    return out[0], out[1]


def hugetlb_room_text(shm_dir: Path, need: int, page: int) -> str:
    """What a hugetlbfs `shm_dir` lacks for `need` bytes and how to give it, in a clause."""
    st = os.statvfs(shm_dir)
    free, reserved = hugetlb_pool(page)
    return hugetlb_shortfall(shm_dir, need, page, free, reserved, st.f_blocks, st.f_bavail)


def hugetlb_shortfall(shm_dir, need: int, page: int, pool_free: int, pool_reserved: int, mount_blocks: int,
                      mount_free: int) -> str:
    """The clause of `hugetlb_room_text`, from the numbers (pure, for tests)."""
    want = -(-need // page)
    size = f"{page >> 20} MiB" if page < 1 << 30 else f"{page >> 30} GiB"
    sysctl = ("vm.nr_hugepages" if page == 2 << 20 else
              f"/sys/kernel/mm/hugepages/hugepages-{page >> 10}kB/nr_hugepages")
    parts = [f"it needs {want} huge pages of {size}, the node has {max(0, pool_free - pool_reserved)} free "
             f"(HugePages_Free {pool_free}, {pool_reserved} reserved)"]
    if mount_blocks > 0:
        parts.append(f"the mount's size= allows {mount_free} more")
    fix = f"reserve more with {sysctl} (or hugepages= at boot)"
    if mount_blocks > 0 and mount_free < want:
        fix += f" and remount {shm_dir} with a larger size="
    return f"{shm_dir} is hugetlbfs: {', '.join(parts)}; {fix}, or point --engram-shm-dir at a tmpfs"
