"""NUMA placement of host table memory: which node a rank's copy lives on, and binding it there.

A GPU reading a table over its host link from the far socket's DRAM crosses the socket
interconnect too, at about half the bandwidth. So the host placement binds its memory to a
node before the first page of it exists (mbind(2): the kernel allocates a page by the policy
in force when the page is first touched or fallocated, and never moves it afterwards):

* `auto` (the default): each rank's copy on its GPU's node (the PCI device's `numa_node` in
  sysfs; a CPU rank: the node of the CPUs it may run on); one shared copy per node. A node
  whose free memory cannot hold the copy gets one copy interleaved over all nodes instead.
  A machine with one node is left alone (there is nothing to choose), as is one whose
  kernel refuses mbind (e.g. a container without CAP_SYS_NICE): logged, never fatal;
* `interleave`: pages spread round-robin over every node (one copy for the whole machine;
  every GPU reads half of it from the far socket, but none reads all of it from there);
* `off`: the kernel's default (first touch: the node of the CPU that fills the copy);
* `N`: bound to node N (an explicit choice that cannot be honoured stops start-up).

The topology is read from an injectable sysfs root (tests simulate a 2-node machine); the
syscalls go through ctypes with the syscall numbers of x86_64 and aarch64, so libnuma is
not needed.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import functools
import logging
import mmap
import os
import platform
import re
from pathlib import Path
from typing import Callable, Optional

from ..errors import EngramConfigError, EngramError

logger = logging.getLogger(__name__)

SYSFS = Path("/sys")
MPOL_DEFAULT, MPOL_BIND, MPOL_INTERLEAVE = 0, 2, 3  # linux/mempolicy.h
MPOL_F_ADDR = 2
MODES = ("auto", "interleave", "off")  # or a node number
MAX_NODES = 1024  # the kernel's NODES_SHIFT is at most 10
_MASK_WORDS = MAX_NODES // 64 + 1
# (mbind, get_mempolicy): arch/x86/entry/syscalls/syscall_64.tbl; include/uapi/asm-generic/unistd.h.
SYSCALLS = {"x86_64": (237, 239), "aarch64": (235, 236)}
SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}


@dataclasses.dataclass(frozen=True)
class Node:
    id: int
    cpus: frozenset
    mem_total: int  # bytes
    mem_free: int


@dataclasses.dataclass(frozen=True)
class Topology:
    """The NUMA nodes with memory, as sysfs under `root` shows them."""

    root: Path
    nodes: tuple[Node, ...]

    @classmethod
    def read(cls, root: Optional[str | os.PathLike] = None) -> "Topology":
        root = Path(root if root is not None else SYSFS)  # SYSFS read now: tests point it at a fake tree
        base = root / "devices/system/node"
        nodes = []
        try:
            names = os.listdir(base)
        except OSError:
            names = []  # a kernel without NUMA: no node directory at all
        for name in names:
            m = re.fullmatch(r"node(\d+)", name)
            if m is None:
                continue
            n = int(m.group(1))
            mem = _meminfo(base / name / "meminfo", n)
            if mem.get("MemTotal", 0) == 0:
                continue  # a node of CPUs only: no memory to bind to
            cpus = parse_cpulist(_read(base / name / "cpulist") or "")
            nodes.append(Node(n, cpus, mem["MemTotal"], mem.get("MemFree", 0)))
        return cls(root, tuple(sorted(nodes, key=lambda x: x.id)))

    @property
    def ids(self) -> tuple[int, ...]:
        return tuple(n.id for n in self.nodes)

    @property
    def socket_ids(self) -> tuple[int, ...]:
        """Nodes with CPUs as well as memory: what auto and interleave spread over. A node of
        memory alone is a GPU's HBM (GH200, GB200) or a CXL expander: only bound to by number."""
        return tuple(n.id for n in self.nodes if n.cpus) or self.ids

    def node(self, n: int) -> Node:
        return next(x for x in self.nodes if x.id == n)

    def node_of_pci(self, bus_id: str) -> Optional[int]:
        """The node of PCI device `bus_id` (e.g. 0000:9a:00.0); None when sysfs says -1
        (unknown: common in VMs and one-socket boards) or has no such device."""
        text = _read(self.root / "bus/pci/devices" / bus_id.lower() / "numa_node")
        try:
            n = int(text) if text is not None else -1
        except ValueError:
            n = -1
        return n if n >= 0 and n in self.ids else None

    def node_of_cpus(self, cpus) -> Optional[int]:
        """The one node holding every CPU of `cpus`; None when they span nodes."""
        hit = {n.id for n in self.nodes if n.cpus & set(cpus)}
        return hit.pop() if len(hit) == 1 else None


def parse_cpulist(text: str) -> frozenset:
    """`0-3,8,10-11` -> {0, 1, 2, 3, 8, 10, 11} (sysfs cpulist format)."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(out)


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _meminfo(path: Path, node: int) -> dict[str, int]:
    """`Node N MemTotal: X kB` lines -> {"MemTotal": X * 1024, ...}."""
    out = {}
    for line in (_read(path) or "").splitlines():
        m = re.match(rf"Node {node} (\w+):\s+(\d+) kB", line)
        if m:
            out[m.group(1)] = int(m.group(2)) * 1024
    return out


# ----------------------------------------------------------------------- policy
@dataclasses.dataclass(frozen=True)
class Binding:
    """Where a rank's host table memory goes: `policy` over `nodes`, and why."""

    policy: int  # MPOL_DEFAULT (not bound), MPOL_BIND (one node) or MPOL_INTERLEAVE
    nodes: tuple[int, ...] = ()
    why: str = dataclasses.field(default="", compare=False)

    @property
    def tag(self) -> Optional[str]:
        """What a shared copy's name carries: `node1`, `interleave`, or nothing (not bound)."""
        if self.policy == MPOL_BIND:
            return f"node{self.nodes[0]}"
        if self.policy == MPOL_INTERLEAVE:
            return "interleave"
        return None

    @property
    def mask(self) -> int:
        return sum(1 << n for n in self.nodes)

    def describe(self) -> str:
        where = {MPOL_BIND: f"NUMA node {self.nodes[0]}" if self.nodes else "",
                 MPOL_INTERLEAVE: f"interleaved over NUMA nodes {','.join(map(str, self.nodes))}"}.get(
            self.policy, "not NUMA-bound")
        return f"{where} ({self.why})" if self.why else where


OFF = Binding(MPOL_DEFAULT)


def check_mode(value: str, where: str = "ENGRAM_HOST_NUMA (--engram-host-numa)") -> str:
    """`value` if it is auto, interleave, off or a node number; else one line."""
    v = value.strip().lower()
    if v in MODES or (v.isdigit() and int(v) < MAX_NODES):
        return v
    raise EngramConfigError(f"{where} must be auto, interleave, off or a NUMA node number (0..{MAX_NODES - 1}), "
                            f"got {value!r}")


def choose(mode: str, device, need: int, topology: Optional[Topology] = None,
           present: Callable[[Binding], int] = lambda b: 0) -> Binding:
    """The binding of a rank's host tables (`need` bytes on one node) on `device`.

    `present(binding)`: bytes of these tables already held in memory with that binding (a
    shared copy another rank filled or is filling, or one kept from an earlier server):
    they are counted as free, not as needed again."""
    mode = check_mode(str(mode))
    if mode == "off":
        return Binding(MPOL_DEFAULT, why="--engram-host-numa off")
    topology = topology or Topology.read()
    where = topology.root / "devices/system/node"
    if mode != "auto":
        if not topology.nodes:
            raise EngramError(f"--engram-host-numa {mode}: {where} lists no NUMA node with memory; "
                              f"use --engram-host-numa off")
        if mode != "interleave" and int(mode) not in topology.ids:
            raise EngramError(f"--engram-host-numa {mode}: no NUMA node {mode} with memory under {where} (nodes: "
                              f"{', '.join(map(str, topology.ids))}); give one of them, auto, interleave or off")
        _require_mbind(mode)
        if mode == "interleave":
            return Binding(MPOL_INTERLEAVE, topology.socket_ids, "--engram-host-numa interleave")
        return Binding(MPOL_BIND, (int(mode),), f"--engram-host-numa {mode}")
    if len(topology.socket_ids) < 2:
        return Binding(MPOL_DEFAULT, why="one NUMA node: nothing to choose")
    why = mbind_unavailable()
    if why is not None:
        logger.warning("engram: host tables are not NUMA-bound: %s (--engram-host-numa off silences this)", why)
        return Binding(MPOL_DEFAULT, why=f"mbind unavailable: {why}")
    node, how = device_node(device, topology)
    spread = Binding(MPOL_INTERLEAVE, topology.socket_ids)
    if node is None:
        return dataclasses.replace(spread, why=f"{how}: no node is nearer, so interleaved")
    bind = Binding(MPOL_BIND, (node,), how)
    free = topology.node(node).mem_free + present(bind)
    if free < need:
        return dataclasses.replace(spread, why=f"node {node} ({how}) has {free / 2**30:.2f} GiB free, the copy needs "
                                               f"{need / 2**30:.2f} GiB")
    return bind


def device_node(device, topology: Topology) -> tuple[Optional[int], str]:
    """(node of `device`, how it was found): a GPU's from its PCI device; for the CPU, the
    node of the CPUs this process may run on (SGLang binds a CPU rank's threads)."""
    if getattr(device, "type", "cpu") == "cpu":
        cpus = sorted(os.sched_getaffinity(0))
        node = topology.node_of_cpus(cpus)
        span = f"CPUs {cpus[0]}-{cpus[-1]}" if cpus else "no CPUs"
        return node, (f"the node of this process's {span}" if node is not None else f"this process's {span} span nodes")
    try:
        bus = pci_bus_id(device)
    except Exception as e:  # noqa: BLE001 - a runtime without PCI properties: the node is unknown
        return None, f"{device}'s PCI address is unknown ({e})"
    node = topology.node_of_pci(bus)
    if node is None:
        return None, f"GPU {bus}'s NUMA node is unknown ({topology.root}/bus/pci/devices/{bus}/numa_node is -1 or missing)"
    return node, f"GPU {bus}'s node"


def pci_bus_id(device) -> str:
    """`0000:9a:00.0` of a CUDA/HIP device, as sysfs names it."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    p = torch.cuda.get_device_properties(index)
    return f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"


# ----------------------------------------------------------------------- syscalls
def _syscall_numbers() -> tuple[int, int]:
    nrs = SYSCALLS.get(platform.machine())
    if nrs is None:
        raise OSError(errno.ENOSYS, f"no mbind syscall number known for {platform.machine()}")
    return nrs


def _set_mempolicy(policy: int, mask: int) -> None:
    nr = SET_MEMPOLICY.get(platform.machine())
    if nr is None:
        raise OSError(errno.ENOSYS, f"no set_mempolicy syscall number known for {platform.machine()}")
    words = _mask_array(mask) if mask else None
    r = _libc().syscall(ctypes.c_long(nr), ctypes.c_int(policy), words, ctypes.c_ulong(MAX_NODES + 1 if mask else 0))
    if r != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


@contextlib.contextmanager
def thread_policy(binding: Optional[Binding]):
    """This thread's memory policy set to `binding` inside the block (set_mempolicy(2)), then
    put back as it was. For allocations no mapping's policy reaches: hugetlbfs's fallocate
    allocates a file's huge pages by the calling thread's policy, not by an mbind of a
    mapping of it. Nothing for an unbound binding."""
    if binding is None or binding.policy == MPOL_DEFAULT:
        yield
        return
    try:
        mode, mask = policy_of()
        before = (mode & 0xFFFF, mask)  # (mode flags dropped)
    except OSError:
        before = (MPOL_DEFAULT, 0)
    try:
        _set_mempolicy(binding.policy, binding.mask)
    except OSError as e:
        raise EngramError(f"binding host table memory to {binding.describe()} failed: {e.strerror}; use "
                          f"--engram-host-numa off") from None
    try:
        yield
    finally:
        try:
            _set_mempolicy(before[0], before[1] if before[0] != MPOL_DEFAULT else 0)
        except OSError:
            _set_mempolicy(MPOL_DEFAULT, 0)


@functools.lru_cache(maxsize=1)
def _libc():
    lib = ctypes.CDLL(None, use_errno=True)
    lib.syscall.restype = ctypes.c_long
    return lib


def _mask_array(mask: int):
    words = (ctypes.c_ulong * _MASK_WORDS)()
    for i in range(_MASK_WORDS):
        words[i] = (mask >> (64 * i)) & 0xFFFFFFFFFFFFFFFF
    return words


def _mbind(address: int, length: int, policy: int, mask: int) -> None:
    """mbind(2) of [address, address + length) to `policy` over the nodes in bitmask `mask`;
    OSError on failure. The wrapper tests replace to see what would be bound."""
    nr, _ = _syscall_numbers()
    words = _mask_array(mask) if mask else None
    r = _libc().syscall(ctypes.c_long(nr), ctypes.c_void_p(address), ctypes.c_ulong(length), ctypes.c_int(policy),
                        words, ctypes.c_ulong(MAX_NODES + 1 if mask else 0), ctypes.c_uint(0))
    if r != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def policy_of(address: Optional[int] = None) -> tuple[int, int]:
    """(policy, node bitmask) in force at `address` (get_mempolicy(2) with MPOL_F_ADDR), or the
    calling thread's own policy without one."""
    _, nr = _syscall_numbers()
    mode = ctypes.c_int(-1)
    words = (ctypes.c_ulong * _MASK_WORDS)()
    r = _libc().syscall(ctypes.c_long(nr), ctypes.byref(mode), words, ctypes.c_ulong(MAX_NODES + 1),
                        ctypes.c_void_p(address or 0), ctypes.c_ulong(0 if address is None else MPOL_F_ADDR))
    if r != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return mode.value, sum(int(w) << (64 * i) for i, w in enumerate(words))


@functools.lru_cache(maxsize=1)
def mbind_unavailable() -> Optional[str]:
    """None when mbind works here, else why not (probed once on a scratch page: Docker's
    default seccomp profile allows it only with CAP_SYS_NICE)."""
    m = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        _mbind(_address(m), mmap.PAGESIZE, MPOL_DEFAULT, 0)
    except OSError as e:
        hint = " (a container without CAP_SYS_NICE? docker run --cap-add SYS_NICE)" if e.errno == errno.EPERM else ""
        return f"mbind failed: {e.strerror}{hint}"
    finally:
        m.close()
    return None


def _require_mbind(mode: str) -> None:
    why = mbind_unavailable()
    if why is not None:
        raise EngramError(f"--engram-host-numa {mode} cannot be honoured: {why}; use --engram-host-numa off")


def _address(m: mmap.mmap) -> int:
    buf = (ctypes.c_char * len(m)).from_buffer(m)
    try:
        return ctypes.addressof(buf)
    finally:
        del buf


def bind(m: mmap.mmap, binding: Optional[Binding]) -> None:
    """Bind the whole mapping `m` by `binding` before any of its pages exist (a page already
    allocated stays where it is). Nothing for an unbound binding; an mbind failure is one line."""
    if binding is None or binding.policy == MPOL_DEFAULT or len(m) == 0:
        return
    try:
        _mbind(_address(m), len(m), binding.policy, binding.mask)
    except OSError as e:
        raise EngramError(f"binding {len(m) / 2**30:.2f} GiB of host table memory to {binding.describe()} failed: "
                          f"{e.strerror}; use --engram-host-numa off") from None
