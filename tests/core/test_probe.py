"""The device probe with simulated devices (every GPU this project targets, on a CPU box),
and the real probe of this machine."""

from __future__ import annotations

import logging

import pytest

from engram_sglang.core.ops import BackendUnavailableError, native, probe, select_backend
from engram_sglang.core.ops.probe import Environment, choose, cpu_device, cuda_code_runs, cuda_device, hip_device

CUDA_BUILD = ("sm_89", "sm_90", "sm_100", "sm_120", "compute_120")  # what mk/kernels.mk builds
HIP_BUILD = ("gfx942", "gfx950")

DEVICES = {
    "L40S": cuda_device("NVIDIA L40S", 8, 9),  # Ada: converts e4m3 natively
    "H100": cuda_device("NVIDIA H100 80GB HBM3", 9, 0),
    "H200": cuda_device("NVIDIA H200", 9, 0),
    "B200": cuda_device("NVIDIA B200", 10, 0),
    "B300": cuda_device("NVIDIA B300 SXM6 AC", 10, 3),  # sm_103: runs the sm_100 SASS
    "RTX 5090": cuda_device("NVIDIA GeForce RTX 5090", 12, 0),
    "MI300X": hip_device("AMD Instinct MI300X", "gfx942:sramecc+:xnack-"),
    "MI355X": hip_device("AMD Instinct MI355X", "gfx950:sramecc+:xnack-"),
    "unknown gfx": hip_device("AMD Radeon something", "gfx1036"),
    "CPU": cpu_device(name="Simulated EPYC"),
}


def full_env(**over) -> Environment:
    fields = dict(native_targets={"cpu": (), "cuda": CUDA_BUILD, "hip": HIP_BUILD}, triton_error="")
    fields.update(over)
    return Environment(**fields)


@pytest.mark.parametrize(
    "name, backend, warp, fp8",
    [
        ("L40S", "cuda", 32, "e4m3fn"),
        ("H100", "cuda", 32, "e4m3fn"),
        ("H200", "cuda", 32, "e4m3fn"),
        ("B200", "cuda", 32, "e4m3fn"),
        ("B300", "cuda", 32, "e4m3fn"),
        ("RTX 5090", "cuda", 32, "e4m3fn"),
        ("MI300X", "hip", 64, "e4m3fnuz"),
        ("MI355X", "hip", 64, "e4m3fn"),
        ("unknown gfx", "torch", 32, "none"),
        ("CPU", "cpu", 1, "none"),
    ],
)
def test_simulated_devices_pick_native_first(name, backend, warp, fp8):
    dev = DEVICES[name]
    choice = choose(dev, full_env())
    assert choice.backend == backend
    assert (dev.warp_size, dev.fp8) == (warp, fp8)
    assert dev.uva == (dev.kind != "cpu")
    reasons = dict(choice.rejected)
    assert backend not in reasons and set(reasons) == set(probe.BACKENDS) - {backend}
    assert choice.degraded == (name == "unknown gfx")
    if name == "unknown gfx":
        assert "no code object for gfx1036" in reasons["hip"]
        assert "Triton does not target gfx1036" in reasons["triton"]
    line = choice.line(placement="host", table_bytes="20.4 GiB")
    assert f"backend {backend}" in line and dev.arch in line and "placement host" in line


def test_missing_native_library_falls_back_with_reason():
    env = full_env(native_targets={"cpu": None, "cuda": None, "hip": None},
                   native_missing_reason={"cuda": "libengram_cuda.so not built (run `make kernels`)"})
    h200 = choose(DEVICES["H200"], env)
    assert h200.backend == "triton" and h200.degraded
    assert "not built" in dict(h200.rejected)["cuda"]
    mi300 = choose(DEVICES["MI300X"], env)
    assert mi300.backend == "triton" and mi300.degraded
    cpu = choose(DEVICES["CPU"], env)
    assert cpu.backend == "torch" and cpu.degraded
    assert "no CPU backend" in dict(cpu.rejected)["triton"]
    no_triton = choose(DEVICES["H200"], full_env(native_targets={"cpu": (), "cuda": None, "hip": None},
                                                 triton_error="triton does not import"))
    assert no_triton.backend == "torch"


def test_gpu_the_library_was_not_built_for():
    a100 = cuda_device("NVIDIA A100-SXM4-80GB", 8, 0)  # older than every sm_ and the compute_120 PTX
    choice = choose(a100, full_env())
    assert choice.backend == "triton" and choice.degraded
    assert "none runs on sm_80" in dict(choice.rejected)["cuda"]
    rtx4090 = cuda_device("NVIDIA GeForce RTX 4090", 8, 9)  # Ada, like the L40S: the sm_89 SASS
    assert choose(rtx4090, full_env()).backend == "cuda"
    gb300_next = cuda_device("NVIDIA next", 12, 1)  # sm_121: the sm_120 SASS (and PTX) run
    assert choose(gb300_next, full_env()).backend == "cuda"


def test_forced_backend():
    env = full_env()
    assert choose(DEVICES["H200"], env, "triton").backend == "triton"
    assert choose(DEVICES["H200"], env, "TORCH ").backend == "torch"
    forced = choose(DEVICES["MI355X"], env, "hip")
    assert forced.requested == "hip" and not forced.degraded and "(forced)" in forced.line()
    with pytest.raises(BackendUnavailableError, match="needs an NVIDIA GPU"):
        choose(DEVICES["MI300X"], env, "cuda")
    with pytest.raises(BackendUnavailableError, match="no code object for gfx1036"):
        choose(DEVICES["unknown gfx"], env, "hip")
    with pytest.raises(BackendUnavailableError, match="not built"):
        choose(DEVICES["CPU"], full_env(native_targets={"cpu": None, "cuda": None, "hip": None}), "cpu")
    with pytest.raises(BackendUnavailableError, match="unknown backend"):
        choose(DEVICES["CPU"], env, "fast")


def test_cuda_binary_compatibility_rules():
    assert cuda_code_runs(CUDA_BUILD, "sm_90")
    assert cuda_code_runs(CUDA_BUILD, "sm_89")
    assert not cuda_code_runs(["sm_89"], "sm_90")  # no forward SASS across major versions
    assert not cuda_code_runs(["sm_90"], "sm_100")  # SASS does not cross major versions
    assert cuda_code_runs(["sm_100"], "sm_103")
    assert not cuda_code_runs(["sm_100"], "sm_120")
    assert cuda_code_runs(["compute_120"], "sm_121")  # PTX is JIT-compiled forward
    assert not cuda_code_runs(["compute_120"], "sm_100")
    assert not cuda_code_runs(CUDA_BUILD, "sm_80")


def test_logging(caplog):
    caplog.set_level(logging.DEBUG, logger="engram_sglang.core.ops")
    probe.log_choice(choose(DEVICES["H200"], full_env()))
    probe.log_choice(choose(DEVICES["H200"], full_env(native_targets={"cpu": (), "cuda": None, "hip": None})))
    probe.log_choice(choose(DEVICES["H200"], full_env(), "torch"), announce=False)
    levels = [r.levelno for r in caplog.records]
    assert levels == [logging.INFO, logging.WARNING, logging.DEBUG]
    assert all(r.getMessage().count("\n") == 0 for r in caplog.records)  # one line each
    assert "falling back" in caplog.records[1].getMessage()


# ------------------------------------------------------------------ this machine
@pytest.fixture
def fresh_probe(monkeypatch):
    monkeypatch.delenv(probe.ENV_BACKEND, raising=False)
    probe.reset()
    yield monkeypatch
    probe.reset()


def test_real_probe_of_this_machine(fresh_probe, caplog):
    caplog.set_level(logging.INFO, logger="engram_sglang.core.ops")
    choice = select_backend("cpu")
    assert choice.device.kind == "cpu" and not choice.device.simulated
    lib, why = native.try_load("cpu")
    assert choice.backend == ("cpu" if lib else "torch"), why
    assert select_backend("cpu") is choice  # read once
    lines = [r for r in caplog.records if r.name == "engram_sglang.core.ops"]
    assert len(lines) == 1 and "engram gather: device" in lines[0].getMessage()


def test_env_override(fresh_probe):
    fresh_probe.setenv(probe.ENV_BACKEND, "torch")
    assert select_backend("cpu").backend == "torch"
    probe.reset()
    fresh_probe.setenv(probe.ENV_BACKEND, "cuda")
    with pytest.raises(BackendUnavailableError, match="needs an NVIDIA GPU"):
        select_backend("cpu")
