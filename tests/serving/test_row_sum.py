"""Row shards summed over TP ranks stay bit-exact where SGLang's all-reduce is lossy (ROCm's
quick all-reduce casts bf16 to fp16 or quantizes it; any float algorithm may): `EngramRuntime.rows`
sums their int32 view (serving/row_exchange.py `exact_sum_`) on every vendor, CUDA included. A
stand-in all-reduce of two ranks that rounds float inputs through fp16 and adds integers exactly
shows it on the CPU, for the GPU path (SGLang's `inplace_all_reduce`) and the CPU one (gloo)."""

from __future__ import annotations

import types

import pytest
import torch

sglang_distributed = pytest.importorskip("sglang.srt.distributed")
from sglang.srt.distributed import parallel_state  # noqa: E402

from engram_sglang.serving import row_exchange  # noqa: E402
from engram_sglang.serving import runtime as runtime_module  # noqa: E402
from engram_sglang.serving.runtime import EngramRuntime  # noqa: E402

T, C, W = 64, 2, 256


def _shards():
    """Full rows and rank 0's shard of them (rank 1 owns every other token; +0.0 elsewhere)."""
    g = torch.Generator().manual_seed(7)
    full = torch.randn(T, C, W, generator=g) * 3.1
    full[::3, :, ::5] *= 1e5  # beyond fp16's range (65504) and below its smallest subnormal:
    full[1::3, :, ::7] *= 1e-9  # bf16 holds both, an fp16 round trip does not
    full = full.to(torch.bfloat16)
    owner0 = (torch.arange(T) % 2 == 0)[:, None, None]
    return full, torch.where(owner0, full, torch.zeros((), dtype=torch.bfloat16)), \
        torch.where(owner0, torch.zeros((), dtype=torch.bfloat16), full)


class LossyAllReduce:
    """Two ranks' sum as quick all-reduce does it: a float input makes an fp16 round trip, an
    integer input is summed exactly. Records which entry point and dtype each call used."""

    def __init__(self, other: torch.Tensor):
        self.other, self.calls = other, []

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        other = self.other.view(t.dtype).reshape(t.shape)
        if t.is_floating_point():
            return (t.half() + other.half()).to(t.dtype)
        return t + other

    def outplace(self, t):
        self.calls.append(("sglang", t.dtype))
        return self._sum(t)

    def inplace(self, t, group_name):
        self.calls.append(("inplace", t.dtype))
        t.copy_(self._sum(t))

    def torch_all_reduce(self, t, group=None, op=None):
        self.calls.append(("torch", t.dtype))
        t.copy_(self._sum(t))


@pytest.fixture
def lossy(monkeypatch):
    full, mine, other = _shards()
    fake = LossyAllReduce(other)
    monkeypatch.setattr(sglang_distributed, "tensor_model_parallel_all_reduce", fake.outplace)
    monkeypatch.setattr(parallel_state, "inplace_all_reduce", fake.inplace)
    monkeypatch.setattr(torch.distributed, "all_reduce", fake.torch_all_reduce)
    monkeypatch.setattr(sglang_distributed, "get_tp_group",
                        lambda: types.SimpleNamespace(unique_name="tp:0", device_group="gloo"))
    return full, mine, fake


def _rows(mine: torch.Tensor):
    """`EngramRuntime.rows` of a TP-2 rank whose store returns `mine` (no step: ids given)."""
    store = types.SimpleNamespace(gather=lambda ids: mine.clone())
    rt = types.SimpleNamespace(layer_index={3: 0}, settings=types.SimpleNamespace(debug=()), stores={3: store},
                               cfg=types.SimpleNamespace(head_dim=W), device=torch.device("cpu"), reduce_rows=True,
                               _trace=None)
    return EngramRuntime.rows(rt, None, 3, torch.zeros(T, C, dtype=torch.int64))


@pytest.mark.parametrize("on_gpu", [True, False], ids=["gpu", "cpu"])
def test_rows_are_bit_exact_through_a_lossy_all_reduce(lossy, monkeypatch, on_gpu):
    full, mine, fake = lossy
    monkeypatch.setattr(row_exchange, "_on_gpu", lambda t: on_gpu)  # CUDA and HIP take the same path
    out = _rows(mine)
    assert out.dtype == torch.bfloat16 and out.shape == full.shape
    assert torch.equal(out.view(torch.int16), full.view(torch.int16))
    assert fake.calls == [("inplace" if on_gpu else "torch", torch.int32)]


def test_restoring_the_bf16_sum_breaks_the_rows(lossy, monkeypatch):
    """Negative control: CUDA's former path (SGLang's bf16 all-reduce) through the same stand-in
    changes the rows, so the test above shows something."""
    full, mine, fake = lossy
    monkeypatch.setattr(runtime_module, "exact_sum_", lambda rows: sglang_distributed.tensor_model_parallel_all_reduce(rows))
    out = _rows(mine)
    assert fake.calls == [("sglang", torch.bfloat16)]
    assert not torch.equal(out.view(torch.int16), full.view(torch.int16))


def test_rows_a_rank_does_not_own_are_positive_zero():
    """The exactness claim: a shard's rows for ids outside it are +0.0 (bits 0, never -0.0), and
    a row is an even number of bf16 values, so its int32 view covers every value exactly once."""
    from engram_sglang.core.ops.gather import gather_dequant_ref
    from engram_sglang.core.rowformat import ROW_BYTES, ROW_VALUES

    assert ROW_VALUES % 2 == 0
    table = torch.randint(0, 256, (4, ROW_BYTES), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    out = gather_dequant_ref(table, torch.tensor([0, 3, 8, 9, -1]), lo=4, hi=8)
    assert not out.view(torch.int16).any()


def test_agree_over_tp_all_reduces_a_cpu_tensor_under_a_device_context(monkeypatch):
    """SGLang opens the stores under torch.device("cuda"): the flag still goes to the gloo CPU
    group as a host tensor (a "meta" context stands in for "cuda" on a machine without one)."""
    from engram_sglang.serving.runtime import agree_over_tp

    seen = []

    def all_reduce(value, op=None, group=None):
        seen.append((value.device.type, group))
        value.fill_(0)  # another rank says no

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    monkeypatch.setattr(sglang_distributed, "get_tp_group", lambda: types.SimpleNamespace(cpu_group="gloo"))
    with torch.device("meta"):
        assert agree_over_tp(True) is False
    assert seen == [("cpu", "gloo")]
