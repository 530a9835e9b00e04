"""What the checks of bench/gpu_check.py share: the table formula, the oracle, the worker's
context (device, sizes, tables, stores) and SGLang-style capture (`Replayer`).

Tables are written with the package's own writer from a formula (`row_bytes`): any row can be
recomputed on the CPU, so the oracle needs no copy of a 4 GiB table, and rows 2^32 bytes
apart differ (a 32-bit offset that wraps reads the wrong row, which shows).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engram_sglang.testing import PAYLOAD, ROW_BYTES, oracle_lut

ROOT = Path(__file__).resolve().parents[1]
BIG_LAYER = 1
SMALL_LAYERS = (1, 2)


class Skip(Exception):
    """The check cannot run here; the message says why (reported, not a failure)."""


# ------------------------------------------------------------------ table content and oracle
def row_bytes(torch, ids, seed: int):
    """Packed bytes uint8 [n, 264] of global rows `ids` (int64, any device): a 32-bit hash of
    (row, column, seed). Exact integer ops, so the GPU and the CPU compute the same bytes."""
    col = torch.arange(ROW_BYTES, device=ids.device, dtype=torch.int64)
    x = (ids.reshape(-1, 1) * 0x9E3779B1 + col * 0x7FEB352D + seed) & 0xFFFFFFFF  # < 2^58: no overflow
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & 0xFFFFFFFF
    x = x ^ (x >> 16)
    return (x & 0xFF).to(torch.uint8)


def layer_seed(tag: str, layer_id: int) -> int:
    return {"big": 0x1234, "small": 0x5678}[tag] + 7919 * layer_id


# ------------------------------------------------------------------ context
@dataclass
class Sizes:
    big_rows: int  # rows of the one-layer big table (GPU: past 2^32 bytes)
    small_rows: int  # rows per layer of the two-layer small table
    decode: int  # ids of a decode-sized call
    prefill: int  # ids of a prefill-sized call (0: none)
    disk_steps: int
    disk_ids: int
    drop_steps: int
    cache_bytes: int
    cache_ids: int
    cache_replays: int
    cache_batches: tuple  # batch sizes captured (tokens; 24 row ids each)


def sizes(gpu: bool, quick: bool) -> Sizes:
    if gpu:
        return Sizes(big_rows=2**32 // ROW_BYTES + (1 << 20), small_rows=1 << 20, decode=256 * 24,
                     prefill=0 if quick else 8192 * 24, disk_steps=1000, disk_ids=256, drop_steps=100 if quick else 200,
                     cache_bytes=32 << 20, cache_ids=4096, cache_replays=48,
                     cache_batches=(1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128))
    return Sizes(big_rows=12_000, small_rows=8_000, decode=96, prefill=0, disk_steps=60, disk_ids=32, drop_steps=20,
                 cache_bytes=2 << 20, cache_ids=128, cache_replays=32, cache_batches=(1, 2, 4, 8))


class Ctx:
    """One worker's state: the device, sizes, oracle, and what checks share (built lazily,
    kept while the worker lives: the HBM table, opened host stores)."""

    def __init__(self, *, gpu: bool, quick: bool, scratch: Path, out_dir: Path):
        import torch

        self.torch = torch
        self.gpu, self.quick, self.scratch, self.out_dir = gpu, quick, Path(scratch), Path(out_dir)
        self.floor_scale = 1.0  # gpu_check's --floor-scale
        if gpu:
            if not torch.cuda.is_available():
                raise RuntimeError("no GPU visible to torch (run with --dry-run for the CPU parts)")
            self.device = torch.device("cuda", torch.cuda.current_device())
            self.kind = "hip" if torch.version.hip else "cuda"
        else:
            self.device = torch.device("cpu")
            self.kind = "cpu"
        self.size = sizes(gpu, quick)
        self.lut = oracle_lut(torch)
        self._hbm = None
        self._host: dict[str, object] = {}
        self.oracle_memo: dict[tuple, object] = {}
        self._closers: list[Callable[[], None]] = []

    # the tables ------------------------------------------------------------
    def config(self, tag: str):
        from engram_sglang.core.config import EngramConfig

        # One column per layer (2-grams, one head): a layer's rows are the first prime >= vocab_size.
        rows, layers = (self.size.big_rows, (BIG_LAYER,)) if tag == "big" else (self.size.small_rows, SMALL_LAYERS)
        return EngramConfig(layer_ids=layers, max_ngram_size=2, n_heads=1, head_dim=PAYLOAD, vocab_size=rows,
                            compressed_vocab_size=1000, pad_token_id=0, source=f"gpu_check {tag} table")

    def table_dir(self, tag: str) -> Path:
        return self.scratch / f"table-{tag}"

    def rows(self, tag: str, layer_id: int) -> int:
        from engram_sglang.core.hashing import EngramLayout

        return EngramLayout(self.config(tag)).rows(layer_id)

    def opened(self, tag: str) -> Path:
        """The table directory, checked (written by the `tables` check)."""
        from engram_sglang.core.tablefile import open_tables

        path = self.table_dir(tag)
        try:
            open_tables(path, self.config(tag))
        except Exception as e:  # noqa: BLE001
            raise RuntimeError(f"no {tag} table ({e}): the tables check did not finish") from None
        return path

    def expect(self, ids, lo: int, hi: int, seed: int):
        """Oracle bits [n, 256] of global ids against a table holding rows [lo, hi)."""
        torch = self.torch
        idx = ids.reshape(-1).cpu().long()
        out = torch.empty((idx.numel(), PAYLOAD), dtype=torch.int16)
        for a in range(0, idx.numel(), 1 << 16):  # bounded temporaries on big id sets
            part = idx[a:a + (1 << 16)]
            live = (part >= lo) & (part < hi)
            rows = row_bytes(torch, torch.where(live, part, 0), seed)
            bits = self.lut[rows[:, PAYLOAD:].long().repeat_interleave(32, dim=1), rows[:, :PAYLOAD].long()]
            bits[~live] = 0
            out[a:a + part.numel()] = bits
        return out

    def hbm(self):
        """The big table's layer in device memory (RAM under --dry-run), built from the formula
        (not from the file: an independent path to the same bytes)."""
        if self._hbm is None:
            torch = self.torch
            n = self.rows("big", BIG_LAYER)
            t = torch.empty((n, ROW_BYTES), dtype=torch.uint8, device=self.device)
            step = 1 << 20
            for a in range(0, n, step):
                ids = torch.arange(a, min(n, a + step), device=self.device)
                t[a:a + ids.numel()] = row_bytes(torch, ids, layer_seed("big", BIG_LAYER))
            self._hbm = t
        return self._hbm

    def host_store(self, backend: str):
        """The big table's layer through HostStore (registered with the GPU by the store), one
        store per backend actually run ("auto" shares the store of the backend it resolves to)."""
        from engram_sglang.core.ops import probe

        if backend == "auto":
            backend = probe.select_backend(self.device).backend
        if backend not in self._host:
            from engram_sglang.core.stores import open_store

            stores = open_store(self.opened("big"), "host", device=self.device, backend=backend)
            self._closers.append(lambda s=stores: [x.close() for x in s.values()])
            self._host[backend] = stores[BIG_LAYER]
        return self._host[backend]

    def backends(self) -> list[str]:
        """Backends every correctness check runs: the native library, Triton, the probe's choice."""
        return [self.kind, "triton", "auto"]

    def id_sets(self, rows: int, gen_seed: int, out_of_range: bool) -> dict:
        """label -> int64 CPU ids: one id, edges (the 2^31 / 2^32 byte offsets, the last rows),
        the tail past 4 GiB, decode- and prefill-sized random sets."""
        torch = self.torch
        gen = torch.Generator().manual_seed(gen_seed)
        edges = [0, 1, 255, rows // 2, rows - 256, rows - 2, rows - 1]
        for limit in (2**31, 2**32):
            first = -(-limit // ROW_BYTES)  # the first row at or past this byte offset
            edges += [r for r in (first - 2, first - 1, first, first + 1) if 0 <= r < rows]
        sets = {"1": torch.randint(0, rows, (1,), generator=gen), "edges": torch.tensor(edges)}
        if rows * ROW_BYTES > 2**32:
            first = 2**32 // ROW_BYTES + 1
            sets["past 4 GiB"] = torch.randint(first, rows, (4096,), generator=gen)
        else:
            sets["tail"] = torch.randint(rows - min(rows, 4096), rows, (min(rows, 256),), generator=gen)
        sets["decode"] = torch.randint(0, rows, (self.size.decode,), generator=gen)
        if self.size.prefill:
            sets["prefill"] = torch.randint(0, rows, (self.size.prefill,), generator=gen)
        if out_of_range:  # read as +0 rows, never out of bounds
            sets["outside"] = torch.tensor([-1, rows, rows + 7, -(2**31), 2**31 - 1])
        return sets

    def ids_on_device(self, ids, dtype):
        return ids.to(dtype).to(self.device)

    def synchronize(self) -> None:
        if self.gpu:
            self.torch.cuda.synchronize()

    def healthy(self) -> bool:
        """After a failure: can this process still run a kernel? (An illegal address poisons it.)"""
        try:
            t = self.torch.ones(4, device=self.device)
            return float((t + 1).sum().item()) == 8.0
        except Exception:  # noqa: BLE001
            return False

    def close(self) -> None:
        for c in reversed(self._closers):
            try:
                c()
            except Exception:  # noqa: BLE001 - closing at exit; the checks already reported
                pass
        self._closers.clear()


class Replayer:
    """SGLang-style capture: eager warm-up calls on a side stream, one capture, replays.
    Under --dry-run every replay is an eager call (the same code path minus the capture)."""

    def __init__(self, ctx: Ctx, fn, warmup: int = 2, pool=None, stream=None):
        torch = ctx.torch
        self.ctx, self.fn = ctx, fn
        if not ctx.gpu:
            for _ in range(warmup):
                fn()
            self.result = fn()
            return
        s = stream or torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool, stream=s):
            self.result = fn()
        torch.cuda.synchronize()

    def replay(self):
        if self.ctx.gpu:
            self.graph.replay()
        else:
            self.result = self.fn()
        return self.result


def side_stream(ctx: Ctx):
    """A non-default stream to run on (SGLang's forward stream is one), or a null context on the CPU."""
    import contextlib

    if not ctx.gpu:
        return contextlib.nullcontext()
    s = ctx.torch.cuda.Stream()
    s.wait_stream(ctx.torch.cuda.current_stream())
    return ctx.torch.cuda.stream(s)


def delay(ctx: Ctx) -> None:
    """Keep the current stream busy ~100 us, so work that does not wait for it reads stale data."""
    if ctx.gpu:
        sleep = getattr(ctx.torch.cuda, "_sleep", None)
        if sleep is not None:
            sleep(200_000)
        else:
            a = ctx.torch.ones((2048, 2048), device=ctx.device)
            a @ a
