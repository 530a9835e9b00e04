"""The checks of bench/gpu_check.py: what only a GPU can show, each with a CPU part.

Every check is one function of a `Ctx` (gpu_check_ctx.py: the device, the table directories,
the oracle). On a GPU it runs the real thing; under `--dry-run` (ctx.gpu False) the same
function runs on the CPU with small sizes: the oracle, the table writer, the stores with
device="cpu", the Triton kernel in the interpreter, graph capture replaced by eager calls
(`Replayer`). What the CPU cannot show (capture, streams, registered host memory, offsets past
4 GiB) is what the GPU run adds.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from bench.gpu_check_ctx import (
    BIG_LAYER,
    ROOT,
    SMALL_LAYERS,
    Ctx,
    Replayer,
    Skip,
    delay,
    layer_seed,
    row_bytes,
    side_stream,
)
from engram_sglang.testing import PAYLOAD, ROW_BYTES, check_bits
from engram_sglang.testing import raw_bits as bits_of

LINES_PER_ROW = 5  # a 264-byte row at an 8-byte aligned offset touches five 64-byte lines


# ------------------------------------------------------------------ checks
def check_device(ctx: Ctx):
    """The native library loads and runs on this device; the probe picks it."""
    from engram_sglang.core.ops import native, probe

    torch = ctx.torch
    info = {"torch": torch.__version__, "python": sys.version.split()[0], "kind": ctx.kind}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        info["triton"] = f"does not import: {e}"
    lib, why = native.try_load(ctx.kind)
    if lib is None:
        raise RuntimeError(f"the native {ctx.kind} library does not load: {why}")
    info["native"] = f"{lib.path.name} ({' '.join(lib.targets) or 'host'})"
    if ctx.gpu:
        props = torch.cuda.get_device_properties(ctx.device)
        info["device"] = props.name
        info["arch"] = getattr(props, "gcnArchName", "") or f"sm_{props.major}{props.minor}"
        code = native.check_device(lib, ctx.device.index)
        if code != 0:
            raise RuntimeError(f"the native library cannot run on this GPU ({info['arch']}): "
                               f"{lib.path.name}: {lib.error_string(code)} (code {code})")
    else:
        for other in ("cuda", "hip"):  # load-only here: no device to check against
            olib, owhy = native.try_load(other)
            info[f"{other}_library"] = f"loads, targets {' '.join(olib.targets)}" if olib else owhy
    choice = probe.select_backend(ctx.device)
    info["probe"] = choice.line()
    info["device_info"] = choice.device.describe()
    if choice.backend != ctx.kind:
        raise RuntimeError(f"the probe chose {choice.backend}, not the native {ctx.kind} backend: {choice.line()}")
    where = f"{info['device']} ({info['arch']})" if ctx.gpu else "CPU"
    return f"{where}: {info['native']} runs; probe: {choice.backend}", info


def check_tables(ctx: Ctx):
    """Write the big (one layer) and small (two layers) tables with the package's writer."""
    from engram_sglang.core.hashing import EngramLayout
    from engram_sglang.core.tablefile import open_tables, write_tables

    torch = ctx.torch
    made = []
    for tag in ("big", "small"):
        cfg = ctx.config(tag)
        layout = EngramLayout(cfg)
        root = ctx.table_dir(tag)
        t0 = time.perf_counter()

        def chunks(layer_id, n, tag=tag):
            step = 1 << 20 if ctx.gpu else 1 << 14
            for a in range(0, n, step):
                ids = torch.arange(a, min(n, a + step), device=ctx.device)
                yield row_bytes(torch, ids, layer_seed(tag, layer_id)).cpu().numpy()

        write_tables(root, cfg, {L: chunks(L, layout.rows(L)) for L in cfg.layer_ids}, progress=False)
        tables = open_tables(root, cfg)
        # The file holds the formula's bytes (so a later mismatch is the read path's).
        for L in cfg.layer_ids:
            n = layout.rows(L)
            probe_ids = torch.cat([torch.randint(0, n, (512,)), torch.arange(max(0, n - 64), n)])
            got = torch.from_numpy(np.ascontiguousarray(tables[L][probe_ids.numpy()]))
            if not torch.equal(got, row_bytes(torch, probe_ids, layer_seed(tag, L))):
                raise AssertionError(f"{root}: layer {L} does not hold the rows written")
        gib = layout.table_bytes(ROW_BYTES) / 2**30
        made.append(f"{tag} {gib:.2f} GiB ({'+'.join(str(layout.rows(L)) for L in cfg.layer_ids)} rows) in "
                    f"{time.perf_counter() - t0:.0f} s")
    return "; ".join(made)


def _correct(ctx: Ctx, gather, rows: int, seed: int, out_of_range: bool, lo: int = 0, hi: int | None = None) -> str:
    """Every id set, int32 and int64 ids, against the oracle; `gather(ids, out)` returns rows."""
    torch = ctx.torch
    hi = rows if hi is None else hi
    n = 0
    for label, ids in ctx.id_sets(rows, 1, out_of_range).items():
        key = (label, rows, lo, hi, seed)  # the same sets serve every backend: compute the oracle once
        if key not in ctx.oracle_memo:
            ctx.oracle_memo[key] = ctx.expect(ids, lo, hi, seed)
        want = ctx.oracle_memo[key]
        for dt in (torch.int32, torch.int64):
            if dt == torch.int32 and (ids.min() < -(2**31) or ids.max() >= 2**31):
                continue
            d_ids = ctx.ids_on_device(ids, dt)
            # int64 ids: into the caller's buffer (NaN-filled: unwritten rows show); int32: allocated.
            out = None
            if dt == torch.int64:
                out = torch.full((ids.numel(), PAYLOAD), float("nan"), dtype=torch.bfloat16, device=ctx.device)
            got = gather(d_ids, out)
            ctx.synchronize()
            check_bits(torch, got, want, ids, f"{label} ({str(dt).removeprefix('torch.')} ids)")
            n += 1
    return f"{n} id sets bit-exact"


def check_hbm(ctx: Ctx, backend: str):
    """The op with `backend` from a device-memory table (past 4 GiB on a GPU) and from a shard of it."""
    from engram_sglang.core.ops import gather_dequant, probe

    if backend == "triton":
        _triton_runs(ctx, probe)
    table = ctx.hbm()
    rows, seed = table.shape[0], layer_seed("big", BIG_LAYER)
    done = _correct(ctx, lambda ids, out: gather_dequant(table, ids, out=out, backend=backend), rows, seed, True)
    # A shard: global rows [lo, hi) held by a slice; other ids are +0 rows.
    lo, hi = rows - rows // 3, rows - 10
    shard = table[lo:hi]
    _correct(ctx, lambda ids, out: gather_dequant(shard, ids, out=out, row_range=(lo, hi), backend=backend),
             rows, seed, True, lo, hi)
    return f"{done} from a {table.numel() / 2**30:.2f} GiB table, and from a shard"


def _triton_runs(ctx: Ctx, probe) -> None:
    why = probe.rejection("triton", probe.read_device(ctx.device), probe.current_environment(ctx.kind))
    if why:
        raise Skip(f"Triton cannot run here: {why}")


def check_host(ctx: Ctx, backend: str):
    """HostStore (placement host, registered by the store) with `backend`: store.gather."""
    from engram_sglang.core.ops import probe

    if backend == "triton":
        _triton_runs(ctx, probe)
    store = ctx.host_store(backend)
    if store.backend != (ctx.kind if backend == "auto" else backend):
        raise AssertionError(f"the store runs backend {store.backend}, asked for {backend}")
    done = _correct(ctx, lambda ids, out: store.gather(ids, out=out), store.rows, layer_seed("big", BIG_LAYER), False)
    return f"{done}; {store.describe()}"


def check_host_shard(ctx: Ctx):
    """HostStore of rank 1 of 2 (it registers its half): its rows, +0 rows for the other half."""
    from engram_sglang.core.stores import open_store

    stores = open_store(ctx.opened("big"), "host", device=ctx.device, tp_rank=1, tp_size=2)
    try:
        store = stores[BIG_LAYER]
        lo, hi = store.row_range
        done = _correct(ctx, lambda ids, out: store.gather(ids, out=out), store.rows, layer_seed("big", BIG_LAYER),
                        False, lo, hi)
        return f"{done}; rows {lo}..{hi - 1} of {store.rows}"
    finally:
        for s in stores.values():
            s.close()


def check_graphs(ctx: Ctx):
    """Each backend's gather captured once (after eager warm-up on a side stream), replayed on new ids,
    from the HBM table and through HostStore."""
    from engram_sglang.core.ops import gather_dequant, probe

    torch = ctx.torch
    backends = list(ctx.backends())
    skipped = []
    try:
        _triton_runs(ctx, probe)
    except Skip as e:
        backends.remove("triton")
        skipped.append(str(e))
    n = 0
    seed = layer_seed("big", BIG_LAYER)
    for backend in backends:
        for where in ("hbm", "host"):
            if where == "hbm":
                table = ctx.hbm()
                rows = table.shape[0]
                fn = lambda ids, out, t=table, b=backend: gather_dequant(t, ids, out=out, backend=b)  # noqa: E731
            else:
                store = ctx.host_store(backend)
                rows = store.rows
                fn = lambda ids, out, s=store: s.gather(ids, out=out)  # noqa: E731
            ids = torch.zeros(ctx.size.decode, dtype=torch.int64, device=ctx.device)
            out = torch.empty((ctx.size.decode, PAYLOAD), dtype=torch.bfloat16, device=ctx.device)
            rep = Replayer(ctx, lambda: fn(ids, out))
            gen = torch.Generator().manual_seed(2)
            for k in range(3):
                new = torch.randint(0, rows, (ctx.size.decode,), generator=gen)
                ids.copy_(new)
                rep.replay()
                ctx.synchronize()
                check_bits(torch, out, ctx.expect(new, 0, rows, seed), new, f"{backend} from {where}, replay {k}")
                n += 1
    return f"{n} replays bit-exact ({', '.join(backends)}; hbm and host)" + (f"; {skipped[0]}" if skipped else "")


def _cache(ctx: Ctx):
    from engram_sglang.core.stores import open_store

    stores = open_store(ctx.opened("small"), "host", device=ctx.device, cache_bytes=ctx.size.cache_bytes)
    return stores, stores[SMALL_LAYERS[0]]


def _skewed(ctx: Ctx, gen, rows: int, n: int, hot: int):
    """90% of ids from a hot set of `hot` rows (spread over the table), 10% uniform."""
    torch = ctx.torch
    hot_ids = (torch.arange(hot, dtype=torch.int64) * 7919 + 13) % rows
    pick = hot_ids[torch.randint(0, hot, (n,), generator=gen)]
    cold = torch.randint(0, rows, (n,), generator=gen)
    return torch.where(torch.rand(n, generator=gen) < 0.9, pick, cold)


def check_cache_capture(ctx: Ctx):
    """HotRowCache (store defaults) captured as SGLang does: per batch size two eager warm-up calls
    and a capture on the capture stream, one memory pool; then every graph replayed on new ids,
    the between-steps maintenance after each: bit-exact."""
    torch = ctx.torch
    stores, cache = _cache(ctx)
    try:
        seed, rows = layer_seed("small", SMALL_LAYERS[0]), cache.rows
        pool = torch.cuda.graph_pool_handle() if ctx.gpu else None
        stream = torch.cuda.Stream() if ctx.gpu else None
        graphs = []
        for bs in ctx.size.cache_batches:
            ids = torch.zeros(bs * 24, dtype=torch.int64, device=ctx.device)
            graphs.append((ids, Replayer(ctx, lambda ids=ids: cache.gather(ids), pool=pool, stream=stream)))
        gen = torch.Generator().manual_seed(3)
        for rnd in range(3):
            for ids, rep in graphs:
                new = _skewed(ctx, gen, rows, ids.numel(), 512)
                ids.copy_(new)
                got = rep.replay()
                ctx.synchronize()
                check_bits(torch, got, ctx.expect(new, 0, rows, seed), new, f"batch {ids.numel() // 24}, round {rnd}")
                _between_steps(cache)
        return f"{len(graphs)} batch sizes captured, 3 rounds of replays bit-exact; {cache.describe()}"
    finally:
        for s in stores.values():
            s.close()


def _between_steps(cache):
    """What the serving layer runs after every forward step (outside any graph): the stores'
    maintenance entry where this tree has it, else the cache's own maintain()."""
    try:
        from engram_sglang.core.stores import maintenance
    except ImportError:
        maintenance = None
    if maintenance is not None and hasattr(maintenance, "between_steps"):
        maintenance.between_steps()
        return "maintenance.between_steps() after every step"
    cache.maintain()
    return "HotRowCache.maintain() after every step"


def check_cache_replay(ctx: Ctx):
    """One captured cache gather replayed with new skewed ids, the between-steps maintenance
    after every replay: the hit rate rises, replays are counted by the device counters, rows
    bit-exact vs the oracle and vs the store below."""
    torch = ctx.torch
    stores, cache = _cache(ctx)
    try:
        seed, rows, d = layer_seed("small", SMALL_LAYERS[0]), cache.rows, cache.directory
        n = ctx.size.cache_ids
        hot = max(16, min(d.slots // 2, n))
        ids = torch.zeros(n, dtype=torch.int64, device=ctx.device)
        rep = Replayer(ctx, lambda: cache.gather(ids))
        gen = torch.Generator().manual_seed(4)
        lookups0, maint0, rates, how = d.lookups, d.maintenances, [], ""
        for k in range(ctx.size.cache_replays):
            new = _skewed(ctx, gen, rows, n, hot)
            ids.copy_(new)
            hits0, reads0 = d.hits, d.reads
            got = rep.replay()
            ctx.synchronize()
            rates.append((d.hits - hits0) / max(1, d.reads - reads0))
            check_bits(torch, got, ctx.expect(new, 0, rows, seed), new, f"replay {k}")
            inner = cache.inner.gather(ids)
            ctx.synchronize()
            if not torch.equal(bits_of(torch, got), bits_of(torch, inner)):
                raise AssertionError(f"replay {k}: rows differ from the store below")
            how = _between_steps(cache)
        replays, maintained = d.lookups - lookups0, d.maintenances - maint0
        if replays != ctx.size.cache_replays:
            raise AssertionError(f"{ctx.size.cache_replays} replays, but the directory counted {replays} lookups")
        first, last = rates[0], sum(rates[-8:]) / len(rates[-8:])
        shown = f"first replay {first:.2f}, mean of the last 8 {last:.2f}"
        if not (first < 0.2 and last > 0.6):
            raise AssertionError(f"the hit rate does not rise: {shown} ({maintained} maintenances)")
        if maintained < 1:
            raise AssertionError(f"no maintenance ran in {replays} steps ({how})")
        return f"hit rate {shown}; {maintained} maintenances ({how}), {d.admitted} rows admitted"
    finally:
        for s in stores.values():
            s.close()


def check_disk_prefetch(ctx: Ctx):
    """Disk placement on a GPU: ids made by a kernel on a side stream (after ~100 us of other work
    there), prefetch issued and waited on that stream, rows copied on it; fresh ids every step."""
    from engram_sglang.core.stores import open_store

    torch = ctx.torch
    stores = open_store(ctx.opened("small"), "disk", device=ctx.device)
    try:
        store = stores[SMALL_LAYERS[0]]
        rows, seed = store.rows, layer_seed("small", SMALL_LAYERS[0])
        steps, n = ctx.size.disk_steps, ctx.size.disk_ids
        base = torch.randint(0, rows, (n,), generator=torch.Generator().manual_seed(5))
        d_base = base.to(ctx.device)
        ids = torch.empty(n, dtype=torch.int64, device=ctx.device)
        results = torch.empty((steps, n, PAYLOAD), dtype=torch.bfloat16, device=ctx.device)
        with side_stream(ctx):
            for step in range(steps):
                delay(ctx)
                torch.remainder(d_base * 7919 + step * 104729, rows, out=ids)  # this step's ids, made here
                handle = store.prefetch(ids)
                results[step].copy_(handle.wait())
        ctx.synchronize()
        all_ids = torch.remainder(base.view(1, -1) * 7919 + torch.arange(steps).view(-1, 1) * 104729, rows)
        check_bits(torch, results, ctx.expect(all_ids, 0, rows, seed), all_ids, f"{steps} steps")
        return f"{steps} steps x {n} ids bit-exact; {store.describe()}"
    finally:
        for s in stores.values():
            s.close()


def check_dropped_handles(ctx: Ctx):
    """Each step a consumed prefetch and a dropped one (released, never waited on), on a side
    stream, host and disk placements; a same-sized canary allocated after each drop must stay
    intact and the consumed rows bit-exact (no allocator reuse while the dropped gather runs)."""
    from engram_sglang.core.stores import Prefetch, open_store

    torch = ctx.torch
    has_release = hasattr(Prefetch, "release")
    if ctx.gpu and not has_release:
        raise AssertionError("Prefetch has no release(): a dropped handle cannot be ordered")
    notes = []
    for placement, layer in (("host", SMALL_LAYERS[0]), ("disk", SMALL_LAYERS[1])):
        stores = open_store(ctx.opened("small"), placement, device=ctx.device)
        try:
            store = stores[layer]
            rows, seed = store.rows, layer_seed("small", layer)
            steps, n = ctx.size.drop_steps, ctx.size.disk_ids
            gen = torch.Generator().manual_seed(6)
            kept = torch.randint(0, rows, (steps, n), generator=gen)
            dropped = torch.randint(0, rows, (steps, n), generator=gen)
            results = torch.empty((steps, n, PAYLOAD), dtype=torch.bfloat16, device=ctx.device)
            canaries = torch.empty_like(results)
            with side_stream(ctx):
                for step in range(steps):
                    h_keep = store.prefetch(ctx.ids_on_device(kept[step], torch.int64))
                    h_drop = store.prefetch(ctx.ids_on_device(dropped[step], torch.int64))
                    if has_release:
                        h_drop.release()
                    del h_drop
                    canary = torch.full((n, PAYLOAD), 7.0, dtype=torch.bfloat16, device=ctx.device)
                    results[step].copy_(h_keep.wait())
                    canaries[step].copy_(canary)
                    del canary
            ctx.synchronize()
            check_bits(torch, results, ctx.expect(kept, 0, rows, seed), kept, f"{placement}: kept handles")
            if not bool((canaries == 7.0).all()):
                raise AssertionError(f"{placement}: memory allocated after a dropped handle was overwritten")
            # The store still serves exactly after all that.
            last = dropped[-1]
            check_bits(torch, store.gather(ctx.ids_on_device(last, torch.int64)), ctx.expect(last, 0, rows, seed),
                       last, f"{placement}: gather after the drops")
            notes.append(f"{placement} {steps} steps")
        finally:
            for s in stores.values():
                s.close()
    how = "released" if has_release else "dropped without release() (Prefetch has none in this tree)"
    return f"{', '.join(notes)}: kept rows bit-exact, canaries intact; dropped handles {how}"


def check_compile(ctx: Ctx):
    """torch.compile(fullgraph=True) traces through the op (its fake implementation) and runs."""
    from engram_sglang.core.ops import gather_dequant

    torch = ctx.torch
    if not ctx.gpu:
        raise Skip("torch.compile runs on the GPU only here (a C++ toolchain for the CPU is not assumed)")
    if ctx.quick:
        raise Skip("not under --quick (compilation takes tens of seconds)")
    table = ctx.hbm()
    rows = table.shape[0]

    @torch.compile(fullgraph=True)
    def step(ids):
        return gather_dequant(table, ids)

    ids = torch.randint(0, rows, (8, 24), generator=torch.Generator().manual_seed(8))
    got = step(ids.to(ctx.device))
    ctx.synchronize()
    check_bits(torch, got, ctx.expect(ids, 0, rows, layer_seed("big", BIG_LAYER)), ids, "compiled")
    return "fullgraph compile bit-exact"


def check_decode_step(ctx: Ctx, timeout: float):
    """bench/decode_step.py (model-shaped decode steps, device vs host vs disk tables, bit check of
    every placement's Engram outputs) with --graphs on a GPU (disk: rows staged before each replay),
    tiny under --dry-run; a subprocess."""
    import json

    # --disk: the disk placement eager and, on a GPU, captured with its rows staged before each
    # replay (--engram-disk-graphs), beside host: the one run that decides whether it pays.
    args = ["--out", str(ctx.out_dir), "--table-dir", str(ctx.scratch / "decode-table"), "--disk"]
    if ctx.gpu:
        args += ["--graphs", "--steps", "10", "--repeats", "3"]
        args += ["--table-gib", "1", "--batches", "64"] if ctx.quick else ["--table-gib", "2", "--batches", "64,256"]
    else:
        args += ["--small", "--layers", "4", "--engram-layers", "1,2", "--table-gib", "0.01", "--batches", "8",
                 "--steps", "1", "--repeats", "1", "--warmup", "1", "--check-steps", "1"]
    result = ctx.out_dir / "decode_step.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, str(ROOT / "bench" / "decode_step.py"), *args]
    rc = subprocess.run(cmd, timeout=timeout, stdout=sys.stderr).returncode  # its tables go to the log
    if not result.exists():
        raise RuntimeError(f"decode_step.py exited {rc} and wrote no {result.name}")
    summary = json.loads(result.read_text())["summary"]
    disk = "; ".join((summary.get("disk_graphs") or {}).get("lines", []))
    line = (f"host/device decode throughput min {summary['host_vs_device_decode_min']}, Engram bits equal to "
            f"device {summary['bits_equal_device']}, {len(summary['errors'])} variant error(s)"
            + (f"; {disk}" if disk else ""))
    if rc != 0:
        raise AssertionError(f"decode_step.py exited {rc}: {line}; {'; '.join(summary['errors'])[:300]}")
    return line, {"decode_step": summary}


def time_graph(ctx: Ctx, fn, iters: int) -> float:
    """Seconds per call: `iters` calls captured in one graph, timed by CUDA events, best of 3 (the
    Python cost of a call stays out; what is measured is the device's). CPU: wall clock."""
    torch = ctx.torch
    if not ctx.gpu:
        fn()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # compiled and warm, outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3 / iters)
    return best


def copy_limits(ctx: Ctx) -> dict:
    """Same-run limits: device copy (bytes read + written) and host-to-device from pinned memory."""
    torch = ctx.torch
    if not ctx.gpu:
        from bench import common

        return {"d2d_bytes_per_s": common.torch_copy_bandwidth(32 << 20), "h2d_bytes_per_s": float("nan")}
    from bench.gpu_check import time_gpu

    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=ctx.device)
    dst = torch.empty_like(src)
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    lim = {"d2d_bytes_per_s": 2 * n / time_gpu(torch, lambda: dst.copy_(src), 10),
           "h2d_bytes_per_s": n / time_gpu(torch, lambda: dst.copy_(pinned, non_blocking=True), 5)}
    return lim  # the 3 GiB of buffers go with this frame


def check_bandwidth(ctx: Ctx):
    """Decode- and prefill-sized gathers from HBM and through HostStore, per backend, against the
    same-run device copy and host-to-device copy."""
    from engram_sglang.core.ops import gather_dequant, probe

    torch = ctx.torch
    lim = copy_limits(ctx)
    backends = [ctx.kind, "auto"]
    try:
        _triton_runs(ctx, probe)
        if ctx.gpu:  # the interpreter's speed means nothing
            backends.insert(1, "triton")
    except Skip:
        pass
    table = ctx.hbm()
    rows = table.shape[0]
    gen = torch.Generator().manual_seed(7)
    rows_out = []
    batches = [("decode", ctx.size.decode, 200)] + ([("prefill", ctx.size.prefill, 20)] if ctx.size.prefill else [])
    for batch, n, iters in batches:
        iters = max(2, iters // (4 if ctx.quick else 1)) if ctx.gpu else 3
        ids = torch.randint(0, rows, (n,), generator=gen).to(ctx.device)
        out = torch.empty((n, PAYLOAD), dtype=torch.bfloat16, device=ctx.device)
        for backend in backends:
            for where in ("hbm", "host") if backend != "auto" else ("hbm",):  # a host store's "auto" is its native
                if where == "hbm":
                    fn = lambda b=backend: gather_dequant(table, ids, out=out, backend=b)  # noqa: E731
                else:
                    store = ctx.host_store(backend)
                    fn = lambda s=store: s.gather(ids, out=out)  # noqa: E731
                sec = time_graph(ctx, fn, iters)
                r = {"batch": batch, "placement": where, "backend": backend, "ids": n, "us": sec * 1e6,
                     "rows_per_s": n / sec}
                if where == "hbm":
                    r["gb_s"] = n * (ROW_BYTES + 2 * PAYLOAD) / sec / 1e9
                    r["vs_copy"] = n * (ROW_BYTES + 2 * PAYLOAD) / sec / lim["d2d_bytes_per_s"]
                else:  # what crosses the link: the 64-byte lines each row touches
                    r["gb_s"] = n * LINES_PER_ROW * 64 / sec / 1e9
                    r["vs_copy"] = n * LINES_PER_ROW * 64 / sec / lim["h2d_bytes_per_s"]
                rows_out.append(r)
    lines = [f"same-run limits: device copy {lim['d2d_bytes_per_s'] / 1e9:.0f} GB/s (read + write), host-to-device "
             f"{lim['h2d_bytes_per_s'] / 1e9:.1f} GB/s",
             f"{'batch':8} {'placement':9} {'backend':8} {'ids':>7} {'us':>9} {'Mrows/s':>9} {'GB/s':>7} {'of copy':>8}"]
    for r in rows_out:
        lines.append(f"{r['batch']:8} {r['placement']:9} {r['backend']:8} {r['ids']:>7} {r['us']:>9.1f} "
                     f"{r['rows_per_s'] / 1e6:>9.1f} {r['gb_s']:>7.1f} {r['vs_copy']:>8.0%}")
    lines.append("GB/s: from HBM bytes read + written (264 + 512 per row); from host, 64-byte lines read (5 per row) "
                 "against the host-to-device copy")
    missed = speed_floor_failures(rows_out, ctx.floor_scale) if ctx.gpu else []  # CPU timings mean nothing
    if missed:
        raise AssertionError(f"{len(missed)} timings below their floor: " + "; ".join(missed))
    best = max((r for r in rows_out if r["placement"] == "host"), key=lambda r: r["vs_copy"])
    return (f"{len(rows_out)} timings; host best {best['gb_s']:.1f} GB/s ({best['vs_copy']:.0%} of H2D copy)",
            {"bandwidth": rows_out, "limits": lim, "table": lines})


# Issue 23's speed floors, as fractions of the same run's copies (scale multiplies them all;
# --floor-scale 100 must fail every timing, the negative control).
HBM_PREFILL_FLOOR = 0.40  # of the device copy's bytes/s, 264 B read + 512 B written per row
HOST_FLOOR = 0.50  # of the pinned host-to-device copy, in 64-byte lines per row
DECODE_HBM_US = 25.0  # a decode-sized (6,144-id) gather from HBM, at most


def speed_floor_failures(rows: list[dict], scale: float = 1.0) -> list[str]:
    """One line per timing of check_bandwidth's rows that misses its floor (pure: unit-tested on the CPU)."""
    bad = []
    for r in rows:
        what = f"{r['batch']} {r['placement']} {r['backend']} ({r['ids']} ids)"
        if r["placement"] == "host" and r["vs_copy"] < HOST_FLOOR * scale:
            bad.append(f"{what}: {r['vs_copy']:.0%} of the H2D copy, floor {HOST_FLOOR * scale:.0%}")
        elif r["placement"] == "hbm" and r["batch"] == "prefill" and r["vs_copy"] < HBM_PREFILL_FLOOR * scale:
            bad.append(f"{what}: {r['vs_copy']:.0%} of the device copy, floor {HBM_PREFILL_FLOOR * scale:.0%}")
        elif r["placement"] == "hbm" and r["batch"] == "decode" and r["us"] > DECODE_HBM_US / scale:
            bad.append(f"{what}: {r['us']:.1f} us, floor {DECODE_HBM_US / scale:.2f} us")
    return bad


# ------------------------------------------------------------------ the node's shared copy
HUGE_COVERAGE_FLOOR = 0.90  # of the copy's resident pages on huge pages (smaps), or no figures


def huge_pages_gap(mapped_kib: int, huge_kib: int, where: str) -> str:
    """"" when at least HUGE_COVERAGE_FLOOR of the mapping is on huge pages, else the skip's reason
    (timings of a copy on 4 KiB pages measure the GPU's translation misses, not the gather)."""
    coverage = huge_kib / mapped_kib if mapped_kib else 0.0
    if coverage >= HUGE_COVERAGE_FLOOR:
        return ""
    return (f"huge pages unavailable here: {coverage:.0%} of {where}'s {mapped_kib / 1024:.1f} MiB resident on huge "
            f"pages (smaps; needs >= {HUGE_COVERAGE_FLOOR:.0%}; the tmpfs mount's huge= option: "
            f"mount -o remount,huge=within_size /dev/shm)")


def check_shm_copy(ctx: Ctx):
    """The node's shared copy in /dev/shm (ENGRAM_SHM_DIR), mapped read-only and registered through
    HostStore: rows bit-exact; with >= 90% huge-page coverage (smaps) a gather timing, else a skip."""
    import os
    from pathlib import Path

    from engram_sglang.core.stores import hostmem, open_store

    torch = ctx.torch
    shm = Path(os.environ.get("ENGRAM_SHM_DIR", "/dev/shm"))
    need = ctx.rows("big", BIG_LAYER) * ROW_BYTES
    if not shm.is_dir():
        raise Skip(f"{shm} does not exist here (set ENGRAM_SHM_DIR to a tmpfs)")
    if hostmem.shm_free_bytes(shm) < need:
        raise Skip(f"{shm} has {hostmem.shm_free_bytes(shm) / 2**30:.2f} GiB free, the copy needs {need / 2**30:.2f}")
    stores = open_store(ctx.opened("big"), "host", device=ctx.device, shared=True, shm_dir=shm, keep=False)
    try:
        store = stores[BIG_LAYER]
        if not store.shared:
            raise AssertionError(f"no shared copy in {shm}: {store.describe()}")
        if not memoryview(store.memory.map).readonly:
            raise AssertionError(f"{store.memory.shm_path}: the shared copy is mapped writable")
        done = _correct(ctx, lambda ids, out: store.gather(ids, out=out), store.rows, layer_seed("big", BIG_LAYER),
                        False)
        line = f"{done} from {store.memory.shm_path.name} (read-only, registered {store.memory.registered})"
        huge = store.memory.huge_pages_report()  # after the reads: their pages are resident now
        gap = huge_pages_gap(huge.mapped_kib, huge.huge_kib, str(store.memory.shm_path))
        if gap:
            raise Skip(f"{gap}; {line}, no timing")
        # Hash order against address order (issue 23 finding 4), whatever the device reports:
        # the figure says whether the registration's choice (`reads_in_address_order`) pays here.
        chosen, timings = store.sorted_reads, {}
        gen = torch.Generator().manual_seed(9)
        try:
            for batch, n in (("decode", ctx.size.decode), ("prefill", ctx.size.prefill)):
                if n and ctx.gpu:
                    ids = torch.randint(0, store.rows, (n,), generator=gen).to(ctx.device)
                    out = torch.empty((n, PAYLOAD), dtype=torch.bfloat16, device=ctx.device)
                    for order, sort in (("hash order", False), ("address order", True)):
                        store.sorted_reads = sort
                        timings[f"{batch} {order}"] = time_graph(ctx, lambda: store.gather(ids, out=out), 20) * 1e6
        finally:
            store.sorted_reads = chosen
        shown = (", ".join(f"{b} {us:.1f} us" for b, us in timings.items()) or "no timing on the CPU") + (
            f"; this device reads in {'address' if chosen else 'hash'} order")
        return f"{line}; huge pages {huge.coverage:.0%}; {shown}", {"shm_us": timings}
    finally:
        for s in stores.values():
            s.close()


# ------------------------------------------------------------------ two GPUs
def _two_gpus(ctx: Ctx) -> None:
    n = ctx.torch.cuda.device_count() if ctx.gpu else 0
    if n < 2:
        raise Skip(f"needs 2 GPUs ({n} visible)")


# Run in a fresh process (the worker holds a context on GPU 0 already): stores on cuda:1, every
# thread they start included (disk executor, prefetch waits), must leave GPU 0 without a context.
_CUDA1_SCRIPT = r"""
import json, sys, torch
from engram_sglang.core.stores import open_store
table = sys.argv[1]
ids = torch.arange(0, 4096, 7, device="cuda:1")
for placement in ("device", "host", "disk"):
    stores = open_store(table, placement, device="cuda:1")
    for s in stores.values():
        s.gather(ids)
        s.prefetch(ids).wait()
    torch.cuda.synchronize("cuda:1")
    for s in stores.values():
        s.close()
print(json.dumps({"pid": __import__("os").getpid()}))
sys.stdout.flush()
input()  # keep the contexts alive until the parent has looked
"""


def _gpus_holding(pid: int) -> set[int]:
    """nvidia-smi indices of the GPUs where process `pid` has a context."""
    q = lambda what: subprocess.run(["nvidia-smi", f"--query-{what}", "--format=csv,noheader"],  # noqa: E731
                                    capture_output=True, text=True, timeout=30, check=True).stdout
    index = {bus.strip().lower(): int(i) for i, bus in (line.split(",") for line in q("gpu=index,pci.bus_id").splitlines())}
    held = set()
    for line in q("compute-apps=pid,gpu_bus_id").splitlines():
        p, bus = line.split(",")
        if int(p) == pid:
            held.add(index[bus.strip().lower()])
    return held


def _physical_indices(env: dict) -> list[int] | None:
    """nvidia-smi index of cuda:0, cuda:1, ... under CUDA_DEVICE_ORDER=PCI_BUS_ID (the order
    nvidia-smi numbers in); None where CUDA_VISIBLE_DEVICES names GPUs by UUID."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(range(8))
    parts = [p.strip() for p in visible.split(",") if p.strip()]
    return [int(p) for p in parts] if all(p.isdigit() for p in parts) else None


def _exit(proc) -> str:
    return f"exit status {proc.wait()}"


def check_cuda1_context(ctx: Ctx):
    """Stores on cuda:1 (device, host, disk; gathers and prefetches) in a fresh process leave no
    context on GPU 0 (nvidia-smi's compute apps)."""
    import json
    import os
    import shutil

    _two_gpus(ctx)
    if ctx.kind != "cuda" or not shutil.which("nvidia-smi"):
        raise Skip("needs nvidia-smi (CUDA) to see which GPUs hold a context")
    env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    physical = _physical_indices(env)
    if physical is None:
        raise Skip("CUDA_VISIBLE_DEVICES names GPUs by UUID: cannot map them to nvidia-smi's indices")
    proc = subprocess.Popen([sys.executable, "-c", _CUDA1_SCRIPT, str(ctx.opened("small"))], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"the process with stores on cuda:1 ended ({_exit(proc)}) before it reported; "
                                 f"its error is in the log above")
        held = _gpus_holding(json.loads(line)["pid"])
    finally:
        proc.kill()
        proc.wait()
    gpu0, gpu1 = physical[0], physical[1]
    if gpu1 not in held:
        raise AssertionError(f"nvidia-smi shows no context of the process on GPU {gpu1} (held: {sorted(held)}): "
                             f"the query does not see it")
    if gpu0 in held:
        raise AssertionError(f"stores on cuda:1 left a context on GPU {gpu0} (cuda:0)")
    return f"contexts on GPUs {sorted(held)} only (cuda:1 is GPU {gpu1})"


_TP_SCRIPT = r"""
import sys, torch, torch.distributed as dist
from engram_sglang.core.stores import open_store
table, init, rank, ids_path, out_path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
dev = torch.device("cuda", rank)
torch.cuda.set_device(dev)  # as SGLang's TP workers do
dist.init_process_group("nccl", init_method=init, rank=rank, world_size=2)
ids = torch.load(ids_path).to(dev)
store = open_store(table, "device", device=dev, tp_rank=rank, tp_size=2)[1]
rows = store.gather(ids)
as_bf16 = rows.clone()
dist.all_reduce(as_bf16)  # the CUDA path: SGLang's bf16 sum of a row and +0 rows
as_int = rows.clone()
dist.all_reduce(as_int.view(torch.int32))  # the HIP path: an integer sum is exact under any algorithm
torch.cuda.synchronize()
if rank == 0:
    torch.save({"bf16": as_bf16.view(torch.int16).cpu(), "int32": as_int.view(torch.int16).cpu()}, out_path)
dist.destroy_process_group()
"""


def check_tp_sum(ctx: Ctx):
    """Two TP ranks (cuda:0, cuda:1) gather their shards of the big table and sum them through the
    real NCCL/RCCL all-reduce, as bf16 and as an int32 view: both bit-exact vs the oracle."""
    import os

    _two_gpus(ctx)
    torch = ctx.torch
    rows = ctx.rows("big", BIG_LAYER)
    ids = torch.randint(0, rows, (ctx.size.decode,), generator=torch.Generator().manual_seed(10))
    work = ctx.scratch / "tp-sum"
    work.mkdir(exist_ok=True)
    torch.save(ids, work / "ids.pt")
    init = f"file://{work / 'init'}"
    (work / "init").unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", _TP_SCRIPT, str(ctx.opened("big")), init, str(r),
                               str(work / "ids.pt"), str(work / "out.pt")], env=env) for r in (0, 1)]
    try:
        rcs = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:  # a rank stuck in its all-reduce must not outlive the check
            p.kill()
            p.wait()
    if any(rcs):
        raise AssertionError(f"the TP ranks exited {rcs}")
    got = torch.load(work / "out.pt")
    want = ctx.expect(ids, 0, rows, layer_seed("big", BIG_LAYER))
    for how in ("bf16", "int32"):
        check_bits(torch, got[how].view(torch.bfloat16), want, ids, f"TP 2 sum ({how})")
    return f"{ids.numel()} rows summed over 2 ranks through {'RCCL' if ctx.kind == 'hip' else 'NCCL'}: bit-exact"


# ------------------------------------------------------------------ the list
@dataclass(frozen=True)
class Check:
    name: str
    fn: Callable  # fn(ctx) or fn(ctx, timeout) -> detail or (detail, data)
    timeout: float  # seconds on a GPU, full run
    quick_timeout: float
    cpu_timeout: float = 120.0
    wants_timeout: bool = False

    def limit(self, gpu: bool, quick: bool) -> float:
        return (self.quick_timeout if quick else self.timeout) if gpu else self.cpu_timeout

    @property
    def what(self) -> str:
        return " ".join((self.fn.__doc__ or "").split())


def _named(fn, *args):
    f = lambda ctx, *rest: fn(ctx, *args, *rest)  # noqa: E731
    f.__doc__ = fn.__doc__
    return f


def all_checks(kind: str) -> list[Check]:
    """In priority order: the budget cuts from the end."""
    return [
        Check("device", check_device, 60, 60),
        Check("tables", check_tables, 180, 180),
        Check(f"hbm: {kind}", _named(check_hbm, kind), 90, 90),
        Check("hbm: triton", _named(check_hbm, "triton"), 90, 90),
        Check("hbm: auto", _named(check_hbm, "auto"), 60, 60),
        Check(f"host store: {kind}", _named(check_host, kind), 120, 120),
        Check("host store: triton", _named(check_host, "triton"), 120, 120),
        Check("host store: auto, TP shard", check_host_shard, 90, 90),
        Check("graphs: capture + replay", check_graphs, 60, 60),
        Check("hot-row cache: SGLang-style capture", check_cache_capture, 60, 60),
        Check("hot-row cache: replays across maintenances", check_cache_replay, 60, 60),
        Check("disk: prefetch on a side stream", check_disk_prefetch, 120, 120),
        Check("prefetch: dropped handles", check_dropped_handles, 90, 90),
        Check("torch.compile", check_compile, 120, 120),
        # Its limit, from the work on one H200 (no GPU run has timed it yet). Full run: 2 decode
        # batches (64, 256) x 13 variants (eager: none + device/host/disk x prefetch on/off = 7;
        # captured: none + device/host x on/off + disk staged = 6) x 35 steps (3 bit check + 2
        # warm-up + 3 x 10 timed; captured ones +4: 3 warm-up + the capture) = 2 x 479 steps. A step
        # reads 16.6 GB of weights + 11.5 GB (batch 64) / 46 GB (256) of KV at ~4 TB/s: ~7 / ~16 ms,
        # the disk variants ~5 / ~20 ms more (their reads from the page cache): ~4 + ~10 s. Around
        # them: ~15 s torch + CUDA start in the subprocess, ~10 s writing the 2 GiB table, ~5 s
        # opening three stores of it, ~3 s weights, KV and copy limits: ~50 s. Quick (1 GiB, batch
        # 64 only): ~30 s. Limits 2.5x that: 125 / 75 s (a hang costs at most that). Whatever the
        # limits, gpu_check.py's BUDGET (290 s full, 115 quick; worker starts included) caps the
        # whole run, which leaves ~2 of ~7 minutes of device time for the machine's start.
        Check("decode step harness (graphs)", check_decode_step, 125, 75, 150, wants_timeout=True),
        Check("bandwidth", check_bandwidth, 90, 60),
        Check("host store: shared /dev/shm copy", check_shm_copy, 120, 90),
        Check("2 GPUs: a store on cuda:1, no context on GPU 0", check_cuda1_context, 120, 90),
        Check("2 GPUs: TP sum through NCCL/RCCL", check_tp_sum, 240, 180),
    ]
