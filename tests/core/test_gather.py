"""gather_dequant, bit for bit: torch reference vs Triton (interpreter) vs the host library,
and the GPU launchers' device form run thread by thread on the host (kernels/cpu's test hook).

The oracle here is independent of every backend: e4m3fn and e8m0 decoded by their
definitions in float64 (products are exact), rounded to bf16 by torch's converter, -0 -> +0.
Bits are compared as int16 with NaNs canonicalized: torch.equal is not a bit test.
"""

from __future__ import annotations

import functools
import importlib
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from engram_sglang import testing
from engram_sglang.core import rowformat
from engram_sglang.core.ops import BackendUnavailableError, gather_dequant, gather_dequant_ref, native, probe
from engram_sglang.testing import ROW_BYTES

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # Triton interpreter: inf

HOST_BACKENDS = ("torch", "triton", "cpu")
# kernels/cpu test hook paths (enum Decoder in kernels/cpu/engram_gather.cpp).
EMULATED = {"host-fnuz": 1, "device-soft": 2, "device-fnuz": 3}


# ------------------------------------------------------------------ oracle
@functools.lru_cache(maxsize=1)
def oracle_lut() -> torch.Tensor:
    """int16 bf16 bits [scale byte, fp8 byte] for all 65536 pairs, from the definitions: the
    one oracle, shared with the GPU check (engram_sglang/testing.py)."""
    return testing.oracle_lut(torch)


def expected_bits(table: torch.Tensor, ids: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    idx = ids.reshape(-1).long()
    live = (idx >= lo) & (idx < hi)
    if hi == lo:
        return torch.zeros((idx.numel(), 256), dtype=torch.int16)
    rows = table[(idx - lo).clamp(0, hi - lo - 1)]
    payload = rows[:, :256].long()
    scales = rows[:, 256:].long().repeat_interleave(32, dim=1)
    bits = oracle_lut()[scales, payload]
    bits[~live] = 0
    return bits


def bits_of(x: torch.Tensor) -> torch.Tensor:
    """int16 bit patterns, every NaN mapped to the canonical 0x7FC0, shape [n, 256]."""
    b = x.reshape(-1, 256).view(torch.int16).clone()
    b[torch.isnan(x.reshape(-1, 256))] = 0x7FC0
    return b


EXHAUSTIVE_ROWS = 512


def exhaustive_table(extra_rows: int = 0, gen: torch.Generator | None = None) -> torch.Tensor:
    """Row s (0..255) holds all 256 fp8 codes (rotated by s) under scale byte s in all 8
    blocks: every (code, scale) pair occurs. Rows 256 + s repeat row s with the subnormal
    codes (0x01-0x07, 0x81-0x87) zeroed, so that every other pair also occurs in blocks
    without subnormals (the host library's fastest path). Then `extra_rows` random rows."""
    s = torch.arange(256)
    t = torch.empty((EXHAUSTIVE_ROWS + extra_rows, ROW_BYTES), dtype=torch.uint8)
    t[:256, :256] = ((s[None, :] + s[:, None]) % 256).to(torch.uint8)
    t[:256, 256:] = s[:, None].to(torch.uint8)
    t[256:512] = t[:256]
    payload = t[256:512, :256]
    payload[((payload & 0x7F) >= 1) & ((payload & 0x7F) <= 7)] = 0
    if extra_rows:
        t[EXHAUSTIVE_ROWS:] = torch.randint(0, 256, (extra_rows, ROW_BYTES), dtype=torch.uint8, generator=gen)
    return t


def cpu_lib():
    lib, why = native.try_load("cpu")
    if lib is None:
        pytest.skip(f"host library unavailable: {why}")
    return lib


def run_emulated(table, ids, lo, hi, decoder: int) -> torch.Tensor:
    """The host library's test hook: another decode path over the same gather."""
    ids = ids.reshape(-1).contiguous()
    out = torch.empty((ids.numel(), 256), dtype=torch.bfloat16)
    rc = cpu_lib().lib.engram_cpu_gather_dequant_emulated(
        table.data_ptr(), ids.data_ptr(), ids.element_size(), ids.numel(), lo, hi, out.data_ptr(), 2, decoder)
    assert rc == 0
    return out


@pytest.fixture(scope="module", autouse=True)
def triton_interpreter():
    """Triton kernels run on CPU tensors under the interpreter. It is chosen when the kernel is
    decorated, so (re)load the Triton module with the flag set, and leave it as found."""
    pytest.importorskip("triton")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        mp.setenv("TRITON_CACHE_DIR", str(Path(__file__).resolve().parents[2] / "build" / "triton-cache"))
        import engram_sglang.core.ops.gather_triton as gt

        importlib.reload(gt)
        probe.reset()
        yield
    importlib.reload(gt)
    probe.reset()


def gather(backend: str, table, ids, **kw) -> torch.Tensor:
    if backend == "cpu":
        cpu_lib()
    return gather_dequant(table, ids, backend=backend, **kw)


# ------------------------------------------------------------------ the oracle itself
def test_oracle_matches_rowformat_reference():
    """Two independent readings of spec section 4 agree on all 65536 (code, scale) pairs."""
    t = exhaustive_table()
    ref = rowformat.dequantize(t)
    assert torch.equal(bits_of(ref), expected_bits(t, torch.arange(EXHAUSTIVE_ROWS), 0, EXHAUSTIVE_ROWS))


def test_oracle_edges():
    lut = oracle_lut()
    assert lut[127, 0x38] == 0x3F80  # 1.0 * 2^0
    assert lut[0, 0x80] == 0 and lut[127, 0x80] == 0  # -0 code -> +0
    assert lut[0, 0x08] == 0x0001  # 2^-6 * 2^-127 = 2^-133: the smallest bf16 denormal
    assert lut[0, 0x38] == 0x0040  # 2^-127 itself (an fp32 and bf16 denormal)
    assert lut[0, 0x01] == 0  # 2^-136 rounds to zero
    assert lut[0, 0x81] == 0  # ... and its negative to +0, not -0
    assert lut[254, 0x7E] == 0x7F80  # 448 * 2^127 overflows to +inf
    assert lut[255, 0x00] == 0x7FC0  # NaN scale poisons even zero
    assert lut[127, 0x7F] == 0x7FC0 and lut[127, 0xFF] == 0x7FC0


# ------------------------------------------------------------------ bit-exact backends
@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_all_codes_and_scales(backend, id_dtype, rng):
    t = exhaustive_table(extra_rows=300, gen=rng)
    ids = torch.randperm(t.shape[0], generator=rng).to(id_dtype)
    out = gather(backend, t, ids)
    assert out.dtype == torch.bfloat16 and out.shape == (t.shape[0], 256)
    assert torch.equal(bits_of(out), expected_bits(t, ids, 0, t.shape[0]))


@pytest.mark.parametrize("path", sorted(EMULATED))
def test_gpu_logic_on_the_host(path, rng):
    """The CUDA/HIP device form (gather_dequant_rows: chunking, unrolled rows, plain-scale
    shortcut) and gfx942's fnuz decode + fix-up, with only the conversion instruction
    replaced by its software twin, over every (code, scale) pair."""
    t = exhaustive_table(extra_rows=200, gen=rng)
    ids = torch.cat([torch.randperm(t.shape[0], generator=rng), torch.tensor([-1, t.shape[0], 5])])
    for dt in (torch.int32, torch.int64):
        out = run_emulated(t, ids.to(dt), 0, t.shape[0], EMULATED[path])
        assert torch.equal(bits_of(out), expected_bits(t, ids, 0, t.shape[0]))


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("n", [1, 7, 83, 1000, 4099])
def test_batch_sizes_first_and_last_rows(backend, n, rng):
    rows = 2000
    t = torch.randint(0, 256, (rows, ROW_BYTES), dtype=torch.uint8, generator=rng)
    ids = torch.randint(0, rows, (n,), generator=rng)
    ids[0] = 0
    ids[-1] = rows - 1
    out = gather(backend, t, ids)
    assert torch.equal(bits_of(out), expected_bits(t, ids, 0, rows))


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_ids_of_any_shape_and_out(backend, rng):
    t = exhaustive_table(extra_rows=50, gen=rng)
    ids = torch.randint(0, t.shape[0], (3, 5, 7), generator=rng, dtype=torch.int32)
    out = gather(backend, t, ids)
    assert out.shape == (3, 5, 7, 256)
    want = expected_bits(t, ids, 0, t.shape[0])
    assert torch.equal(bits_of(out), want)
    buf = torch.full((3, 5, 7, 256), float("nan"), dtype=torch.bfloat16)
    assert gather(backend, t, ids, out=buf) is buf
    assert torch.equal(bits_of(buf), want)
    # Non-contiguous ids and narrow integer dtypes are normalized by the wrapper.
    strided = ids.long().transpose(0, 2)
    assert torch.equal(bits_of(gather(backend, t, strided)), expected_bits(t, strided, 0, t.shape[0]))
    assert torch.equal(bits_of(gather(backend, t, ids.to(torch.int16))), want)


def test_large_host_output_in_huge_pages(rng):
    """A prefill-sized output (>= 32 MiB) is a fresh mapping every call (torch's allocator maps
    and unmaps it): the op asks for 2 MiB-aligned huge pages, 512x fewer page faults."""
    cpu_lib()
    t = exhaustive_table(extra_rows=50, gen=rng)
    ids = torch.randint(-1, t.shape[0] + 1, (2048, 33), generator=rng)  # 33 MiB of bf16
    out = gather_dequant(t, ids, backend="cpu")
    assert out.shape == (2048, 33, 256) and out.data_ptr() % (2 << 20) == 0
    assert torch.equal(bits_of(out), expected_bits(t, ids, 0, t.shape[0]))
    small = gather_dequant(t, ids[:100], backend="cpu")  # glibc recycles these: torch's allocator
    assert torch.equal(bits_of(small), bits_of(out[:100]))


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_row_range_zeros_and_shard_sum(backend, rng):
    """A shard holds global rows [lo, hi): other ids give +0 rows (all bits zero), so shard
    results summed over ranks reproduce the unsharded bits, -0 codes included."""
    rows = 600
    t = exhaustive_table(extra_rows=rows - EXHAUSTIVE_ROWS, gen=rng)
    ids = torch.cat([torch.randint(0, rows, (500,), generator=rng), torch.tensor([-3, -1, rows, rows + 7, 0, rows - 1])])
    full = gather(backend, t, ids)
    cuts = [0, 123, 256, 256, 471, rows]  # [256, 256) is an empty shard
    total = torch.zeros_like(full)
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        part = gather(backend, t[lo:hi], ids, row_range=(lo, hi))
        assert torch.equal(bits_of(part), expected_bits(t[lo:hi], ids, lo, hi))
        outside = (ids < lo) | (ids >= hi)
        assert (part[outside].view(torch.int16) == 0).all()  # +0, not -0
        total = total + part
    assert torch.equal(bits_of(total), bits_of(full))
    # Out-of-table ids read as zeros without a row_range too, and an empty shard is all zeros.
    assert (bits_of(full)[-4:-2] == 0).all()
    empty = gather(backend, t[:0], ids[:9], row_range=(10, 10))
    assert (empty.view(torch.int16) == 0).all()


HOST_PORTABLE = 5  # kernels/cpu's portable row decode (CPUs without AVX-512 VBMI)


def mixed_block_rows(n: int, gen: torch.Generator) -> torch.Tensor:
    """Rows whose 8 blocks each draw one of five kinds, so one row mixes the AVX-512 decode's
    fast pass with its per-block exact fallback, in every pairing of neighbours (the fast pass
    works on two blocks at once): 0 plain scale (10..246) and ordinary codes, 1 plain scale
    and fp8 subnormals (fast: exact in bf16), 2 plain scale with a zero or NaN code somewhere
    (fallback), 3 a scale byte outside 10..246 (fallback: denormal, overflow or NaN products),
    4 the plain range's edge bytes 10 and 246 (fast). Random codes at random positions."""
    kinds = torch.randint(0, 5, (n, 8), generator=gen)
    kinds[:16] = torch.tensor([[a, b] * 4 for a in range(4) for b in range(4)])  # every neighbour pair
    payload = torch.randint(0, 256, (n, 8, 32), dtype=torch.uint8, generator=gen)
    em = payload & 0x7F
    ordinary = (em >= 8) & (em <= 0x7E)
    payload = torch.where(ordinary | (kinds[..., None] == 3), payload, payload | 0x40)  # no zero/NaN yet
    payload[((payload & 0x7F) == 0x7F) & (kinds[..., None] != 3)] = 0x42
    sub = torch.randint(1, 8, (n, 8, 32), dtype=torch.uint8, generator=gen) | (payload & 0x80)
    pick = torch.rand((n, 8, 32), generator=gen) < 0.3
    payload = torch.where((kinds[..., None] == 1) & pick, sub, payload)
    special = torch.tensor([0x00, 0x80, 0x7F, 0xFF], dtype=torch.uint8)
    where = torch.randint(0, 32, (n, 8), generator=gen)
    what = special[torch.randint(0, 4, (n, 8), generator=gen)]
    rows_, blocks = torch.nonzero(kinds == 2, as_tuple=True)
    payload[rows_, blocks, where[rows_, blocks]] = what[rows_, blocks]
    scales = torch.randint(10, 247, (n, 8), dtype=torch.uint8, generator=gen)
    unsafe = torch.cat([torch.arange(0, 10), torch.arange(247, 256)]).to(torch.uint8)
    scales = torch.where(kinds == 3, unsafe[torch.randint(0, len(unsafe), (n, 8), generator=gen)], scales)
    edge = torch.tensor([10, 246], dtype=torch.uint8)[torch.randint(0, 2, (n, 8), generator=gen)]
    scales = torch.where(kinds == 4, edge, scales)
    return torch.cat([payload.reshape(n, 256), scales], dim=1).contiguous()


def test_host_decode_fast_and_fallback_blocks_in_one_row(rng):
    """The production host decode (AVX-512 where the CPU has VBMI: a fast pass per pair of
    blocks, the exact path for blocks it cannot take) and the portable decode, bit for bit
    against the oracle, on rows mixing both kinds of block."""
    lib = cpu_lib()
    t = mixed_block_rows(3000, rng)
    ids = torch.cat([torch.arange(t.shape[0]), torch.randint(0, t.shape[0], (2000,), generator=rng)])
    want = expected_bits(t, ids, 0, t.shape[0])
    out = torch.empty((ids.numel(), 256), dtype=torch.bfloat16)
    for threads in (1, 2):
        lib.gather(t.data_ptr(), ids.data_ptr(), 8, ids.numel(), 0, t.shape[0], out.data_ptr(), threads)
        assert torch.equal(bits_of(out), want), threads
    assert torch.equal(bits_of(run_emulated(t, ids, 0, t.shape[0], HOST_PORTABLE)), want)
    # Outputs of 32 MiB and more are written by non-temporal stores (kStreamBytes).
    big = torch.randint(-1, t.shape[0] + 1, (66_000,), generator=rng)
    out = torch.empty((big.numel(), 256), dtype=torch.bfloat16)
    assert out.data_ptr() % 64 == 0
    for threads in (1, 2):
        lib.gather(t.data_ptr(), big.data_ptr(), 8, big.numel(), 0, t.shape[0], out.data_ptr(), threads)
        assert torch.equal(bits_of(out), expected_bits(t, big, 0, t.shape[0])), threads
    # The exhaustive table through the portable decode too (production runs it in the tests above).
    ex = exhaustive_table()
    ex_ids = torch.arange(ex.shape[0]).int()
    assert torch.equal(bits_of(run_emulated(ex, ex_ids, 0, ex.shape[0], HOST_PORTABLE)),
                       expected_bits(ex, ex_ids, 0, ex.shape[0]))


def test_host_library_threads_agree(rng):
    lib = cpu_lib()
    t = exhaustive_table(extra_rows=1000, gen=rng)
    ids = torch.randint(0, t.shape[0], (10_000,), generator=rng)
    outs = []
    for threads in (1, 2, 5):
        out = torch.empty((ids.numel(), 256), dtype=torch.bfloat16)
        lib.gather(t.data_ptr(), ids.data_ptr(), 8, ids.numel(), 0, t.shape[0], out.data_ptr(), threads)
        outs.append(bits_of(out))
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert torch.equal(outs[0], expected_bits(t, ids, 0, t.shape[0]))
    # The pool's handoffs: calls back to back (its workers still spinning) and after they
    # have gone to sleep; a call that returned before a worker's last task would leave the
    # sentinel (0x1234) in some rows.
    out = torch.empty((ids.numel(), 256), dtype=torch.bfloat16)
    for call in range(60):
        n = (512, 640, 10_000)[call % 3]  # the pool's smallest call, a ragged one, a large one
        out.view(torch.int16).fill_(0x1234)
        lib.gather(t.data_ptr(), ids.data_ptr(), 8, n, 0, t.shape[0], out.data_ptr(), 2)
        assert torch.equal(bits_of(out[:n]), outs[0][:n]), f"call {call}, {n} rows"
        if call % 10 == 9:
            time.sleep(0.002)


def test_host_threads_for_call_size():
    """One thread below 512 rows (a worker woken for less work joins too late to pay), never
    more threads than 64-row tasks, all usable cores for 0."""
    lib = cpu_lib().lib
    threads_for = lib.engram_cpu_threads_for  # bound by ops/native.py
    assert [threads_for(n, 2) for n in (1, 128, 511, 512, 6144)] == [1, 1, 1, 2, 2]
    assert threads_for(512, 64) == 8 and threads_for(6144, 1) == 1
    assert threads_for(1 << 20, 0) == lib.engram_cpu_default_threads()


def test_reference_matches_oracle(rng):
    t = exhaustive_table(extra_rows=64, gen=rng)
    ids = torch.randint(-2, t.shape[0] + 2, (777,), generator=rng)
    assert torch.equal(bits_of(gather_dequant_ref(t, ids, 0, t.shape[0])), expected_bits(t, ids, 0, t.shape[0]))


# ------------------------------------------------------------------ the op boundary
def test_bad_arguments():
    t = torch.zeros((4, ROW_BYTES), dtype=torch.uint8)
    ids = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="uint8"):
        gather_dequant(t.view(torch.int8), ids)
    with pytest.raises(ValueError, match=r"\[R, 264\]"):
        gather_dequant(torch.zeros((4, 263), dtype=torch.uint8), ids)
    with pytest.raises(ValueError, match="contiguous"):
        gather_dequant(torch.zeros((4, 528), dtype=torch.uint8)[:, :264], ids)
    with pytest.raises(ValueError, match="aligned"):
        gather_dequant(torch.zeros(4 * ROW_BYTES + 1, dtype=torch.uint8)[1:].view(4, ROW_BYTES), ids)
    with pytest.raises(TypeError):
        gather_dequant(t, ids.float())
    with pytest.raises(ValueError, match="row_range"):
        gather_dequant(t, ids, row_range=(0, 5))
    with pytest.raises(ValueError, match="row_range"):
        gather_dequant(t, ids, row_range=(3, 2))
    with pytest.raises(ValueError, match="out must be"):
        gather_dequant(t, ids, out=torch.empty((2, 256), dtype=torch.float32))
    with pytest.raises(BackendUnavailableError, match="cuda"):
        gather_dequant(t, ids, backend="cuda")
    with pytest.raises(BackendUnavailableError, match="unknown backend"):
        gather_dequant(t, ids, backend="bogus")


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_opcheck(backend):
    if backend == "cpu":
        cpu_lib()
    t = exhaustive_table()
    # opcheck compares outputs with NaN != NaN: leave the NaN codes and the NaN scale out.
    payload, scales = t[:, :256], t[:, 256:]
    payload[(payload & 0x7F) == 0x7F] = 0x11
    scales[scales == 0xFF] = 0xFE
    ids = torch.tensor([0, 255, 7, 300, -1, 600], dtype=torch.int64)
    torch.library.opcheck(torch.ops.engram.gather_dequant.default, (t, ids, 0, len(t), backend))
    out = torch.empty((6, 256), dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.engram.gather_dequant_out.default, (t, ids.int(), out, 0, len(t), backend))


def test_eager_calls_launch_directly_where_nothing_watches_ops(rng, monkeypatch):
    """An eager call skips the registered op (its dispatcher costs ~20 us of Python a call, a
    sixth of a decode-shaped CPU gather) with the op's effects: same bits, out's version
    bumped. Under a dispatch mode (FakeTensorMode, a profiler's) the op is what runs."""
    cpu_lib()
    t = exhaustive_table(extra_rows=10, gen=rng)
    ids = torch.randint(-1, t.shape[0] + 1, (5, 24), generator=rng)
    want = expected_bits(t, ids, 0, t.shape[0])
    from engram_sglang.core.ops import gather as gather_mod

    def no_dispatch(*args, **kwargs):
        raise AssertionError("the eager call went through the dispatcher")

    out = torch.empty((5, 24, 256), dtype=torch.bfloat16)
    version = out._version
    with monkeypatch.context() as m:
        m.setattr(gather_mod, "_gather_dequant_op", no_dispatch)
        m.setattr(gather_mod, "_gather_dequant_out_op", no_dispatch)
        assert torch.equal(bits_of(gather_dequant(t, ids, backend="cpu")), want)
        assert gather_dequant(t, ids, out=out, backend="cpu") is out
    assert torch.equal(bits_of(out), want) and out._version > version

    from torch.utils._python_dispatch import TorchDispatchMode

    class Watch(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    out.zero_()
    with Watch() as watch:
        rows = gather_dequant(t, ids, backend="cpu")
        gather_dequant(t, ids, out=out, backend="cpu")
    assert {"engram.gather_dequant.default", "engram.gather_dequant_out.default"} <= set(watch.ops)
    assert torch.equal(bits_of(rows), want) and torch.equal(bits_of(out), want)


def test_torch_compile_sees_through(rng):
    """fullgraph: no graph break at the op (aot_eager keeps it quick on two cores)."""
    t = exhaustive_table(extra_rows=10, gen=rng)
    ids = torch.randint(0, t.shape[0], (4, 24), generator=rng)

    def step(table, ids, buf):
        rows = gather_dequant(table, ids, row_range=(0, table.shape[0]))
        gather_dequant(table, ids + 1, out=buf)
        return rows.float().sum(-1), buf

    buf = torch.empty((4, 24, 256), dtype=torch.bfloat16)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    s, b = compiled(t, ids, buf)
    assert torch.equal(bits_of(b), expected_bits(t, ids + 1, 0, t.shape[0]))
    assert torch.allclose(s, gather_dequant_ref(t, ids, 0, t.shape[0]).float().view(4, 24, 256).sum(-1),
                          equal_nan=True)


# ------------------------------------------------------------------ process-level cases
def _run_python(code: str, timeout: int = 120) -> str:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.slow
def test_table_over_2gib_read_at_its_high_end(tmp_path):
    """Rows past 2 GiB need 64-bit offsets everywhere. A sparse file mapped copy-on-write
    stands in for the table (only the pages read are touched); in a subprocess because a
    32-bit offset would fault, as it would on a GPU."""
    cpu_lib()
    code = f"""
        import os, numpy as np, torch
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["TRITON_CACHE_DIR"] = {str(Path(__file__).resolve().parents[2] / "build" / "triton-cache")!r}
        from tests.core.test_gather import expected_bits, bits_of, exhaustive_table
        from engram_sglang.core.ops import gather_dequant
        rows = (2**31 + 2**28) // 264  # ~2.25 GiB
        path = {str(tmp_path / "big.rows")!r}
        with open(path, "wb") as f:
            f.truncate(rows * 264)
        m = np.memmap(path, dtype=np.uint8, mode="c", shape=(rows, 264))
        t = torch.from_numpy(m)
        tail = exhaustive_table()
        t[rows - len(tail):] = tail
        ids = torch.tensor([rows - 1, rows - len(tail), rows - 100, 2**31 // 264 + 1, 0, rows, rows - 2])
        want = expected_bits(tail, ids - (rows - len(tail)), 0, len(tail))
        want[3:5] = 0  # sparse (zero) rows
        for backend in ("cpu", "triton", "torch"):
            for dt in (torch.int32, torch.int64):
                out = gather_dequant(t, ids.to(dt), backend=backend)
                assert torch.equal(bits_of(out), want), backend
            lo = rows - 300  # a shard whose local offsets are small but global ids are not
            out = gather_dequant(t[lo:], ids, row_range=(lo, rows), backend=backend)
            w = want.clone(); w[(ids < lo) | (ids >= rows)] = 0
            assert torch.equal(bits_of(out), w), backend
        print("ok")
    """
    assert "ok" in _run_python(code)


def test_denormal_scale_survives_fast_math_in_process(tmp_path):
    """Loading anything built with -ffast-math sets flush-to-zero for the process; the host
    library must still produce the 2^-127-scale denormals."""
    cpu_lib()
    src = tmp_path / "fm.c"
    src.write_text("float engram_test_fm(float a, float b) { return a * b; }\n")
    so = tmp_path / "libfm.so"
    try:
        subprocess.run(["gcc", "-shared", "-fPIC", "-ffast-math", "-o", str(so), str(src)], check=True,
                       capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"no gcc to build a fast-math library: {e}")
    code = f"""
        import ctypes, torch
        from tests.core.test_gather import expected_bits, bits_of, exhaustive_table
        from engram_sglang.core.ops import gather_dequant
        t = exhaustive_table()
        ids = torch.tensor([0, 1, 2, 3, 255, 256, 257, 511]).repeat(100)
        want = expected_bits(t, ids, 0, len(t))  # before FTZ: the oracle's own float math needs it off
        fm = ctypes.CDLL({str(so)!r})
        fm.engram_test_fm.restype = ctypes.c_float
        fm.engram_test_fm.argtypes = [ctypes.c_float, ctypes.c_float]
        assert fm.engram_test_fm(2.0**-100, 2.0**-30) == 0.0, "fast-math library did not set FTZ"
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = gather_dequant(t, ids, backend="cpu")
            assert (out.view(torch.int16) != 0).sum() > 0
            assert torch.equal(bits_of(out), want), threads
        print("ok")
    """
    assert "ok" in _run_python(code)


def test_host_library_after_fork():
    """A forked worker inherits the thread pool object but not its threads."""
    cpu_lib()
    code = """
        import os, torch
        from engram_sglang.core.ops import gather_dequant
        t = torch.randint(0, 256, (4096, 264), dtype=torch.uint8)
        ids = torch.randint(0, 4096, (20000,))
        torch.set_num_threads(2)
        a = gather_dequant(t, ids, backend="cpu")
        pid = os.fork()
        if pid == 0:
            b = gather_dequant(t, ids, backend="cpu")
            os._exit(0 if torch.equal(a.view(torch.int16), b.view(torch.int16)) else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        print("ok")
    """
    assert "ok" in _run_python(code, timeout=60)


def test_a_large_host_output_without_transparent_huge_pages_uses_plain_pages(monkeypatch):
    """madvise(MADV_HUGEPAGE) fails with EINVAL on a kernel built without THP: a prefill-sized
    CPU gather must still return its rows, not raise."""
    import errno
    import mmap as real_mmap
    import types

    from engram_sglang.core.ops import gather as gather_module

    class NoHugePages(real_mmap.mmap):
        def madvise(self, *args):
            raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(gather_module, "mmap", types.SimpleNamespace(
        mmap=NoHugePages, MADV_HUGEPAGE=real_mmap.MADV_HUGEPAGE, MAP_PRIVATE=real_mmap.MAP_PRIVATE,
        MAP_ANONYMOUS=real_mmap.MAP_ANONYMOUS))
    table = torch.randint(0, 256, (16, ROW_BYTES), dtype=torch.uint8)
    ids = torch.randint(0, 16, (2048, 33), dtype=torch.int64)  # 33 MiB of bf16 rows: past the threshold
    got = gather_module.gather_dequant(table, ids, backend="torch")
    want = rowformat.dequantize(table[ids.reshape(-1)]).view(2048, 33, 256)
    assert torch.equal(rowformat.bf16_bits(got), rowformat.bf16_bits(want))
