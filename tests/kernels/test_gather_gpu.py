"""gather_dequant on a real GPU (`make test-gpu`, the GPU CI image): every backend from device
memory and from registered host memory, bit for bit against the oracle, under CUDA-graph
capture and torch.compile. Skipped without a GPU; bench/gpu_check.py covers the same ground
(and bandwidth) on a lent machine without the package installed."""

from __future__ import annotations

import importlib
import mmap

import numpy as np
import pytest
import torch

from engram_sglang.core.ops import gather_dequant, probe
from engram_sglang.testing import DECODE_IDS
from tests.core.test_gather import bits_of, exhaustive_table, expected_bits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible")]
NATIVE = "hip" if torch.version.hip else "cuda"


@pytest.fixture(scope="module", autouse=True)
def compiled_triton():
    """The real Triton JIT (test_gather.py runs the interpreter for CPU tensors)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET", raising=False)
        import engram_sglang.core.ops.gather_triton as gt

        importlib.reload(gt)
        probe.reset()
        yield
    probe.reset()


@pytest.fixture(scope="module")
def tables():
    """The same rows on the device and in registered host memory (read over UVA)."""
    gen = torch.Generator().manual_seed(0)
    rows = exhaustive_table(extra_rows=100_000, gen=gen)
    # Page-aligned anonymous memory, as the host store registers.
    mem = mmap.mmap(-1, rows.numel(), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    host = torch.from_numpy(np.frombuffer(mem, dtype=np.uint8).reshape(rows.shape))
    host.copy_(rows)
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(host.data_ptr(), host.numel(), 2)  # mapped
    assert int(getattr(err, "value", err)) == 0, "cudaHostRegister failed"
    yield {"device": host.cuda(), "host": host}, host
    cudart.cudaHostUnregister(host.data_ptr())


def test_probe_picks_the_native_backend():
    choice = probe.select_backend(torch.device("cuda", torch.cuda.current_device()))
    assert choice.backend == NATIVE, choice.line()


@pytest.mark.parametrize("placement", ["device", "host"])
@pytest.mark.parametrize("backend", ["auto", NATIVE, "triton", "torch"])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_bit_exact(tables, placement, backend, id_dtype):
    placements, host = tables
    table = placements[placement]
    rows = host.shape[0]
    ids_cpu = torch.cat([torch.randperm(rows)[:20_000], torch.tensor([0, rows - 1, -1, rows])])
    ids = ids_cpu.to(id_dtype).cuda()
    out = gather_dequant(table, ids, backend=backend)
    assert out.is_cuda and out.shape == (ids.numel(), 256)
    assert torch.equal(bits_of(out.cpu()), expected_bits(host, ids_cpu, 0, rows))
    lo, hi = 1000, rows - 1000
    part = gather_dequant(table[lo:hi], ids, row_range=(lo, hi), backend=backend)
    assert torch.equal(bits_of(part.cpu()), expected_bits(host[lo:hi], ids_cpu, lo, hi))


@pytest.mark.parametrize("placement", ["device", "host"])
@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_cuda_graph_capture_and_replay(tables, placement, backend):
    placements, host = tables
    table, rows = placements[placement], host.shape[0]
    n = DECODE_IDS[0] * DECODE_IDS[1]
    ids = torch.randint(0, rows, (n,), device="cuda")
    out = torch.empty((n, 256), dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gather_dequant(table, ids, out=out, backend=backend)  # warm up (compile, load) outside
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gather_dequant(table, ids, out=out, backend=backend)
    for seed in (1, 2):
        ids.copy_(torch.randint(0, rows, (n,), generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(bits_of(out.cpu()), expected_bits(host, ids.cpu(), 0, rows))


def test_torch_compile_fullgraph(tables):
    placements, host = tables
    table, rows = placements["device"], host.shape[0]

    @torch.compile(fullgraph=True)
    def step(ids):
        return gather_dequant(table, ids).float().sum(-1)

    ids = torch.randint(0, rows, (8, 24), device="cuda")
    got = step(ids)
    want = gather_dequant(table, ids, backend="torch").float().sum(-1)
    assert torch.allclose(got, want, equal_nan=True)
