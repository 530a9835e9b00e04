"""The host placement: a layer table in host memory (anonymous, or one /dev/shm copy per node),
bound to a NUMA node, huge pages where the system gives them, registered with the GPU and read
in-kernel through its device address.

The device store (stores/device.py), this one and the disk store (stores/disk.py) end in the
same op, `gather_dequant`, over packed rows: the device and host stores hand it the whole
(shard of the) table, the disk store a staging buffer of the call's unique rows. So the bits
are the same by construction, and the tests check it.
"""

from __future__ import annotations

import logging
import mmap
import os
import warnings
from pathlib import Path
from typing import Optional

import torch

from ..errors import EngramConfigError, EngramError
from ..ops import probe
from ..rowformat import ROW_BYTES, ROW_VALUES
from ..tablefile import DATA_OFFSET
from . import hostmem, shmadmin, shmcopy, thp
from . import numa as numa_mod
from .base import RowRanges, WholeTableStore, as_ranges
from .metrics import METRICS

logger = logging.getLogger(__name__)

REQUIRE = "require"  # `shared`: one copy per node or no start (never the private fallback)


class HostStore(WholeTableStore):
    """The rows in host memory (anonymous, or one /dev/shm copy per node), bound to the NUMA
    node `numa` chooses (stores/numa.py), huge pages where the system gives them, registered
    with the GPU and read in-kernel by the device address the runtime maps them at
    (`table_address`)."""

    placement = "host"
    # Device address of `table`'s first row where it is registered with the GPU: what the
    # native and Triton gathers read (`gather_dequant(table, ..., table_address=...)`).
    table_address: Optional[int] = None

    def __init__(self, layer_id, path, rows, row_range, device, backend, *, shared: bool | str = False,
                 shm_dir: str | os.PathLike = "/dev/shm", huge_pages: bool = True, keep: bool = False,
                 checksums: tuple[str, ...] = (), chunk_rows: int = 0, whole_rows: bool = False, numa: str = "auto",
                 metric_ranks=None):
        super().__init__(layer_id, path, rows, row_range, device, backend, metric_ranks=metric_ranks)
        # A shard of several ranges (a balanced one): a private copy holds just its rows, one
        # range after another; the node's copy holds all and the op reads the ranges' span.
        lo, hi = self.row_range
        ranges = self.row_ranges
        held = self.rows_held
        if self.device.type == "cuda":
            # Before the table is read into memory: a device that can read registered host
            # memory neither by its host pointer nor by a mapped device address is refused.
            dev = probe.select_backend(self.device, backend).device
            if not (dev.uva or dev.host_map):
                raise EngramError(f"placement host: {dev.describe()} cannot read registered host memory "
                                  f"(its runtime reports no mapping of host memory): choose placement device or disk")
        # The NUMA node(s) the rows go to, before the first page exists (stores/numa.py).
        # A shared copy's name carries them: one copy per node.
        def copy_spec(binding):
            return shmcopy.Spec(Path(shm_dir), layer_id, rows, chunk_rows, tuple(checksums), keep, binding)

        self.binding = numa_mod.choose(numa, self.device, (rows if shared else held) * ROW_BYTES,
                                       present=lambda b: shmcopy.allocated_bytes(copy_spec(b).path) if shared else 0)
        spec = None
        if shared:
            # One copy of the whole layer per node: every TP rank and DP replica on the node
            # maps the same file and reads its own row range of it. Named by the rows' content
            # (the manifest's checksums), which it is checked against (stores/shmcopy.py).
            if not checksums or chunk_rows < 1:
                raise EngramError(f"{path}: a shared host copy needs the manifest's chunk checksums to name and check "
                                  f"it (open the tables with open_store)")
            shm_dir = Path(shm_dir)
            need = rows * ROW_BYTES
            if not shm_dir.is_dir():  # a typo must not quietly cost one copy per rank
                raise EngramError(f"{shm_dir}: the shared host table's directory (ENGRAM_SHM_DIR) does not exist or is "
                                  f"not a directory; give an existing tmpfs such as /dev/shm, or turn sharing off")
            # hugetlbfs: huge pages by construction, the file whole pages of the mount's size, the
            # room the pool's unreserved free pages (a fill beyond them would fault, not fail).
            page = shmcopy.huge_page_bytes(shm_dir)
            need = shmcopy.copy_bytes(need, page)
            free = thp.hugetlbfs_free_bytes(shm_dir, page) if page else hostmem.shm_free_bytes(shm_dir)
            fix = (thp.hugetlb_room_text(shm_dir, need, page) if page else
                   f"give Docker --shm-size={-(-need // 2**30) + 1}g or --ipc=host")
            candidate = copy_spec(self.binding)
            shmcopy.check_kinds(candidate.path)
            # A fill in progress (another rank's `.tmp`) has taken its memory already: it is this copy's.
            if os.path.lexists(candidate.path) or free + shmcopy.allocated_bytes(candidate.path) >= need:
                spec = candidate
            else:
                # What is there that nobody uses (a killed server's copy, a kept one): the operator's
                # first place to look, named with its size.
                spare = shmadmin.describe_unheld(shm_dir, shmadmin.unheld(shm_dir))
                if shared == REQUIRE:  # asked for no fallback: one copy per rank may not fit the node's memory
                    raise EngramConfigError(
                        f"engram layer {layer_id}: {shm_dir} has {free / 2**30:.2f} GiB free but the shared table "
                        f"needs {need / 2**30:.2f} GiB, and --engram-host-shared require (ENGRAM_HOST_SHARED) refuses "
                        f"a private copy per rank: {fix}; or use --engram-host-shared on to fall back; {spare}")
                logger.warning(
                    "engram layer %d: %s has %.2f GiB free but the shared table needs %.2f GiB: keeping a private "
                    "copy of this rank's rows instead (for one copy per node: %s); %s", layer_id, shm_dir,
                    free / 2**30, need / 2**30, fix, spare,
                )
        self.shm_dir = Path(shm_dir)
        self.fell_back = bool(shared) and spec is None  # asked to share, kept a private copy (start_up_warning)
        if self.fell_back:
            # The private fallback holds this rank's rows only: bound by their size, not the layer's.
            self.binding = numa_mod.choose(numa, self.device, held * ROW_BYTES)
        first, last = (0, rows) if spec is not None else (lo, hi)
        # Whether the mapping holds rows [first, last) in place (one range, or the node's copy),
        # or a private copy of several ranges one after another.
        self._in_place = spec is not None or self.shard is None
        if not self._in_place:
            first, last = 0, held
        elif self.shard is not None:  # the node's copy: the op reads the span, the ranges in place
            self.shard = RowRanges(ranges, rows, f"{path}: layer {layer_id} shard", compact=False).on(self.device)
        if whole_rows and spec is not None:
            # The node's copy holds the whole layer: this rank reads the whole rows of its own
            # tokens (no other rank's rows needed, no all-reduce; open_store's `agree`).
            lo, hi = self.row_range = (0, rows)
            self.shard = None
        nbytes = (last - first) * ROW_BYTES
        # The shared copy is served read-only, unless the GPU cannot register read-only memory
        # (no ReadOnly registration flag: HIP, older CUDA devices), which then needs it writable.
        read_only = self.device.type != "cuda" or hostmem.can_register_read_only(self.device)
        pieces = None if self._in_place else [(DATA_OFFSET + a * ROW_BYTES, (b - a) * ROW_BYTES) for a, b in ranges]
        self.memory = hostmem.HostTable(
            nbytes, source=Path(path), source_offset=DATA_OFFSET + first * ROW_BYTES, shared=spec,
            huge_pages=huge_pages, read_only=read_only, binding=self.binding, pieces=pieces,
        )
        shm_path = self.memory.shm_path
        self.shared = shm_path is not None
        with warnings.catch_warnings():  # a read-only buffer: nothing here writes the table
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            mapped = torch.frombuffer(self.memory.map, dtype=torch.uint8, count=nbytes).view(last - first, ROW_BYTES)
        self._mapped, self._first = mapped, first
        self.table = mapped[lo - first : hi - first] if self._in_place else mapped
        # Registered: only the pages of the rows this rank reads (its shard of a shared layer,
        # the span of its ranges there, or the whole layer where it reads whole rows), for this
        # store's device; kernels read them by the device address the runtime gives.
        self.registration: Optional[hostmem.Registration] = None
        if self.device.type == "cuda" and self.table.shape[0]:
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            self.registration = hostmem.register_with_gpu(self.table.data_ptr(), self.table.shape[0] * ROW_BYTES,
                                                          device=index)
            self.table_address = self.registration.device_pointer(self.table.data_ptr())
            self.memory.registered = True
        # Without ATS the GPU translates every row of a table far beyond its translation reach:
        # read in address order, each translation serves a run of rows (upstream SGLang does so too).
        self.sorted_reads = self.registration is not None and self.registration.address_ordered
        # Pages: measured from smaps where any are resident (a registered table is), and what
        # the mount or the THP knob gives (stores/thp.py), for the start-up line and warning.
        self.huge = self.memory.huge_pages_report()
        self.huge_pages = huge_pages
        self.pages = thp.probe_dir(shm_dir) if self.shared else thp.probe_anonymous(huge_pages)
        METRICS.host_facts(self)

    def _gather(self, ids, out):
        if not self.sorted_reads:
            return super()._gather(ids, out)
        # Sorted and scattered back on the device (no host sync; capturable): the rows come out
        # in the ids' order, bit for bit what the unsorted read gives.
        flat = ids.reshape(-1).to(self.device)
        order = torch.argsort(flat)
        rows, unique = super()._gather(flat[order], None)
        if out is None:
            out = torch.empty((*ids.shape, ROW_VALUES), dtype=torch.bfloat16, device=self.device)
        out.view(-1, ROW_VALUES).index_copy_(0, order, rows.view(-1, ROW_VALUES))
        return out, unique

    @property
    def resident_bytes(self) -> int:
        return self.memory.nbytes

    @property
    def node_shared(self) -> bool:
        return self.shared

    def hold_only(self, row_range) -> None:
        """Narrow whole rows to a shard, one range or several (a peer rank holds only its
        shard): the mapping and its registration stay, the table the op reads becomes the
        shard's rows (the span of its ranges, read through `shard`)."""
        ranges = as_ranges(row_range)
        first = self._first
        shard = RowRanges(ranges, self.rows, f"{self.path}: layer {self.layer_id} shard", compact=False).on(self.device)
        lo, hi = shard.span
        if not self._in_place or not first <= lo <= hi <= first + self._mapped.shape[0]:
            super().hold_only(row_range)  # raises unless unchanged: rows this store does not map in place
            return
        self.table = self._mapped[lo - first : hi - first]
        self.row_range = (lo, hi)
        self.shard = shard if len(ranges) > 1 else None
        if self.registration is not None:
            self.table_address = self.registration.device_pointer(self.table.data_ptr())

    @property
    def measured(self) -> bool:
        """Whether any of the table's pages were resident when measured (else no share is known)."""
        return self.huge.mapped_kib > 0

    @property
    def small_pages(self) -> Optional[bool]:
        """On 4 KiB pages: measured where resident, else as the mount or knob says (None: unknown)."""
        return thp.on_small_pages(self.pages, self.huge.mapped_kib, self.huge.huge_kib)

    @classmethod
    def start_up_warning(cls, stores: list["HostStore"]) -> str:
        """One line for the layers whose shared copy fell back to a private one (which shared,
        which not: the per-layer lines above are many and may scroll by), one for every table a
        GPU reads over UVA on 4 KiB pages (none on the CPU: no UVA; none where
        --engram-huge-pages is off: asked for)."""
        return "\n".join(line for line in (cls._fallback_line(stores), cls._small_pages_line(stores)) if line)

    @staticmethod
    def _fallback_line(stores: list["HostStore"]) -> str:
        private = [s for s in stores if s.fell_back]
        if not private:
            return ""
        shared = [s.layer_id for s in stores if s.shared]
        dirs = ", ".join(sorted({str(s.shm_dir) for s in private}))
        gib = sum(s.resident_bytes for s in private) / 2**30
        where = (f"layers {_layer_list(shared)} share the node's copy, layers {_layer_list(s.layer_id for s in private)}"
                 if shared else f"all {len(private)} layer(s) ({_layer_list(s.layer_id for s in private)})")
        return (f"engram host tables: {dirs} had room for {len(shared)} of {len(shared) + len(private)} shared "
                f"layer copies: {where} keep a private copy of this rank's rows ({gib:.2f} GiB on this rank, one "
                f"per rank; see each layer's warning for what the shm dir needs and what `shm prune` would free)")

    @staticmethod
    def _small_pages_line(stores: list["HostStore"]) -> str:
        small = []
        for s in stores:
            if s.device.type == "cuda" and s.huge_pages and s.small_pages:
                mapped = s.registration.nbytes if s.registration is not None else s.table.numel()
                small.append((s.layer_id, s.pages, s.huge.coverage if s.measured else None, mapped))
        return thp.warning_line(small)

    def stats(self) -> dict:
        s = super().stats()
        small, plan = self.small_pages, self.pages
        s.update(shared=self.shared, registered=self.memory.registered, numa=self.binding.tag or "off",
                 huge_page_coverage=self.huge.coverage if self.measured else None,  # None: nothing resident
                 page_size_kib=None if small is None else (
                     self.huge.page_kib if self.huge.page_kib > 4 else  # hugetlbfs: smaps' KernelPageSize
                     (mmap.PAGESIZE if small else hostmem.HUGE_PAGE) >> 10),
                 pages_measured=self.measured, page_memory=plan.memory, mount_huge=plan.huge_option or None,
                 shmem_enabled=plan.shmem_enabled or None, thp_enabled=plan.thp_enabled or None,
                 page_fix=self.page_fix() or None, reads_in_address_order=self.sorted_reads)
        return s

    def page_fix(self) -> str:
        """The fix for a table on 4 KiB pages ("" where it is not, or none is known)."""
        if not self.small_pages:
            return ""
        return thp.measured_cause(self.pages, self.huge.coverage)[1] if self.measured else self.pages.fix

    def pages_text(self) -> str:
        """The start-up line's page fact: the measured share (or what is expected) and its knobs."""
        plan = self.pages
        if plan.huge_option:
            where = f"{plan.memory}: huge={plan.huge_option}, shmem_enabled {plan.shmem_enabled or '?'}"
        elif plan.memory == "anonymous memory":
            where = f"{plan.memory}: THP {plan.thp_enabled or 'unknown'}"
        else:
            where = plan.memory + (", not a tmpfs" if plan.fstype not in ("", "hugetlbfs") else "")
        if self.measured:
            head = f"huge pages {self.huge.coverage:.0%}"
        else:
            expect = {True: "huge", False: "4 KiB", None: "unknown"}[plan.huge]
            head = f"pages not resident yet ({expect} expected)"
        return f"{head} ({where})"

    def describe(self) -> str:
        layout = f"shared {self.memory.shm_path}" if self.shared else "private"
        return (f"{super().describe()}, {layout} host memory, {self.pages_text()}, {self.binding.describe()}, "
                f"registered {self.memory.registered}"
                + (", rows read in address order (the GPU maps host memory in its own page tables: no ATS)"
                   if self.sorted_reads else ""))

    def close(self) -> None:
        super().close()
        if self.registration is not None:
            hostmem.unregister_from_gpu(self.registration)
            self.registration = None
            self.table_address = None
            self.memory.registered = False
        self.memory.close()  # a shared copy's last holder removes it


def _layer_list(layers) -> str:
    """1, 3-5, 9: sorted layer ids with runs of consecutive ones shortened."""
    ids, parts = sorted(layers), []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ", ".join(parts)
