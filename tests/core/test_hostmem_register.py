"""Host memory registration (finding 5) and what the probe asks the runtime (finding 3),
against a recording stand-in for the GPU runtime (no GPU here; proven only with fakes)."""

from __future__ import annotations

import mmap

import pytest
import torch

from engram_sglang.core.errors import EngramError
from engram_sglang.core.ops import gpu_runtime, probe
from engram_sglang.core.stores import hostmem

PAGE = mmap.PAGESIZE


class FakeRuntime:
    """Records every call with the device that was current when it was made."""

    def __init__(self, vendor="cuda", *, read_only=1, can_map=1, same_address=1, offset=0x1000_0000_0000,
                 register_error=0, pointer_error=False, current=0):
        self.vendor, self.offset = vendor, offset
        self.attrs = {"can_map_host_memory": can_map, "unified_addressing": same_address,
                      "can_use_host_pointer_for_registered_mem": same_address,
                      "host_register_read_only_supported": read_only if vendor == "cuda" else None,
                      "warp_size": 32 if vendor == "cuda" else 64}
        self.register_error, self.pointer_error = register_error, pointer_error
        self.device = current
        self.calls = []

    def attribute(self, name, device):
        self.calls.append(("attribute", name, device, self.device))
        return self.attrs.get(name)

    def get_device(self):
        return self.device

    def set_device(self, device):
        self.calls.append(("set_device", device))
        self.device = device

    def device_guard(self, device):
        return gpu_runtime.GpuRuntime.device_guard(self, device)

    def host_register(self, address, nbytes, flags):
        self.calls.append(("register", address, nbytes, flags, self.device))
        return self.register_error

    def host_unregister(self, address):
        self.calls.append(("unregister", address, self.device))
        return 0

    def host_device_pointer(self, address):
        self.calls.append(("pointer", address, self.device))
        if self.pointer_error:
            raise gpu_runtime.GpuRuntimeError("hipHostGetDevicePointer failed: fake (error 1)", 1)
        return address + self.offset

    def of(self, kind):
        return [c for c in self.calls if c[0] == kind]


def test_registration_under_a_guard_for_the_store_device():
    rt = FakeRuntime(current=0)
    address, nbytes = 10 * PAGE + 264 * 3, 264 * 1000
    reg = hostmem.register_with_gpu(address, nbytes, device=2, runtime=rt, portable=False)
    (_, start, length, flags, dev), = rt.of("register")
    assert dev == 2 and rt.device == 0  # registered while device 2 was current, then restored
    assert start == 10 * PAGE and (start + length) % PAGE == 0 and start + length >= address + nbytes
    assert start + length - (address + nbytes) < PAGE  # exactly the pages holding the range
    assert flags == gpu_runtime.REGISTER_MAPPED | gpu_runtime.REGISTER_READ_ONLY
    assert rt.of("pointer")[0][2] == 2
    assert reg.device_pointer(address) == address + rt.offset
    hostmem.unregister_from_gpu(reg)
    assert rt.of("unregister") == [("unregister", start, 2)] and rt.device == 0


@pytest.mark.parametrize("vendor, read_only, portable, want", [
    ("cuda", 1, False, 0x2 | 0x8),
    ("cuda", 0, False, 0x2),          # ReadOnly only where the device reports support
    ("cuda", 1, True, 0x2 | 0x8 | 0x1),
    ("hip", 1, False, 0x2),           # never 0x8 on HIP: there it means coarse-grained
    ("hip", 1, True, 0x2 | 0x1),
])
def test_registration_flags(vendor, read_only, portable, want):
    rt = FakeRuntime(vendor, read_only=read_only)
    hostmem.register_with_gpu(PAGE, PAGE, device=0, runtime=rt, portable=portable)
    assert rt.of("register")[0][3] == want


def test_portable_follows_the_visible_gpu_count(monkeypatch):
    rt = FakeRuntime(read_only=0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)  # one process, eight GPUs visible
    hostmem.register_with_gpu(PAGE, PAGE, device=0, runtime=rt)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    hostmem.register_with_gpu(PAGE, PAGE, device=0, runtime=rt)
    assert [c[3] for c in rt.of("register")] == [0x2 | 0x1, 0x2]


def test_refusals_are_one_line():
    rt = FakeRuntime("hip", can_map=0)
    with pytest.raises(EngramError, match=r"^placement host: hip device 1 cannot map host memory") as e:
        hostmem.register_with_gpu(PAGE, PAGE, device=1, runtime=rt)
    assert "\n" not in str(e.value) and not rt.of("register")
    rt = FakeRuntime("hip", pointer_error=True)
    with pytest.raises(EngramError, match=r"^placement host: hip device 0 gives no device address") as e:
        hostmem.register_with_gpu(PAGE, PAGE, device=0, runtime=rt)
    assert "\n" not in str(e.value) and len(rt.of("unregister")) == 1  # not left registered
    with pytest.raises(EngramError, match=r"registering 47.21 GiB of host table memory with the GPU failed \(error 2\); "
                                          r"the locked-memory limit \(ulimit -l\) is"):
        hostmem.register_with_gpu(PAGE, int(47.21 * 2**30), device=0, runtime=FakeRuntime(register_error=2))


def test_no_runtime_loaded_refuses_host_placement(monkeypatch):
    monkeypatch.setattr(gpu_runtime, "try_current", lambda: (None, "no libcudart is loaded in this process"))
    with pytest.raises(EngramError, match="placement host: cannot register .*no libcudart is loaded"):
        hostmem.register_with_gpu(PAGE, PAGE, device=0)


# ------------------------------------------------------------------ the probe asks the runtime
class Props:
    def __init__(self, **kw):
        self.__dict__.update(kw)


@pytest.mark.parametrize("vendor", ["cuda", "hip"])
def test_probe_asks_either_runtime_about_host_memory(monkeypatch, vendor):
    """uva (host pointer usable) and host_map (mapped device address) come from the runtime,
    for HIP as for CUDA; before, HIP was uva=True unasked."""
    if vendor == "hip":
        monkeypatch.setattr(torch.version, "hip", "6.2.0", raising=False)
        props = Props(name="AMD Instinct MI300X", gcnArchName="gfx942:sramecc+:xnack-", warp_size=64)
    else:
        monkeypatch.setattr(torch.version, "hip", None, raising=False)
        props = Props(name="NVIDIA H200", major=9, minor=0, warp_size=32)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    for same, mapped in ((0, 1), (1, 1), (0, 0)):
        rt = FakeRuntime(vendor, same_address=same, can_map=mapped)
        with gpu_runtime.injected(rt):
            dev = probe.read_device("cuda:3")
        assert (dev.kind, dev.index, dev.uva, dev.host_map) == (vendor, 3, bool(same), bool(mapped))
        assert {c[2] for c in rt.of("attribute")} == {3}  # asked about its own device
    monkeypatch.setattr(gpu_runtime, "try_current", lambda: (None, "not loaded"))
    dev = probe.read_device("cuda:0")
    assert not dev.uva and not dev.host_map  # nothing to ask: nothing assumed


def test_host_store_refuses_a_device_that_reads_no_host_memory(monkeypatch, tmp_path):
    """The probe's answer is consulted before the table is read into memory."""
    from engram_sglang.core.stores import base
    from engram_sglang.core.stores.host import HostStore

    def base_init(self, layer_id, path, rows, row_range, device, backend, metric_ranks=None):  # no device counters (no GPU)
        self.layer_id, self.path, self.rows, self.row_range = layer_id, path, rows, row_range
        self.device, self.backend = torch.device(device), backend

    dev = probe.cuda_device("NVIDIA something", 9, 0, uva=False, host_map=False)
    monkeypatch.setattr(base.TableStore, "__init__", base_init)
    monkeypatch.setattr(probe, "select_backend", lambda device=None, requested=None: probe.Choice(dev, "cuda", (), "cuda", False))
    monkeypatch.setattr(hostmem, "HostTable", lambda *a, **k: pytest.fail("the table was read before the refusal"))
    with pytest.raises(EngramError, match=r"^placement host: NVIDIA something .* cannot read registered host memory") as e:
        HostStore(0, tmp_path / "layer-0.rows", 100, (0, 100), torch.device("cuda", 0), "cuda")
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------ ROCm: registration in pieces
GIB = 1 << 30


def test_hip_registers_a_rank_range_in_pieces_of_at_most_1_gib_mapped_as_one():
    """Issue 23, finding 3 (ROCm): multi-GiB hipHostRegister calls are documented to fail or
    stall; a 2.5 GiB range is registered in three page-aligned pieces of <= 1 GiB that cover it
    exactly, read as one device range, and all unregistered. (Proven with the recording fake.)"""
    rt = FakeRuntime("hip", read_only=0)
    address, nbytes = 100 * PAGE + 264, int(2.5 * GIB)
    reg = hostmem.register_with_gpu(address, nbytes, device=1, runtime=rt, portable=False)
    calls = rt.of("register")
    assert len(calls) == 3 and all(c[2] <= GIB and c[1] % PAGE == 0 and c[4] == 1 for c in calls)
    assert [c[1] for c in calls[1:]] == [c[1] + c[2] for c in calls[:-1]]  # back to back
    start, end = calls[0][1], calls[-1][1] + calls[-1][2]
    assert start <= address and end >= address + nbytes and end - (address + nbytes) < PAGE
    assert reg.device_pointer(address + GIB + 8) == address + GIB + 8 + rt.offset
    assert reg.pieces == tuple(c[1] for c in calls)
    hostmem.unregister_from_gpu(reg)
    assert [u[1] for u in rt.of("unregister")] == [c[1] for c in calls]


def test_cuda_registers_the_range_at_once():
    rt = FakeRuntime("cuda")
    reg = hostmem.register_with_gpu(0, 3 * GIB, device=0, runtime=rt, portable=False)
    assert len(rt.of("register")) == 1 and reg.pieces == ()
    hostmem.unregister_from_gpu(reg)
    assert len(rt.of("unregister")) == 1


class ApartRuntime(FakeRuntime):
    """Maps each registered piece at its own, non-contiguous device address."""

    def host_device_pointer(self, address):
        self.calls.append(("pointer", address, self.device))
        return address + self.offset + len(self.of("pointer")) * GIB


def test_hip_pieces_mapped_apart_are_refused_and_unregistered():
    rt = ApartRuntime("hip", read_only=0)
    with pytest.raises(EngramError, match=r"mapped the 3 registered pieces of 2\.50 GiB at non-contiguous device "
                                          r"addresses \(piece 2 at .*\): choose placement device or disk$"):
        hostmem.register_with_gpu(0, int(2.5 * GIB), device=0, runtime=rt, portable=False)
    assert [u[1] for u in rt.of("unregister")] == [c[1] for c in rt.of("register")] and len(rt.of("register")) == 2


class FailsSecond(FakeRuntime):
    def host_register(self, address, nbytes, flags):
        super().host_register(address, nbytes, flags)
        return 2 if len(self.of("register")) == 2 else 0


def test_hip_a_failed_piece_names_it_and_releases_the_pieces_before():
    rt = FailsSecond("hip", read_only=0)
    with pytest.raises(EngramError, match=r"failed \(error 2 at piece 2 of 3\); the locked-memory limit"):
        hostmem.register_with_gpu(0, int(2.5 * GIB), device=0, runtime=rt, portable=False)
    assert [u[1] for u in rt.of("unregister")] == [rt.of("register")[0][1]]
