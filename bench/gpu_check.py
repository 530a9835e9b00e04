"""Everything about the gather that needs a real GPU, in one self-contained run (< 8 minutes).

For a lent machine (e.g. one H200) that has Python, its own torch and Triton (3.6 or later),
no SGLang and no network: it loads the prebuilt torch-free libraries from build/kernels
(libengram_cuda.so / libengram_hip.so, carried with the tree) with ctypes, and this repo's
Triton kernel module by file path, so it needs neither `pip install` nor the package's other
dependencies. Checks, bit for bit against an oracle computed here on the CPU from the
definitions (docs/engram.md section 4):

  1. every backend (native, Triton; the package op when it imports) from HBM and from host
     memory registered with cudaHostRegister (read in-kernel over UVA), int32 and int64 ids,
     1 .. 196608 ids, first/last rows of a table over 2 GiB, row_range shards;
  2. capture of the gathers in a CUDA graph, replayed on new ids;
  3. the bandwidth table: decode (256 x 24 ids) and prefill (8192 x 24) batches from HBM and
     from host memory, against the same-run device copy and host-to-device bandwidth, and
     upstream SGLang's Triton `engram_gather` when ENGRAM_SGLANG_WHEEL names its wheel.

    python bench/gpu_check.py            # on the GPU machine; results in $OUT or bench/out
    python bench/gpu_check.py --dry-run  # anywhere: the CPU-checkable parts (oracle,
                                         # library loading, Triton kernel in the interpreter)
Exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROW_BYTES = 264
DECODE_IDS = 256 * 24  # tests/test_gather.py DECODE_IDS, PREFILL_IDS (this script stands alone)
PREFILL_IDS = 8192 * 24
LINES_PER_ROW = 5  # a 264-byte row at an 8-byte aligned offset always touches five 64-byte lines


def load_module(name: str, relpath: str):
    """Load one of the package's standalone modules by path (no package import)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relpath)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------ oracle
def oracle_lut(torch):
    """int16 bf16 bits [scale byte, fp8 byte] from the definitions (as tests/test_gather.py)."""
    import numpy as np

    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 0xF, b & 0x7
    value = sign * np.where(e == 0, m / 8.0 * 2.0**-6, (1.0 + m / 8.0) * 2.0 ** (e - 7.0))
    value[(b & 0x7F) == 0x7F] = np.nan
    scale = 2.0 ** (np.arange(256) - 127.0)
    scale[255] = np.nan
    with np.errstate(over="ignore", invalid="ignore"):
        prod = (scale[:, None] * value[None, :]).astype(np.float32)
    bf = torch.from_numpy(prod).to(torch.bfloat16)
    bits = bf.view(torch.int16).clone()
    bits[torch.isnan(bf)] = 0x7FC0
    bits[bits == -32768] = 0
    return bits


def expected_bits(torch, lut, table_cpu, ids_cpu, lo, hi):
    idx = ids_cpu.reshape(-1).long()
    live = (idx >= lo) & (idx < hi)
    rows = table_cpu[(idx - lo).clamp(0, max(hi - lo - 1, 0))]
    bits = lut[rows[:, 256:].long().repeat_interleave(32, dim=1), rows[:, :256].long()]
    bits[~live] = 0
    return bits


def bits_of(torch, x):
    b = x.reshape(-1, 256).view(torch.int16).cpu().clone()
    b[torch.isnan(x.reshape(-1, 256).float().cpu())] = 0x7FC0
    return b


def exhaustive_rows(torch):
    s = torch.arange(256)
    t = torch.empty((256, ROW_BYTES), dtype=torch.uint8)
    t[:, :256] = ((s[None, :] + s[:, None]) % 256).to(torch.uint8)
    t[:, 256:] = s[:, None].to(torch.uint8)
    return t


class Report:
    def __init__(self):
        self.checks: list[dict] = []
        self.bandwidth: list[dict] = []
        self.info: dict = {}

    def check(self, name: str, fn):
        t0 = time.perf_counter()
        try:
            detail = fn()
            ok, status = True, "ok"
        except SkipCheck as e:
            ok, status, detail = True, "skip", str(e)
        except Exception as e:  # noqa: BLE001 - every failure is reported, the run goes on
            ok, status, detail = False, "FAIL", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"
        dt = time.perf_counter() - t0
        self.checks.append({"check": name, "status": status, "seconds": round(dt, 2), "detail": detail or ""})
        print(f"[{status:4}] {name} ({dt:.1f} s){': ' + str(detail).splitlines()[0] if detail else ''}", flush=True)
        return ok

    @property
    def failed(self) -> int:
        return sum(c["status"] == "FAIL" for c in self.checks)


class SkipCheck(Exception):
    pass


# ------------------------------------------------------------------ backends
def make_backends(torch, native, gtriton, kind: str, report: Report):
    """name -> fn(table, ids, lo, hi, out) writing out[n, 256] bf16 on the current stream."""
    backends = {}
    lib, why = native.try_load(kind)
    report.info[f"native_{kind}"] = str(lib.path) if lib else why
    if lib is not None:
        code = native.check_device(lib, torch.cuda.current_device())
        report.info["native_check_device"] = code
        if code == 0:
            def run_native(table, ids, lo, hi, out):
                lib.gather(table.data_ptr(), ids.data_ptr(), ids.element_size(), ids.numel(), lo, hi,
                           out.data_ptr(), torch.cuda.current_stream().cuda_stream)
            backends[kind] = run_native
        else:
            report.info[f"native_{kind}"] += f" (cannot run here: {lib.error_string(code)})"

    def run_triton(table, ids, lo, hi, out):
        gtriton.gather_dequant_triton(table, ids, lo, hi, out)

    backends["triton"] = run_triton
    try:  # the package's custom op, when the package imports here (torch + numpy + sympy)
        sys.path.insert(0, str(ROOT))
        from engram_sglang.ops import gather_dequant

        def run_op(table, ids, lo, hi, out):
            gather_dequant(table, ids, out=out, row_range=(lo, hi))

        backends["op(auto)"] = run_op
    except Exception as e:  # noqa: BLE001
        report.info["package_op"] = f"not importable here: {type(e).__name__}: {e}"
    return backends


def upstream_gather(torch, report: Report):
    """SGLang's Triton engram_gather (split layout), from the wheel ENGRAM_SGLANG_WHEEL names."""
    wheel = os.environ.get("ENGRAM_SGLANG_WHEEL")
    if not wheel:
        report.info["upstream"] = "ENGRAM_SGLANG_WHEEL not set"
        return None
    sys.path.insert(0, wheel)
    try:
        from sglang.srt.layers.engram import engram_gather
    except Exception as e:  # noqa: BLE001 - its imports may want packages this machine lacks
        report.info["upstream"] = f"sglang.srt.layers.engram does not import: {type(e).__name__}: {e}"
        return None
    report.info["upstream"] = f"sglang engram_gather from {wheel}"
    return engram_gather


# ------------------------------------------------------------------ checks
def host_tensor(torch, shape):
    """uint8 CPU tensor in page-aligned private anonymous memory, huge pages advised."""
    import mmap

    import numpy as np

    n = 1
    for d in shape:
        n *= d
    buf = mmap.mmap(-1, max(n, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # as the host store keeps tables: fewer TLB misses per row
        buf.madvise(mmap.MADV_HUGEPAGE)
    return torch.from_numpy(np.frombuffer(buf, dtype=np.uint8, count=n).reshape(shape))


def register_host(torch, t):
    """cudaHostRegister (mapped) of a CPU tensor, as the host store does; returns unregister."""
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 2)  # 2: mapped
    code = int(getattr(err, "value", err))
    if code != 0:
        raise RuntimeError(f"cudaHostRegister failed: {code}")
    return lambda: cudart.cudaHostUnregister(t.data_ptr())


def correctness(torch, report, backends, lut, table_cpu, placements, quick: bool):
    rows = table_cpu.shape[0]
    gen = torch.Generator().manual_seed(1)
    base = torch.randint(0, rows, (PREFILL_IDS,), generator=gen)
    edge = torch.tensor([0, 1, 255, rows - 256, rows - 1, rows - 2, -1, rows, 2**31 // ROW_BYTES + 3])
    id_sets = {"1": base[:1], "83+edges": torch.cat([base[:83], edge]), "decode": base[:DECODE_IDS],
               "prefill": base}
    if quick:
        id_sets.pop("prefill")
    want = {label: expected_bits(torch, lut, table_cpu, ids, 0, rows) for label, ids in id_sets.items()}
    for pname, table in placements.items():
        for bname, fn in backends.items():
            def one(pname=pname, table=table, fn=fn, bname=bname):
                n_cases = 0
                for label, ids_cpu in id_sets.items():
                    for dt in (torch.int32, torch.int64):
                        ids = ids_cpu.to(dt).cuda()
                        out = torch.full((ids.numel(), 256), float("nan"), dtype=torch.bfloat16, device="cuda")
                        fn(table, ids, 0, rows, out)
                        torch.cuda.synchronize()
                        got = bits_of(torch, out)
                        if not torch.equal(got, want[label]):
                            bad = (got != want[label]).any(1).nonzero()[:5].flatten().tolist()
                            raise AssertionError(f"{label} {dt}: rows {bad} differ")
                        n_cases += 1
                # A shard: global rows [lo, hi) held by a slice; other ids are +0 rows.
                lo, hi = rows - 300_000, rows - 10
                ids_cpu = torch.cat([base[:5000] % rows, edge])
                out = torch.empty((ids_cpu.numel(), 256), dtype=torch.bfloat16, device="cuda")
                fn(table[lo:hi], ids_cpu.cuda(), lo, hi, out)
                torch.cuda.synchronize()
                if not torch.equal(bits_of(torch, out), expected_bits(torch, lut, table_cpu[lo:hi], ids_cpu, lo, hi)):
                    raise AssertionError("row_range shard differs")
                return f"{n_cases + 1} cases bit-exact"

            report.check(f"correct: {bname} from {pname}", one)


def graph_capture(torch, report, backends, lut, table_cpu, placements):
    rows = table_cpu.shape[0]
    for pname, table in placements.items():
        for bname, fn in backends.items():
            def one(table=table, fn=fn):
                ids = torch.randint(0, rows, (DECODE_IDS,), device="cuda")
                out = torch.empty((DECODE_IDS, 256), dtype=torch.bfloat16, device="cuda")
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):  # warm up (Triton compiles) outside the capture
                    fn(table, ids, 0, rows, out)
                torch.cuda.current_stream().wait_stream(s)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    fn(table, ids, 0, rows, out)
                for seed in (2, 3):
                    ids.copy_(torch.randint(0, rows, (DECODE_IDS,), generator=torch.Generator().manual_seed(seed)))
                    g.replay()
                    torch.cuda.synchronize()
                    if not torch.equal(bits_of(torch, out), expected_bits(torch, lut, table_cpu, ids.cpu(), 0, rows)):
                        raise AssertionError(f"replay {seed} differs")
                return "captured once, replayed twice on new ids: bit-exact"

            report.check(f"graph: {bname} from {pname}", one)


# ------------------------------------------------------------------ bandwidth
def time_gpu(torch, fn, iters: int) -> float:
    """Seconds per call: CUDA events around `iters` back-to-back calls, best of 3."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3 / iters)
    return best


def limits(torch, host_buf) -> dict:
    """Same-run copy limits: device-to-device (bytes read + written) and host-to-device from
    registered memory (bytes moved)."""
    n = 1 << 30
    d_src = torch.empty(n, dtype=torch.uint8, device="cuda")
    d_dst = torch.empty_like(d_src)
    d2d = 2 * n / time_gpu(torch, lambda: d_dst.copy_(d_src), 10)
    h = host_buf[: min(n, host_buf.numel())]
    d_h = torch.empty(h.numel(), dtype=torch.uint8, device="cuda")
    h2d = h.numel() / time_gpu(torch, lambda: d_h.copy_(h, non_blocking=True), 5)
    del d_src, d_dst, d_h
    return {"d2d_bytes_per_s": d2d, "h2d_bytes_per_s": h2d}


def bandwidth(torch, report, backends, upstream, placements, table_cpu, lim, quick: bool):
    rows = table_cpu.shape[0]
    gen = torch.Generator().manual_seed(7)
    split = {}
    if upstream is not None:  # upstream reads the checkpoint's split layout
        for pname, table in placements.items():
            if table.is_cuda:
                w, s = table[:, :256].contiguous(), table[:, 256:].contiguous()
            else:
                w, s = host_tensor(torch, (rows, 256)), host_tensor(torch, (rows, 8))
                w.copy_(table_cpu[:, :256])
                s.copy_(table_cpu[:, 256:])
                register_host(torch, w)
                register_host(torch, s)
            split[pname] = (w, s)
    for batch, n in (("decode", DECODE_IDS), ("prefill", PREFILL_IDS)):
        ids = torch.randint(0, rows, (n,), generator=gen).cuda()
        out = torch.empty((n, 256), dtype=torch.bfloat16, device="cuda")
        iters = 200 if batch == "decode" else 20
        if quick:
            iters //= 4
        for pname, table in placements.items():
            runs = dict(backends)
            if upstream is not None:
                w, s = split[pname]
                runs["upstream sglang"] = lambda t, i, lo, hi, o, w=w, s=s: upstream(
                    w.data_ptr(), s.data_ptr(), i, o, 256, 32, lo, hi)
            for bname, fn in runs.items():
                def one(fn=fn, table=table, bname=bname, pname=pname, batch=batch, n=n, ids=ids, out=out,
                        iters=iters):
                    sec = time_gpu(torch, lambda: fn(table, ids, 0, rows, out), iters)
                    row = {"batch": batch, "placement": pname, "backend": bname, "ids": n, "us": sec * 1e6,
                           "rows_per_s": n / sec}
                    if pname == "hbm":
                        row["gb_s"] = n * (ROW_BYTES + 512) / sec / 1e9
                        row["vs_copy"] = n * (ROW_BYTES + 512) / sec / lim["d2d_bytes_per_s"]
                    else:  # what crosses the link: the 64-byte lines each row touches
                        row["gb_s"] = n * LINES_PER_ROW * 64 / sec / 1e9
                        row["vs_copy"] = n * LINES_PER_ROW * 64 / sec / lim["h2d_bytes_per_s"]
                    report.bandwidth.append(row)
                    return f"{sec * 1e6:.1f} us, {row['gb_s']:.1f} GB/s, {row['vs_copy']:.0%} of same-run copy"

                report.check(f"bandwidth: {bname} {batch} from {pname}", one)


def print_bandwidth(report: Report, lim: dict) -> None:
    print(f"\nsame-run limits: device copy {lim['d2d_bytes_per_s'] / 1e9:.0f} GB/s (read + write), "
          f"host-to-device {lim['h2d_bytes_per_s'] / 1e9:.1f} GB/s")
    head = f"{'batch':8} {'placement':9} {'backend':16} {'ids':>7} {'us':>9} {'Mrows/s':>9} {'GB/s':>7} {'of copy':>8}"
    print(head)
    for r in report.bandwidth:
        print(f"{r['batch']:8} {r['placement']:9} {r['backend']:16} {r['ids']:>7} {r['us']:>9.1f} "
              f"{r['rows_per_s'] / 1e6:>9.1f} {r['gb_s']:>7.1f} {r['vs_copy']:>8.0%}")
    print("GB/s: from HBM bytes read + written (264 + 512 per row); from host, 64-byte lines read "
          "(5 per row) against host-to-device copy")


# ------------------------------------------------------------------ runs
def gpu_run(args, report: Report) -> None:
    import torch

    native = load_module("engram_native", "engram_sglang/ops/native.py")
    gtriton = load_module("engram_gather_triton", "engram_sglang/ops/gather_triton.py")
    import triton

    props = torch.cuda.get_device_properties(0)
    kind = "hip" if torch.version.hip else "cuda"
    report.info.update(torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                       device=props.name, kind=kind,
                       arch=getattr(props, "gcnArchName", None) or f"sm_{props.major}{props.minor}")
    print(json.dumps(report.info), flush=True)
    lut = oracle_lut(torch)
    backends = make_backends(torch, native, gtriton, kind, report)
    print(json.dumps({k: v for k, v in report.info.items() if k.startswith(("native", "package"))}), flush=True)

    rows = args.rows
    hbm = torch.randint(0, 256, (rows, ROW_BYTES), dtype=torch.uint8, device="cuda")
    ex = exhaustive_rows(torch).cuda()
    hbm[:256] = ex
    hbm[-256:] = ex
    # The host copy in page-aligned anonymous memory, registered, as the host store does.
    table_cpu = host_tensor(torch, (rows, ROW_BYTES))
    table_cpu.copy_(hbm)
    placements = {"hbm": hbm}
    state = {}

    def register():
        state["unregister"] = register_host(torch, table_cpu)
        placements["host"] = table_cpu
        return f"{rows * ROW_BYTES / 2**30:.2f} GiB registered"

    report.check("register host table", register)
    unregister = state.get("unregister")
    report.info["table_gib"] = rows * ROW_BYTES / 2**30

    correctness(torch, report, backends, lut, table_cpu, placements, args.quick)
    graph_capture(torch, report, {k: v for k, v in backends.items()}, lut, table_cpu, placements)
    lim = limits(torch, table_cpu.view(-1))
    report.info["limits"] = lim
    upstream = upstream_gather(torch, report)
    bench_backends = {k: v for k, v in backends.items() if k != "op(auto)"}
    bandwidth(torch, report, bench_backends, upstream, placements, table_cpu, lim, args.quick)
    print_bandwidth(report, lim)
    if unregister:
        unregister()


def dry_run(args, report: Report) -> None:
    """No GPU: what can be checked here (the oracle, library loading, the Triton kernel under
    the interpreter, the host library)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    native = load_module("engram_native", "engram_sglang/ops/native.py")
    gtriton = load_module("engram_gather_triton", "engram_sglang/ops/gather_triton.py")
    lut = oracle_lut(torch)

    def oracle_edges():
        assert lut[127, 0x38] == 0x3F80 and lut[0, 0x80] == 0 and lut[0, 0x08] == 1 and lut[255, 0] == 0x7FC0
        return "ok"

    report.check("oracle", oracle_edges)
    table = torch.cat([exhaustive_rows(torch), torch.randint(0, 256, (500, ROW_BYTES), dtype=torch.uint8)])
    ids = torch.cat([torch.randperm(table.shape[0]), torch.tensor([-1, table.shape[0]])])
    want = expected_bits(torch, lut, table, ids, 0, table.shape[0])

    def triton_interp():
        out = torch.empty((ids.numel(), 256), dtype=torch.bfloat16)
        gtriton.gather_dequant_triton(table, ids, 0, table.shape[0], out)
        assert torch.equal(bits_of(torch, out), want)
        return "Triton kernel bit-exact under the interpreter"

    report.check("triton (interpreter)", triton_interp)

    def host_lib():
        lib, why = native.try_load("cpu")
        if lib is None:
            raise SkipCheck(why)
        out = torch.empty((ids.numel(), 256), dtype=torch.bfloat16)
        lib.gather(table.data_ptr(), ids.data_ptr(), 8, ids.numel(), 0, table.shape[0], out.data_ptr(), 0)
        assert torch.equal(bits_of(torch, out), want)
        return "bit-exact"

    report.check("host library", host_lib)
    for kind in ("cuda", "hip"):
        def load(kind=kind):
            lib, why = native.try_load(kind)
            if lib is None:
                raise SkipCheck(why)
            return f"loads; targets {' '.join(lib.targets)}; check_device(0) = {native.check_device(lib, 0)} (no GPU)"

        report.check(f"{kind} library", load)


def decode_step(args, out_dir: Path, gpu: bool) -> str:
    """bench/decode_step.py (model-shaped decode steps, host vs device tables) in a subprocess
    under a time limit; its output streams here, its JSON and PNG go to out_dir."""
    import subprocess

    cmd = [sys.executable, str(ROOT / "bench" / "decode_step.py"), "--out", str(out_dir)]
    cmd += ["--graphs"] if gpu else ["--small"]
    result = out_dir / "decode_step.json"
    result.unlink(missing_ok=True)
    rc = subprocess.run(cmd, timeout=args.decode_step_timeout).returncode
    if not result.exists():
        raise RuntimeError(f"exit status {rc}, no {result.name} written")
    summary = json.loads(result.read_text())["summary"]
    line = (f"host/device decode throughput min {summary['host_vs_device_decode_min']}, Engram bits equal to device "
            f"{summary['bits_equal_device']}, {len(summary['errors'])} variant error(s)")
    if rc != 0:
        raise RuntimeError(f"exit status {rc}: {line}")
    return line


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU-checkable parts only")
    ap.add_argument("--rows", type=int, default=9_000_000, help="table rows (default ~2.2 GiB: past 2^31 bytes)")
    ap.add_argument("--quick", action="store_true", help="fewer cases and iterations")
    ap.add_argument("--decode-step", action="store_true",
                    help="also run bench/decode_step.py (--graphs on a GPU, --small without) as a subprocess")
    ap.add_argument("--decode-step-timeout", type=float, default=360, help="its time limit in seconds")
    args = ap.parse_args(argv)
    report = Report()
    t0 = time.perf_counter()
    import torch

    if args.dry_run or not torch.cuda.is_available():
        if not args.dry_run:
            print("no GPU visible: running the CPU-checkable parts only")
        dry_run(args, report)
    else:
        gpu_run(args, report)
    out_dir = Path(os.environ.get("OUT") or ROOT / "bench" / "out")
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.decode_step:
        gpu = not args.dry_run and torch.cuda.is_available()
        report.check("decode step harness", lambda: decode_step(args, out_dir, gpu))
    report.info["seconds"] = round(time.perf_counter() - t0, 1)
    path = out_dir / ("gpu_check_dry.json" if args.dry_run or not torch.cuda.is_available() else "gpu_check.json")
    path.write_text(json.dumps({"info": report.info, "checks": report.checks, "bandwidth": report.bandwidth},
                               indent=1, default=str))
    print(f"\n{len(report.checks) - report.failed}/{len(report.checks)} checks passed in "
          f"{report.info['seconds']} s; wrote {path}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
