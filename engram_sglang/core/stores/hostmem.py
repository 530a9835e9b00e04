"""Host memory for tables: anonymous or /dev/shm mappings, huge pages, GPU registration.

Never `pin_memory()`: PyTorch's pinned allocator rounds a 20.4 GiB table up to 32 GiB.
The table is mapped (anonymous for a private copy, a 0600 file in /dev/shm for one copy per
node: stores/shmcopy.py names, checks, shares and frees it), advised into transparent huge pages before it is filled (a row gather pays a TLB miss
per row on 4 KiB pages; a /dev/shm file gets them only by its mount's huge=: stores/thp.py), and registered with
the GPU runtime so kernels read it over UVA.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import resource
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..errors import EngramError
from ..fileio import drop_pages_not_in, resident_pages, retry_transient, tries_text
from ..ops import gpu_runtime
from . import numa, shmcopy, thp
from .base import TableIOError

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_COLLAPSE = getattr(mmap, "MADV_COLLAPSE", 25)  # Linux 6.1+; Python 3.11 lacks the name
_FILL_CHUNK = 64 << 20


@dataclass
class HugePageReport:
    mapped_kib: int
    huge_kib: int
    thp_mode: str  # the active transparent_hugepage (or shmem_enabled) setting
    page_kib: int = 0  # smaps' KernelPageSize: 2048 (or 1048576) for a hugetlbfs mapping, else 4

    @property
    def coverage(self) -> float:
        return self.huge_kib / self.mapped_kib if self.mapped_kib else 0.0


def thp_mode(knob: str = "enabled") -> str:
    """Active mode of /sys/kernel/mm/transparent_hugepage/{knob} ("" if unreadable)."""
    return thp.active_mode(thp.read_knob(knob))


def huge_page_report(address: int, shmem: bool, smaps: Optional[str] = None) -> HugePageReport:
    """Resident and huge-page-backed KiB of the mapping holding `address`, from smaps:
    the only evidence that the kernel really handed out huge pages. A hugetlbfs mapping's pages
    are not in its Rss: they are its Shared_Hugetlb and Private_Hugetlb, all huge."""
    mapped = huge = page = 0
    inside = False
    keys = ("ShmemPmdMapped", "FilePmdMapped") if shmem else ("AnonHugePages",)
    with (open("/proc/self/smaps") if smaps is None else contextlib.nullcontext(smaps.splitlines())) as lines:
        for line in lines:
            m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                if inside:
                    break
                inside = int(m.group(1), 16) <= address < int(m.group(2), 16)
            elif inside:
                key, _, rest = line.partition(":")
                if key == "Rss":
                    mapped += int(rest.split()[0])
                elif key in keys:
                    huge += int(rest.split()[0])
                elif key in ("Shared_Hugetlb", "Private_Hugetlb"):
                    mapped += int(rest.split()[0])
                    huge += int(rest.split()[0])
                elif key == "KernelPageSize":
                    page = int(rest.split()[0])
    return HugePageReport(mapped, huge, thp_mode("shmem_enabled" if shmem else "enabled"), page)


class HostTable:
    """`nbytes` of host memory holding rows, filled from a layer file.

    Parameters
    ----------
    shared : map the node's copy this spec names in /dev/shm (filled by the first rank, or
        checked against the manifest when no running server holds it, while the others wait;
        read-only unless `read_only` is off) instead of anonymous memory. It is filled under
        the spec's NUMA binding.
    binding : the NUMA binding of a private (anonymous) copy (stores/numa.py).
    pieces : a private copy's [(file offset, bytes), ...] laid one after another (a balanced
        shard's row ranges, summing to `nbytes`); by default the `nbytes` at `source_offset`.
    """

    def __init__(self, nbytes: int, *, source: Path, source_offset: int = 0, shared: Optional["shmcopy.Spec"] = None,
                 huge_pages: bool = True, read_only: bool = True, binding: Optional[numa.Binding] = None,
                 pieces: Optional[list[tuple[int, int]]] = None):
        self.nbytes = nbytes
        self.huge_pages = huge_pages
        self.shared: Optional[shmcopy.SharedCopy] = None
        self.shm_path: Optional[Path] = None
        if shared is None:
            self.map = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self._advise_huge(self.map)
            numa.bind(self.map, binding)  # before the fill touches the first page
            at = 0
            for offset, n in pieces if pieces is not None else [(source_offset, nbytes)]:
                with memoryview(self.map)[at:at + n] as into:  # released here: the mapping may be closed later
                    fill_from_file(into, source, offset, n)
                at += n
            self._collapse()
        else:
            if shared.nbytes != nbytes or pieces is not None:
                raise ValueError(f"a shared copy holds the whole layer ({shared.nbytes} bytes), not {nbytes}")
            self.shared = shmcopy.SharedCopy(
                shared, lambda m, progress: fill_from_file(m, source, source_offset, nbytes, progress), self._advise_huge,
                read_only=read_only)
            self.map, self.shm_path = self.shared.map, self.shared.path
        self.address = _address_of(self.map)
        self.registered = False

    def _advise_huge(self, m: mmap.mmap) -> None:
        if self.huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                m.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass  # THP disabled or unsupported: the report below says so

    def _collapse(self) -> None:
        if not self.huge_pages:
            return
        try:
            self.map.madvise(MADV_COLLAPSE)
        except OSError:
            pass  # kernel < 6.1 or no free huge pages; khugepaged may still collapse later

    def huge_pages_report(self) -> HugePageReport:
        return huge_page_report(self.address, shmem=self.shm_path is not None)

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:
            pass  # a tensor view still holds it; freed with the last view
        if self.shared is not None:
            self.shared.release()  # the last server to leave removes the node's copy


def _address_of(m: mmap.mmap) -> int:
    import numpy as np

    return np.frombuffer(m, dtype=np.uint8).ctypes.data


def fill_from_file(dst, source: Path, offset: int, nbytes: int, progress=None, into: str = "host memory") -> None:
    """Copy nbytes of `source` from `offset` into `dst` (a mapping, or any writable buffer),
    dropping behind us the pages of the file our reads brought into the page cache (the table
    would otherwise sit in RAM twice), never those cached before (another server's: a disk-tier
    server on the same files would then read from the device);
    `progress(bytes done)` after each chunk; `into` names the destination in errors."""
    try:
        fd = os.open(source, os.O_RDONLY)
    except OSError as e:
        raise TableIOError(f"{source}: cannot open the layer file to load it into {into} ({e.strerror})") from None
    view = memoryview(dst)
    try:
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_SEQUENTIAL)
        cached = resident_pages(fd, offset, nbytes)  # before our reads: what others keep cached
        done = 0
        while done < nbytes:  # a short read reads on from where it stopped
            want = min(nbytes - done, _FILL_CHUNK)
            try:
                with view[done : done + want] as chunk:  # released here: the mapping may be closed after an error
                    n = retry_transient(lambda: os.preadv(fd, [chunk], offset + done))
            except OSError as e:
                raise TableIOError(
                    f"{source}: reading {want:,} bytes at offset {offset + done:,} into {into} failed "
                    f"{tries_text(e)} ({e.strerror}); check the device (dmesg) and restart") from None
            if n <= 0:
                raise TableIOError(
                    f"{source}: the file ends early at byte {offset + done:,} of {offset + nbytes:,} while loading "
                    f"rows into {into} (truncated?); restore the table and restart")
            drop_pages_not_in(fd, offset + done, n, offset, cached)
            done += n
            if progress is not None:
                progress(done)
    finally:
        os.close(fd)
        view.release()


def shm_free_bytes(shm_dir: Path) -> int:
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


# ------------------------------------------------------------- GPU registration
@dataclass(frozen=True)
class Registration:
    """Host memory [address, address + nbytes) page-locked and mapped for `device`.

    `device_address` is what the runtime's HostGetDevicePointer returned for `address`: the
    address kernels must read it by. Where the device uses host pointers as is the two are
    equal; on ROCm they may differ."""

    address: int
    nbytes: int
    device: int
    flags: int
    device_address: int
    runtime: object = field(repr=False, compare=False)
    address_ordered: bool = False  # gpu_runtime.HostAccess.address_ordered of `device`
    pieces: tuple[int, ...] = ()  # start of each registration call, where the range took several

    def device_pointer(self, host_address: int) -> int:
        """The device address of `host_address`, which must lie inside the registered range."""
        if not self.address <= host_address <= self.address + self.nbytes:
            raise ValueError(f"{host_address:#x} is outside the registered range {self.address:#x}+{self.nbytes}")
        return self.device_address + (host_address - self.address)


def page_range(address: int, nbytes: int, page: int = mmap.PAGESIZE) -> tuple[int, int]:
    """(start, length) of the whole pages holding [address, address + nbytes)."""
    start = address // page * page
    end = -(-(address + nbytes) // page) * page
    return start, end - start


# Largest single registration per vendor (None: the whole range at once). ROCm documents that
# multi-GiB hipHostRegister calls can fail or stall (rocm-systems issue 11670): a rank's range
# is registered in pieces of at most 1 GiB there, which must map to one contiguous device range.
REGISTER_PIECE_BYTES = {gpu_runtime.CUDA: None, gpu_runtime.HIP: 1 << 30}


def registration_pieces(start: int, length: int, piece: Optional[int]) -> list[tuple[int, int]]:
    """[(start, length)] covering [start, start + length) in page-aligned pieces of <= `piece`."""
    if not piece or length <= piece:
        return [(start, length)]
    piece = max(mmap.PAGESIZE, piece // mmap.PAGESIZE * mmap.PAGESIZE)
    return [(a, min(piece, start + length - a)) for a in range(start, start + length, piece)]


def registration_flags(access, portable: bool) -> int:
    """Mapped always (kernels read the rows in place); ReadOnly where the device reports support
    (the GPU never writes the table); Portable where this process drives several GPUs."""
    flags = gpu_runtime.REGISTER_MAPPED
    if access.read_only:
        flags |= gpu_runtime.REGISTER_READ_ONLY
    if portable:
        flags |= gpu_runtime.REGISTER_PORTABLE
    return flags


def several_gpus_visible() -> bool:
    """The Portable rule: more than one GPU visible to this process. Any of them may launch the
    gather on the table (the op runs on the ids' device), and memory registered without
    Portable counts as pinned only for the device current at registration."""
    import torch

    return torch.cuda.device_count() > 1


def can_register_read_only(device) -> bool:
    """Whether `device`'s runtime takes the ReadOnly registration flag, which read-only host
    memory needs (CUDA where the device reports it; not HIP)."""
    runtime, _ = gpu_runtime.try_current()
    if runtime is None:
        return False
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    with runtime.device_guard(index):
        return gpu_runtime.host_access(runtime, index).read_only


def register_with_gpu(address: int, nbytes: int, *, device: int, runtime=None,
                      portable: Optional[bool] = None) -> Registration:
    """Page-lock and map the whole pages holding [address, address + nbytes) for `device`, under
    a guard that makes `device` current (the runtime registers for the current device), and
    return the device address kernels read them by. Refuses, in one line, a device that can
    map no host memory; a registration failure names the size and the locked-memory limit."""
    if runtime is None:
        runtime, why = gpu_runtime.try_current()
        if runtime is None:
            raise EngramError(f"placement host: cannot register table memory with the GPU: {why}; "
                              f"choose placement device or disk")
    if portable is None:
        portable = several_gpus_visible()
    start, length = page_range(address, nbytes)
    with runtime.device_guard(device):
        access = gpu_runtime.host_access(runtime, device)
        if not access.mapped:
            raise EngramError(f"placement host: {runtime.vendor} device {device} cannot map host memory into its "
                              f"address space (can_map_host_memory = 0): choose placement device or disk")
        flags = registration_flags(access, portable)
        pieces = registration_pieces(start, length, REGISTER_PIECE_BYTES.get(runtime.vendor))
        done: list[int] = []
        try:
            device_address = None
            for piece_start, piece_length in pieces:
                code = runtime.host_register(piece_start, piece_length, flags)
                if code != 0:
                    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
                    limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft / 2**30:.2f} GiB"
                    raise EngramError(
                        f"registering {length / 2**30:.2f} GiB of host table memory with the GPU failed (error {code}"
                        f"{f' at piece {len(done) + 1} of {len(pieces)}' if len(pieces) > 1 else ''}); the locked-"
                        f"memory limit (ulimit -l) is {limit}: raise it (docker run --ulimit memlock=-1) or choose "
                        f"placement device or disk")
                done.append(piece_start)
                try:
                    mapped = runtime.host_device_pointer(piece_start)
                except gpu_runtime.GpuRuntimeError as e:
                    raise EngramError(f"placement host: {runtime.vendor} device {device} gives no device address "
                                      f"for registered host memory ({e}): choose placement device or disk") from None
                if device_address is None:
                    device_address = mapped
                elif mapped != device_address + (piece_start - start):
                    # The kernel reads the rank's rows as one array: pieces mapped apart cannot serve.
                    raise EngramError(
                        f"placement host: {runtime.vendor} device {device} mapped the {len(pieces)} registered pieces "
                        f"of {length / 2**30:.2f} GiB at non-contiguous device addresses (piece {len(done)} at "
                        f"{mapped:#x}, expected {device_address + (piece_start - start):#x}): choose placement "
                        f"device or disk")
        except BaseException:
            for piece_start in done:
                runtime.host_unregister(piece_start)
            raise
    return Registration(start, length, device, flags, device_address, runtime, access.address_ordered,
                        tuple(done) if len(done) > 1 else ())


def unregister_from_gpu(registration: Registration) -> None:
    runtime = registration.runtime
    with runtime.device_guard(registration.device):
        for piece_start in registration.pieces or (registration.address,):
            runtime.host_unregister(piece_start)
