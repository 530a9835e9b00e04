"""Backends as data (engram_sglang/core/ops/backends.py): the probe's choice, its reasons, the explicit
override and gather_dequant's launch all read the one table; a FAKE backend added to the table
alone is chosen, rejected with its own reason, and launched, bit for bit."""

from __future__ import annotations

import logging

import pytest
import torch

from engram_sglang.core.errors import EngramError
from engram_sglang.core.ops import (
    BackendUnavailableError,
    backends,
    gather,
    gather_dequant,
    native,
    probe,
    select_backend,
)
from engram_sglang.core.ops.backends import BACKEND_TABLE, Backend
from engram_sglang.core.ops.probe import Environment, choose, cpu_device, cuda_device, hip_device
from engram_sglang.core.rowformat import ROW_BYTES, bf16_bits

H200, MI300X = cuda_device("NVIDIA H200", 9, 0), hip_device("AMD Instinct MI300X", "gfx942")
CPU = cpu_device(name="Simulated EPYC")
EVERYTHING_BUILT = Environment(native_targets={"cpu": (), "cuda": ("sm_90",), "hip": ("gfx942",)})
NONE_BUILT = Environment(native_targets={})


# ------------------------------------------------------------------ the fake backend
CALLS: list[dict] = []  # what the fake launcher was handed
UNPLUGGED = {"why": ""}  # the fake's reason not to run ("" = it runs)
UNPLUGGED_WHY = "the fake accelerator is unplugged"


def fake_rejection(spec, dev, env) -> str:
    return UNPLUGGED["why"]


def known_bits(ids: torch.Tensor) -> torch.Tensor:
    """The rows the fake writes: int16 [n, 256], value j of id i has bits (3 i + j) & 0x3FFF
    (finite, positive bf16: no NaN to canonicalize). Ids outside the table write too: the
    fake is not a gather, only a witness of what reached it."""
    return ((ids.reshape(-1, 1).long() * 3 + torch.arange(256)) & 0x3FFF).to(torch.int16)


def fake_launch(spec, table, ids, lo, hi, out, table_address) -> None:
    CALLS.append({"backend": spec.name, "ids": ids.clone(), "lo": lo, "hi": hi, "out": tuple(out.shape),
                  "table": table.data_ptr(), "table_address": table_address})
    out.view(torch.int16).copy_(known_bits(ids))


# The module as pytest imported it: the table names launchers by "module:function".
FAKE = Backend("fake", devices=("cpu",), preference=0, launch_path=f"{__name__}:fake_launch",
               rejection_path=f"{__name__}:fake_rejection")


@pytest.fixture
def fake(monkeypatch):
    """The fake in the table, preferred over every other backend (preference 0), and a fresh probe."""
    monkeypatch.delenv(probe.ENV_BACKEND, raising=False)
    monkeypatch.setitem(BACKEND_TABLE, FAKE.name, FAKE)
    CALLS.clear()
    UNPLUGGED["why"] = ""
    probe.reset()
    yield FAKE
    probe.reset()


# ------------------------------------------------------------------ the one table
def test_every_consumer_reads_the_table():
    order = tuple(sorted(BACKEND_TABLE, key=lambda name: BACKEND_TABLE[name].preference))
    assert probe.BACKENDS == backends.BACKENDS == backends.preference_order() == order
    assert native.LIB_NAMES == backends.native_libraries() == {
        b.name: b.native_lib for b in BACKEND_TABLE.values() if b.native_lib}
    for dev in (H200, MI300X, CPU):
        choice = choose(dev, EVERYTHING_BUILT)
        assert choice.backend == backends.native_backend(dev.kind) and not choice.degraded
        assert tuple(b for b, _ in choice.rejected) == tuple(b for b in order if b != choice.backend)
    for spec in BACKEND_TABLE.values():  # every launcher is one of gather's
        assert spec.launcher() is getattr(gather, spec.launch_path.rpartition(":")[2])
    with pytest.raises(BackendUnavailableError, match="unknown backend 'fast' \\(choose from "
                       + ", ".join(order) + " or auto\\)"):
        choose(CPU, EVERYTHING_BUILT, "fast")


def test_the_native_backend_missing_is_degraded():
    """Auto without the device's native library falls back, and says which library is missing."""
    for dev, native_name in ((H200, "cuda"), (MI300X, "hip"), (CPU, "cpu")):
        choice = choose(dev, NONE_BUILT)
        assert choice.degraded and choice.backend != native_name
        assert f"{BACKEND_TABLE[native_name].native_lib} not built" in dict(choice.rejected)[native_name]


def test_the_table_refuses_a_contradiction(monkeypatch):
    with pytest.raises(EngramError, match="are not among cuda, hip, cpu"):
        Backend("tpu", devices=("tpu",), preference=1, launch_path="m:f")
    with pytest.raises(EngramError, match="are not among"):
        Backend("nowhere", devices=(), preference=1, launch_path="m:f")
    monkeypatch.setitem(BACKEND_TABLE, "twin", Backend("twin", devices=("cpu",), preference=30, launch_path="m:f"))
    with pytest.raises(EngramError, match="share preference 30"):
        backends.preference_order()


# ------------------------------------------------------------------ a fake backend added to the table alone
def test_a_preferred_available_backend_is_chosen(fake, caplog):
    choice = choose(CPU, EVERYTHING_BUILT)
    assert choice.backend == "fake" and not choice.degraded  # the cpu library runs: nothing is missing
    assert dict(choice.rejected)["cpu"] == "lower priority"
    assert choice.rejected[0] == ("cuda", "needs an NVIDIA GPU, device is cpu")  # the order after the fake's
    # On a device it does not serve the table's devices reject it, with no call of its own.
    h200 = choose(H200, EVERYTHING_BUILT)
    assert h200.backend == "cuda" and dict(h200.rejected)["fake"] == "needs a CPU, device is cuda"
    # The real probe of this machine: chosen, one start-up line at INFO.
    caplog.set_level(logging.DEBUG, logger="engram_sglang.core.ops")
    real = select_backend("cpu")
    assert real.backend == "fake" and not real.degraded
    lines = [r for r in caplog.records if r.name == "engram_sglang.core.ops"]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert "backend fake, rejected: cuda: needs an NVIDIA GPU" in lines[0].getMessage()


def test_an_unavailable_backend_is_rejected_with_its_own_reason(fake, monkeypatch, caplog):
    UNPLUGGED["why"] = UNPLUGGED_WHY
    assert probe.rejection("fake", CPU, EVERYTHING_BUILT) == UNPLUGGED_WHY
    choice = choose(CPU, EVERYTHING_BUILT)
    assert choice.backend == "cpu" and not choice.degraded
    assert dict(choice.rejected)["fake"] == UNPLUGGED_WHY
    # Asked for explicitly (by a caller, by ENGRAM_BACKEND): it raises with the reason.
    with pytest.raises(BackendUnavailableError, match=f"backend fake was asked for but cannot run on .*: {UNPLUGGED_WHY}"):
        choose(CPU, EVERYTHING_BUILT, "fake")
    monkeypatch.setenv(probe.ENV_BACKEND, "fake")
    with pytest.raises(BackendUnavailableError, match=UNPLUGGED_WHY):
        select_backend("cpu")
    monkeypatch.delenv(probe.ENV_BACKEND)
    probe.reset()
    # Auto on this machine: the next backend runs, and the line names the fake's reason.
    caplog.set_level(logging.INFO, logger="engram_sglang.core.ops")
    assert select_backend("cpu").backend != "fake"
    assert f"fake: {UNPLUGGED_WHY}" in caplog.records[-1].getMessage()


def test_gather_dequant_launches_the_fake_bit_for_bit(fake, rng):
    table = torch.randint(0, 256, (40, ROW_BYTES), dtype=torch.uint8, generator=rng)
    ids = torch.randint(-3, 50, (6, 7), generator=rng, dtype=torch.int32)
    want = known_bits(ids)

    def bits(rows: torch.Tensor) -> torch.Tensor:
        return bf16_bits(rows).reshape(-1, 256)

    # Eager, asked for by name: the fake's rows, and what it was handed.
    got = gather_dequant(table, ids, row_range=(5, 45), backend="fake")
    assert got.shape == (6, 7, 256) and torch.equal(bits(got), want)
    (call,) = CALLS
    assert (call["backend"], call["lo"], call["hi"], call["out"], call["table"]) == (
        "fake", 5, 45, (42, 256), table.data_ptr())
    assert call["ids"].dtype == torch.int32 and torch.equal(call["ids"], ids.reshape(-1))
    # Negative control: another backend's rows differ, so the bits above are the fake's.
    assert not torch.equal(bits(gather_dequant(table, ids, row_range=(5, 45), backend="torch")), want)
    # Into a caller's buffer, and through the registered ops (what torch.compile and graphs run).
    out = torch.zeros((6, 7, 256), dtype=torch.bfloat16)
    assert gather_dequant(table, ids, out=out, backend="fake") is out and torch.equal(bits(out), want)
    flat = ids.reshape(-1).contiguous()
    assert torch.equal(bits(torch.ops.engram.gather_dequant(table, flat, 0, 40, "fake", None)), want)
    out.zero_()
    torch.ops.engram.gather_dequant_out(table, flat, out.view(-1, 256), 0, 40, "fake", 1234)
    assert torch.equal(bits(out), want) and CALLS[-1]["table_address"] == 1234
    # Auto: the probe prefers it, so the default call launches it too; no ids, no launch.
    calls = len(CALLS)
    assert torch.equal(bits(gather_dequant(table, ids)), want) and len(CALLS) == calls + 1
    gather_dequant(table, ids[:0], backend="fake")
    assert len(CALLS) == calls + 1


def test_without_the_fake_nothing_launches_it(rng):
    """The negative control of the fixture: the table alone decides; unpatched, "fake" is unknown."""
    table = torch.randint(0, 256, (4, ROW_BYTES), dtype=torch.uint8, generator=rng)
    with pytest.raises(BackendUnavailableError, match="unknown backend 'fake'"):
        gather_dequant(table, torch.tensor([1, 2]), backend="fake")
    with pytest.raises(BackendUnavailableError, match="unknown backend 'fake'"):
        gather._launch("fake", table, torch.tensor([1]), 0, 4, torch.empty((1, 256), dtype=torch.bfloat16))
