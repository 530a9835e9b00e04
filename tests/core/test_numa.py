"""NUMA binding of the host placement (issue 12 item 5): the topology from a simulated sysfs
tree (2 nodes, fake PCI devices), the node each rank's copy goes to, one shared copy per node,
auto falling back to interleave, one-line errors, the mbind calls made (the syscall wrapper
recorded), and the real mbind on this machine's node 0."""

from __future__ import annotations

import errno
import mmap
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from engram_sglang.core.errors import EngramError
from engram_sglang.core.hashing import EngramLayout
from engram_sglang.core.rowformat import ROW_BYTES
from engram_sglang.core.stores import numa, open_store, shmadmin, shmcopy
from engram_sglang.core.tablefile import write_tables
from tests.support.tables import small_config

GIB = 1 << 30
CFG = small_config(200, layer_ids=(1,), n_heads=2)
ROWS = EngramLayout(CFG).rows(1)
NBYTES = ROWS * ROW_BYTES
GPU = {0: "0000:17:00.0", 1: "0000:9a:00.0", 2: "0000:c3:00.0"}  # node 0, node 1, unknown (-1)


def fake_sysfs(root: Path, free_gib=(100.0, 100.0)) -> Path:
    """Two sockets (nodes 0 and 1, CPUs 0-3 and 4-7), node 2 without memory, node 3 of memory
    alone (a GPU's HBM on GH200, or CXL), three GPUs."""
    base = root / "devices/system/node"
    for n, (cpus, free) in enumerate((("0-3", free_gib[0]), ("4-7", free_gib[1]), ("", 0), ("", 90))):
        d = base / f"node{n}"
        d.mkdir(parents=True)
        total = 0 if n == 2 else 256 << 20
        (d / "meminfo").write_text(f"Node {n} MemTotal:       {total} kB\nNode {n} MemFree:        "
                                   f"{int(free * (1 << 20))} kB\nNode {n} MemUsed:        1 kB\n")
        (d / "cpulist").write_text(cpus + "\n")
    (base / "online").write_text("0-2\n")
    for bus, node in zip(GPU.values(), (0, 1, -1)):
        d = root / "bus/pci/devices" / bus
        d.mkdir(parents=True)
        (d / "numa_node").write_text(f"{node}\n")
    return root


@pytest.fixture
def sysfs(tmp_path, monkeypatch):
    root = fake_sysfs(tmp_path / "sys")
    monkeypatch.setattr(numa, "SYSFS", root)
    monkeypatch.setattr(numa, "pci_bus_id", lambda device: GPU[device.index])
    monkeypatch.setattr(numa, "mbind_unavailable", lambda: None)
    return root


@pytest.fixture
def mbind_calls(monkeypatch):
    """The mbind syscalls the stores make: (length, policy, node mask); the policy is not applied."""
    calls = []
    monkeypatch.setattr(numa, "_mbind", lambda address, length, policy, mask: calls.append((length, policy, mask)))
    return calls


@pytest.fixture
def order(monkeypatch, mbind_calls):
    """What happens to a copy's memory, in order: "mbind", "fallocate" (tmpfs pages), "fill"."""
    from engram_sglang.core.stores import hostmem

    seen = []
    mbind, fallocate, fill = numa._mbind, shmcopy.os.posix_fallocate, hostmem.fill_from_file
    monkeypatch.setattr(numa, "_mbind", lambda *a: (seen.append("mbind"), mbind(*a)))
    monkeypatch.setattr(shmcopy.os, "posix_fallocate", lambda *a: (seen.append("fallocate"), fallocate(*a)))
    monkeypatch.setattr(hostmem, "fill_from_file", lambda *a, **k: (seen.append("fill"), fill(*a, **k)))
    return seen


@pytest.fixture(scope="module")
def table_dir(tmp_path_factory):
    rows = np.random.default_rng(5).integers(0, 256, (ROWS, ROW_BYTES), dtype=np.uint8)
    return write_tables(tmp_path_factory.mktemp("tables") / "t", CFG, {1: rows}, chunk_rows=64, progress=False), rows


def test_topology_from_sysfs(sysfs):
    topo = numa.Topology.read()
    assert topo.ids == (0, 1, 3)  # node 2 has no memory: nothing to bind to
    assert topo.socket_ids == (0, 1)  # what auto and interleave spread over: not node 3's HBM
    assert topo.node(1).cpus == frozenset(range(4, 8)) and topo.node(0).mem_free == 100 * GIB
    assert topo.node(0).mem_total == 256 * GIB
    assert [topo.node_of_pci(b) for b in GPU.values()] == [0, 1, None]
    assert topo.node_of_pci("0000:00:00.0") is None  # no such device
    assert topo.node_of_cpus([5, 6]) == 1 and topo.node_of_cpus([3, 4]) is None
    assert numa.parse_cpulist("0-3,8,10-11\n") == frozenset({0, 1, 2, 3, 8, 10, 11})
    assert numa.Topology.read(sysfs / "nothing").nodes == ()  # a kernel without NUMA


def test_each_rank_binds_to_its_gpus_node(sysfs):
    b = [numa.choose("auto", torch.device("cuda", i), GIB) for i in range(3)]
    assert [(x.policy, x.nodes, x.tag) for x in b] == [
        (numa.MPOL_BIND, (0,), "node0"), (numa.MPOL_BIND, (1,), "node1"), (numa.MPOL_INTERLEAVE, (0, 1), "interleave")]
    assert "0000:c3:00.0" in b[2].why and "-1" in b[2].why  # unknown node: says so, and interleaves


def test_a_cpu_rank_binds_to_the_node_of_its_cpus(sysfs, monkeypatch):
    monkeypatch.setattr(numa.os, "sched_getaffinity", lambda pid: {4, 5})
    assert numa.choose("auto", torch.device("cpu"), GIB).nodes == (1,)
    monkeypatch.setattr(numa.os, "sched_getaffinity", lambda pid: {3, 4})
    assert numa.choose("auto", torch.device("cpu"), GIB).tag == "interleave"


def test_auto_falls_back_to_interleave_when_the_node_cannot_hold_the_copy(tmp_path, monkeypatch, sysfs):
    tight = fake_sysfs(tmp_path / "tight", free_gib=(100.0, 2.0))
    topo = numa.Topology.read(tight)
    b = numa.choose("auto", torch.device("cuda", 1), 3 * GIB, topo)
    assert b.tag == "interleave" and "node 1" in b.why and "2.00 GiB free" in b.why
    assert numa.choose("auto", torch.device("cuda", 0), 3 * GIB, topo).tag == "node0"
    # A copy of these tables already on node 1 (another rank filled it) counts as its own, not as used.
    held = numa.choose("auto", torch.device("cuda", 1), 3 * GIB, topo, present=lambda b: GIB if b.tag == "node1" else 0)
    assert held.tag == "node1"


def test_explicit_modes(sysfs):
    assert numa.choose("1", torch.device("cuda", 0), GIB).nodes == (1,)  # the operator's node wins
    assert numa.choose("interleave", torch.device("cuda", 0), GIB).nodes == (0, 1)
    assert numa.choose("off", torch.device("cuda", 0), GIB).tag is None
    assert numa.choose("3", torch.device("cuda", 0), GIB).nodes == (3,)  # a memory-only node, by number only


@pytest.mark.parametrize("mode, message", [
    ("2", "--engram-host-numa 2: no NUMA node 2 with memory under"),
    ("7", "--engram-host-numa 7: no NUMA node 7 with memory under"),
    ("near", "ENGRAM_HOST_NUMA (--engram-host-numa) must be auto, interleave, off or a NUMA node number"),
])
def test_a_bad_node_is_one_line(sysfs, mode, message):
    with pytest.raises(EngramError) as e:
        numa.choose(mode, torch.device("cuda", 0), GIB)
    assert message in str(e.value) and "\n" not in str(e.value)
    if mode.isdigit():
        assert "(nodes: 0, 1, 3)" in str(e.value)


def test_one_node_is_left_alone_and_a_refused_mbind_is_not_fatal_in_auto(tmp_path, monkeypatch, sysfs):
    one = tmp_path / "one"
    fake_sysfs(one)
    for d in ("node1", "node2", "node3"):
        for f in (one / "devices/system/node" / d).iterdir():
            f.unlink()
        (one / "devices/system/node" / d).rmdir()
    assert numa.choose("auto", torch.device("cuda", 0), GIB, numa.Topology.read(one)).tag is None
    monkeypatch.setattr(numa, "mbind_unavailable", lambda: "mbind failed: Operation not permitted")
    assert numa.choose("auto", torch.device("cuda", 0), GIB).tag is None
    with pytest.raises(EngramError, match=r"--engram-host-numa 1 cannot be honoured: mbind failed: .*use --engram-host-numa off"):
        numa.choose("1", torch.device("cuda", 0), GIB)


def test_the_node_is_in_the_shared_copys_name():
    spec = shmcopy.Spec(Path("/dev/shm"), 1, 10, 64, ("00" * 8,))
    names = [spec.path.name] + [
        shmcopy.Spec(Path("/dev/shm"), 1, 10, 64, ("00" * 8,), binding=b).path.name
        for b in (numa.Binding(numa.MPOL_BIND, (0,)), numa.Binding(numa.MPOL_BIND, (1,)),
                  numa.Binding(numa.MPOL_INTERLEAVE, (0, 1)))]
    ident = names[0].split("-")[1]
    assert names == [f"engram-{ident}-layer1.rows", f"engram-{ident}-node0-layer1.rows",
                     f"engram-{ident}-node1-layer1.rows", f"engram-{ident}-interleave-layer1.rows"]
    assert [shmcopy.NAME.match(n)["numa"] for n in names] == [None, "node0", "node1", "interleave"]
    assert shmcopy._TMP.match(names[2] + ".tmp.12")


def _host(table_dir, shm, device, **kw):
    return open_store(table_dir, "host", device, cfg=CFG, shared=True, shm_dir=shm, **kw)[1]


def test_one_shared_copy_per_node_each_rank_maps_its_own(table_dir, tmp_path, sysfs, mbind_calls, order,
                                                          monkeypatch):
    """Two CPU ranks, one per node: two copies, each bound to its node (MPOL_BIND) before any of
    its pages exist; a second rank on node 1 maps the node's copy (no new fill, no new mbind)."""
    d, rows = table_dir
    shm = tmp_path / "shm"
    shm.mkdir()
    stores = []
    for cpus in ({0, 1}, {4, 5}, {6, 7}):
        monkeypatch.setattr(numa.os, "sched_getaffinity", lambda pid, cpus=cpus: cpus)
        stores.append(_host(d, shm, "cpu"))
    assert [s.stats()["numa"] for s in stores] == ["node0", "node1", "node1"]
    assert mbind_calls == [(NBYTES, numa.MPOL_BIND, 0b01), (NBYTES, numa.MPOL_BIND, 0b10)]
    assert order == ["mbind", "fallocate", "fill"] * 2
    names = sorted(p.name for p in shm.glob("engram-*.rows"))
    assert [re.sub("[0-9a-f]{16}", "ID", n) for n in names] == ["engram-ID-node0-layer1.rows",
                                                               "engram-ID-node1-layer1.rows"]
    assert stores[1].memory.shm_path == stores[2].memory.shm_path != stores[0].memory.shm_path
    assert [e["numa"] for e in shmadmin.list_copies(shm)] == ["node0", "node1"]
    for s in stores:
        assert np.array_equal(s.table.numpy(), rows)
        assert "NUMA node" in s.describe()
        s.close()
    assert list(shm.glob("engram-*")) == []


def test_a_full_node_fails_the_fill_in_one_line_and_leaves_nothing(table_dir, tmp_path, sysfs, mbind_calls,
                                                                     monkeypatch):
    def no_memory(fd, offset, length):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(shmcopy.os, "posix_fallocate", no_memory)
    shm = tmp_path / "shm"
    shm.mkdir()
    with pytest.raises(EngramError) as e:
        _host(table_dir[0], shm, "cpu", numa="1")
    assert re.fullmatch(r".*-node1-layer1\.rows: no memory for a 0\.00 GiB shared table on NUMA node 1 "
                        r"\(--engram-host-numa 1\); free memory or choose --engram-host-numa interleave", str(e.value))
    assert [p.name for p in shm.iterdir() if not p.name.endswith((".lock", ".users"))] == []  # no copy, no .tmp


def test_the_mode_reaches_the_store_and_private_copies_are_bound_too(table_dir, tmp_path, sysfs, mbind_calls,
                                                                        order, monkeypatch):
    d, rows = table_dir
    shm = tmp_path / "shm"
    shm.mkdir()
    from engram_sglang.serving.settings import ServeSettings

    options = ServeSettings.from_env({"ENGRAM_PLACEMENT": "host", "ENGRAM_HOST_SHARED": "on", "ENGRAM_SHM_DIR": str(shm),
                                      "ENGRAM_HOST_NUMA": "interleave"}).store_options()
    store = open_store(d, "host", "cpu", cfg=CFG, **options)[1]
    assert mbind_calls == [(NBYTES, numa.MPOL_INTERLEAVE, 0b11)] and "-interleave-layer1" in store.memory.shm_path.name
    store.close()
    mbind_calls.clear()
    # A private copy (sharing off) of rank 1 of 2 at TP 2: its shard, bound to node 1.
    monkeypatch.setattr(numa.os, "sched_getaffinity", lambda pid: {4})
    store = open_store(d, "host", "cpu", cfg=CFG, tp_rank=1, tp_size=2)[1]
    assert mbind_calls == [(store.rows_held * ROW_BYTES, numa.MPOL_BIND, 0b10)] and not store.shared
    assert order[-len(store.row_ranges) - 1:] == ["mbind"] + ["fill"] * len(store.row_ranges)  # bound first
    # A balanced shard's private copy: its ranges one after another, nothing else.
    assert len(store.row_ranges) > 1
    assert np.array_equal(store.table.numpy(), np.concatenate([rows[lo:hi] for lo, hi in store.row_ranges]))
    store.close()
    mbind_calls.clear()
    store = open_store(d, "host", "cpu", cfg=CFG, numa="off")[1]
    assert mbind_calls == [] and store.stats()["numa"] == "off"
    store.close()
    with pytest.raises(EngramError, match="no NUMA node 5 with memory"):
        open_store(d, "host", "cpu", cfg=CFG, numa="5")


# ------------------------------------------------------------- the real syscalls, on this machine
def _numa_maps_line(address: int) -> str:
    for line in Path("/proc/self/numa_maps").read_text().splitlines():
        if int(line.split()[0], 16) == address:
            return line
    return ""


def _real_mbind_or_skip():
    why = numa.mbind_unavailable()
    if why is not None:
        pytest.skip(why)


def test_thread_policy_binds_this_thread_inside_the_block_and_puts_it_back():
    """hugetlbfs's fallocate takes pages by the thread's policy (set_mempolicy), not a mapping's:
    inside the block this thread is bound to node 0; after it, back to what it was."""
    _real_mbind_or_skip()
    before = numa.policy_of()
    with numa.thread_policy(numa.Binding(numa.MPOL_BIND, (0,))):
        assert numa.policy_of() == (numa.MPOL_BIND, 0b1)
    assert numa.policy_of() == before
    with numa.thread_policy(None):  # unbound: nothing set
        assert numa.policy_of() == before


def test_real_mbind_to_node_0():
    _real_mbind_or_skip()
    m = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = np.frombuffer(m, dtype=np.uint8).ctypes.data
    assert numa.policy_of(address) == (numa.MPOL_DEFAULT, 0)
    numa.bind(m, numa.Binding(numa.MPOL_BIND, (0,)))
    assert numa.policy_of(address) == (numa.MPOL_BIND, 0b1)
    m[:] = b"\x01" * len(m)  # first touch: the pages come from node 0
    if Path("/proc/self/numa_maps").exists():
        line = _numa_maps_line(address)
        assert " bind:0 " in line and re.search(r" N0=\d+", line), line
    # The kernel itself refuses a node this machine does not have (the wrapper reaches it).
    missing = max(numa.Topology.read().ids, default=0) + 1
    with pytest.raises(EngramError, match=f"to NUMA node {missing} failed: Invalid argument"):
        numa.bind(m, numa.Binding(numa.MPOL_BIND, (missing,)))
    m.close()


@pytest.fixture
def tmpfs_dir():
    """A fresh directory in /dev/shm: tmpfs, whose files keep a mapping's NUMA policy."""
    import shutil
    import tempfile

    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    d = Path(tempfile.mkdtemp(prefix="engram-test-numa-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_real_shared_copy_bound_to_node_0(table_dir, tmpfs_dir):
    """The shared copy filled under MPOL_BIND to node 0: tmpfs keeps the policy with the file,
    so the read-only mapping every rank serves from shows it too."""
    _real_mbind_or_skip()
    d, rows = table_dir
    tmp_path = tmpfs_dir
    store = _host(d, tmp_path, "cpu", numa="0")
    assert store.memory.shm_path.name.endswith("-node0-layer1.rows")
    assert np.array_equal(store.table.numpy(), rows)
    assert numa.policy_of(store.memory.address) == (numa.MPOL_BIND, 0b1)
    if Path("/proc/self/numa_maps").exists():
        line = _numa_maps_line(store.memory.address)
        assert " bind:0 " in line and str(store.memory.shm_path) in line, line
    store.close()
    store = _host(d, tmp_path, "cpu", numa="interleave")
    assert numa.policy_of(store.memory.address)[0] == numa.MPOL_INTERLEAVE
    store.close()


def test_syscall_numbers_of_the_two_architectures(monkeypatch):
    assert numa.SYSCALLS == {"x86_64": (237, 239), "aarch64": (235, 236)}
    monkeypatch.setattr(numa.platform, "machine", lambda: "riscv64")
    with pytest.raises(OSError) as e:
        numa._mbind(0, 4096, numa.MPOL_BIND, 1)
    assert e.value.errno == errno.ENOSYS and "riscv64" in str(e.value)
