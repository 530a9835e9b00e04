"""Everything that only a GPU can show, in one run: `make gpu-check` on a lent machine.

For a machine with Python, its own torch and Triton, no SGLang, no network and no toolchain:
`PYTHONPATH=. python3 bench/gpu_check.py` with the prebuilt libraries in build/kernels (carried
with the tree). First a preflight (bench/gpu_check_preflight.py) says in seconds what cannot
run here. Checks (bench/gpu_checks.py; rows bit for bit against an oracle computed on the
CPU from the definitions, docs/engram.md section 4):

  * the native library (CUDA or HIP) runs on this device and the probe picks it;
  * native, Triton and the probe's choice through the op, from a table in device memory and
    through HostStore (host memory the store registers), int32 and int64 ids, a table over
    4 GiB with ids past 4 GiB, tensor-parallel shards;
  * capture + replay of every gather; the hot-row cache captured as SGLang does and replayed
    across maintenances (its hit rate rises, rows stay exact);
  * the disk tier's prefetch consumed on a non-default stream (1000 steps, fresh ids made by a
    kernel on that stream); dropped prefetch handles; torch.compile;
  * bench/decode_step.py with CUDA graphs; gather bandwidth against same-run copies, failing
    below issue 23's floors (--floor-scale 100: the negative control);
  * the node's shared /dev/shm copy through HostStore (a skip below 90% huge pages); with 2+
    GPUs, no context on GPU 0 from stores on cuda:1 and a TP sum through NCCL/RCCL.

    python3 bench/gpu_check.py            # GPU: <= 5 minutes on one H200 (--quick: <= 2)
    python3 bench/gpu_check.py --dry-run  # anywhere: every check's CPU part
    python3 bench/gpu_check.py --list     # the checks, one line each

How a hung kernel cannot eat the budget: the checks run in a worker process that reports
each check's start and end over a pipe; the parent kills the worker's process group when a
check passes its own time limit (or the run's budget), records it as failed, and starts a
fresh worker for the checks after it. A failed check whose process can no longer run a
kernel (an illegal address poisons a CUDA context) also ends its worker. The report is
written after every check: a table on stdout, JSON in $OUT (default bench/out). The same
script runs on ROCm: torch.cuda is HIP there, the native check loads libengram_hip.so, and
checks that cannot run say why (status "skip"). Exit status 1 when any check failed
(including "the native library cannot run on this GPU"), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGET = {"full": 290.0, "quick": 115.0, "dry": 600.0}  # seconds for the whole run
WORKER_START = 90.0  # seconds for a worker to import torch and set up the device
BETWEEN_CHECKS = 60.0  # seconds from one check's end to the next one's start


def time_gpu(torch, fn, iters: int) -> float:
    """Seconds per call: CUDA events around `iters` back-to-back calls, best of 3 (used for copies
    here and by bench/decode_step.py)."""
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


def _checks_module():
    from bench import gpu_checks

    return gpu_checks


# ------------------------------------------------------------------ worker
def worker(args) -> int:
    """Run the named checks in order; report each start and end as a JSON line on --report-fd."""
    _die_with_parent()
    report = os.fdopen(args.report_fd, "w", buffering=1)
    sys.stdout = sys.stderr  # the parent's stdout holds the table; progress goes to stderr

    def emit(**event):
        report.write(json.dumps(event, default=str) + "\n")
        report.flush()

    gc = _checks_module()
    checks = {c.name: c for c in gc.all_checks(args.kind)}
    inject = dict(x.split("=", 1) for x in args.inject)
    ctx = None  # made by the first check that runs (torch, the device): in its time limit
    try:
        for name in args.checks:
            check = checks[name]
            emit(event="start", check=name)
            t0 = time.perf_counter()
            status, detail, data = "ok", "", {}
            try:
                if name in inject:
                    _injected(inject[name])
                if ctx is None:
                    ctx = gc.Ctx(gpu=not args.dry_run, quick=args.quick, scratch=Path(args.scratch),
                                 out_dir=Path(args.out))
                    ctx.floor_scale = args.floor_scale
                limit = args.check_timeout or check.limit(ctx.gpu, ctx.quick)
                got = check.fn(ctx, limit - 10) if check.wants_timeout else check.fn(ctx)
                detail, data = got if isinstance(got, tuple) else (got, {})
            except gc.Skip as e:
                status, detail = "skip", str(e)
            except Exception as e:  # noqa: BLE001 - every failure is reported, the run goes on
                status = "FAIL"
                detail = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-4)}"
            emit(event="end", check=name, status=status, seconds=round(time.perf_counter() - t0, 2), detail=detail,
                 data=data)
            if status == "FAIL" and ctx is not None and not ctx.healthy():
                return 3  # a fresh worker for the rest
    finally:
        if ctx is not None:
            ctx.close()
    return 0


def _die_with_parent() -> None:
    """The worker has its own process group (so that it can be killed with its children): make
    the kernel end it when the parent dies, however the parent dies (Linux PR_SET_PDEATHSIG)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the parent died before the line above
        os._exit(1)


def _injected(what: str) -> None:
    """Negative controls for the tests of this script: a hang, a crash, an error."""
    if what == "hang":
        time.sleep(3600)
    if what == "crash":
        os.kill(os.getpid(), signal.SIGSEGV)
    raise RuntimeError(f"injected failure ({what})")


# ------------------------------------------------------------------ parent
class Report:
    """The run's results so far; rewritten to JSON (atomically) after every check."""

    def __init__(self, path: Path, plan: list[str], info: dict):
        self.path, self.plan, self.info = path, plan, info
        self.checks: list[dict] = []
        self.bandwidth: list[dict] = []
        self.write()

    def add(self, name: str, status: str, seconds: float, detail: str, data: dict | None = None) -> None:
        data = dict(data or {})
        if name == "device" and status == "ok":
            self.info.update(data)  # what ran where: device, arch, torch, Triton, native library, probe
        self.bandwidth += data.pop("bandwidth", [])
        table = data.pop("table", None)
        self.checks.append({"check": name, "status": status, "seconds": seconds, "detail": detail, "data": data})
        first = detail.splitlines()[0] if detail else ""
        print(f"[{status:4}] {name} ({seconds:.1f} s){': ' + first if first else ''}", flush=True)
        if table:
            print("\n".join(table), flush=True)
        self.write()

    @property
    def failed(self) -> int:
        return sum(c["status"] == "FAIL" for c in self.checks)

    def write(self, done: bool = False) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"info": self.info, "plan": self.plan, "done": done, "checks": self.checks,
                                   "bandwidth": self.bandwidth}, indent=1, default=str))
        os.replace(tmp, self.path)

    def table(self) -> str:
        w = max(len(c["check"]) for c in self.checks) if self.checks else 10
        lines = [f"{'check':{w}}  {'status':6}  {'s':>6}  detail", "-" * (w + 60)]
        for c in self.checks:
            first = c["detail"].splitlines()[0] if c["detail"] else ""
            lines.append(f"{c['check']:{w}}  {c['status']:6}  {c['seconds']:>6.1f}  {first[:160]}")
        return "\n".join(lines)


def _spawn(args, kind: str, names: list[str], scratch: Path, out_dir: Path):
    r, w = os.pipe()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--report-fd", str(w), "--scratch", str(scratch),
           "--out", str(out_dir), "--kind", kind, "--checks", *names]
    cmd += ["--dry-run"] if args.dry_run else []
    cmd += ["--quick"] if args.quick else []
    cmd += ["--floor-scale", str(args.floor_scale)]
    for x in args.inject:
        cmd += ["--inject", x]
    if args.check_timeout:
        cmd += ["--check-timeout", str(args.check_timeout)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    if args.dry_run:
        env["TRITON_INTERPRET"] = "1"  # the Triton kernel runs in the interpreter on CPU tensors
    else:
        env.pop("TRITON_INTERPRET", None)
    proc = subprocess.Popen(cmd, pass_fds=(w,), env=env, start_new_session=True, stdout=sys.stderr)
    os.close(w)
    return proc, r


def _kill(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the worker and anything it started (decode_step.py)
    except ProcessLookupError:
        pass
    proc.wait()


def _exit_text(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


def run(args) -> int:
    gc = _checks_module()
    mode = "dry" if args.dry_run else ("quick" if args.quick else "full")
    kind = "cpu" if args.dry_run else _gpu_kind()
    checks = gc.all_checks(kind)
    if args.only:
        unknown = [n for n in args.only if n not in {c.name for c in checks}]
        if unknown:
            print(f"gpu_check: no check named {unknown[0]!r}; `--list` names them", file=sys.stderr)
            return 2
        checks = [c for c in checks if c.name in args.only]
    limits = {c.name: args.check_timeout or c.limit(not args.dry_run, args.quick) for c in checks}
    out_dir = Path(os.environ.get("OUT") or ROOT / "bench" / "out")
    out_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(args.scratch) if args.scratch else Path(tempfile.mkdtemp(prefix="engram-gpu-check-"))
    scratch.mkdir(parents=True, exist_ok=True)
    budget = args.budget or BUDGET[mode]
    info = {"mode": mode, "budget_s": budget, "scratch": str(scratch), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    report = Report(out_dir / ("gpu_check_dry.json" if args.dry_run else "gpu_check.json"), [c.name for c in checks], info)
    print(f"gpu_check ({mode}): {len(checks)} checks, budget {budget:.0f} s, report {report.path}", flush=True)
    t_start = time.monotonic()
    pending = [c.name for c in checks]
    # SIGTERM (a CI timeout, `timeout`): unwind, so that the worker is killed and the report closed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        if not preflight(args, report, [c.name for c in checks]):
            return 1  # its report is written; the scratch directory goes below all the same
        while pending:
            left = budget - (time.monotonic() - t_start)
            if left < 5:
                for name in pending:
                    report.add(name, "FAIL", 0.0, f"not run: the run's budget of {budget:.0f} s was spent")
                break
            proc, fd = _spawn(args, kind, pending, scratch, out_dir)
            _drive(proc, fd, pending, limits, report, t_start, budget)
    finally:
        info["seconds"] = round(time.monotonic() - t_start, 1)
        report.write(done=True)
        if not args.keep_scratch and not args.scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    ran = sum(c["status"] == "ok" for c in report.checks)
    skipped = [c for c in report.checks if c["status"] == "skip"]
    print(f"\n{report.table()}\n")
    print(f"{ran} passed, {len(skipped)} skipped, {report.failed} failed of {len(report.checks)} checks in "
          f"{info['seconds']} s; wrote {report.path}")
    return 1 if report.failed else 0


def preflight(args, report: Report, names: list[str]) -> bool:
    """Say in seconds what cannot run here (bench/gpu_check_preflight.py); False (every check
    failed, not run) when nothing can."""
    from bench import gpu_check_preflight as pf

    t0 = time.monotonic()
    problems = pf.judge(pf.gather(gpu=not args.dry_run, torch=sys.modules.get("torch")))
    if "preflight=fatal" in args.inject:  # the negative control of the tests
        problems.append(("fatal", "injected (--inject preflight=fatal)"))
    report.info["preflight"] = [f"{level}: {line}" for level, line in problems]
    for level, line in problems:
        print(f"preflight: {'cannot run' if level == 'fatal' else 'warning'}: {line}", flush=True)
    print(f"preflight: {len(problems)} problem(s) in {time.monotonic() - t0:.1f} s", flush=True)
    fatal = [line for level, line in problems if level == "fatal"]
    if fatal:
        for name in names:
            report.add(name, "FAIL", 0.0, f"not run: preflight: {fatal[0]}")
        report.write(done=True)
        print(f"\n{report.table()}\n\n0 passed, 0 skipped, {report.failed} failed: the preflight found "
              f"{len(fatal)} problem(s) that stop every check; wrote {report.path}")
    return not fatal


def _lines(fd: int, buf: bytearray) -> tuple[list[str], bool]:
    """The complete lines that can be read from `fd` now (one os.read: select said so), and
    whether it reached the end. Unbuffered on purpose: a buffered reader can hold a second
    event that select() then never reports."""
    data = os.read(fd, 1 << 16)
    buf += data
    *lines, rest = buf.split(b"\n")
    buf[:] = rest
    return [line.decode() for line in lines], not data


def _drive(proc, fd: int, pending: list[str], limits: dict, report: Report, t_start: float, budget: float) -> None:
    """Follow one worker until it ends or is killed; results go to `report`, done names leave `pending`."""
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    current, started = None, time.monotonic()
    deadline = started + WORKER_START
    buf = bytearray()
    try:
        while True:
            end_of_budget = t_start + budget
            timeout = min(deadline, end_of_budget) - time.monotonic()
            if timeout <= 0 or not sel.select(timeout=timeout):  # a check (or the worker's start) ran too long
                _kill(proc)
                name = current or pending[0]
                spent = time.monotonic() - started
                if deadline > end_of_budget:
                    why = f"stopped after {spent:.0f} s: the run's budget of {budget:.0f} s was spent"
                elif current is None:
                    why = f"the worker did not start it within {deadline - started:.0f} s; the worker was killed"
                else:
                    why = f"timed out after {spent:.0f} s (its limit); the worker was killed"
                report.add(name, "FAIL", round(spent, 1), why)
                pending.remove(name)
                return
            lines, ended = _lines(fd, buf)
            for line in lines:
                ev = json.loads(line)
                if ev["event"] == "start":
                    current, started = ev["check"], time.monotonic()
                    deadline = started + limits[current]
                elif ev["event"] == "end":
                    report.add(ev["check"], ev["status"], ev["seconds"], ev["detail"], ev.get("data"))
                    pending.remove(ev["check"])
                    current, started = None, time.monotonic()
                    deadline = started + BETWEEN_CHECKS
            if not ended:
                continue
            rc = proc.wait()
            if current is not None:
                report.add(current, "FAIL", round(time.monotonic() - started, 1),
                           f"the worker died during this check ({_exit_text(rc)})")
                pending.remove(current)
            elif rc != 3:  # 3: it stopped after a failure that poisoned its device; a fresh one goes on
                for name in list(pending):  # it failed outside any check: so would a new one
                    report.add(name, "FAIL", 0.0, f"not run: the worker ended ({_exit_text(rc)}; its error, if "
                                                  f"any, is in the log above)")
                    pending.remove(name)
            return
    finally:
        sel.close()
        os.close(fd)
        if proc.poll() is None:
            _kill(proc)


def _gpu_kind() -> str:
    import torch

    if not torch.cuda.is_available():
        return "none"
    return "hip" if torch.version.hip else "cuda"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="every check's CPU part (no GPU needed)")
    ap.add_argument("--quick", action="store_true", help="smaller sets and timings (<= 2 minutes on one H200)")
    ap.add_argument("--floor-scale", type=float, default=1.0, metavar="X",
                    help="multiply the bandwidth check's speed floors by X (100 must fail: the negative control)")
    ap.add_argument("--list", action="store_true", help="list the checks and exit")
    ap.add_argument("--only", nargs="+", default=None, metavar="CHECK", help="run only these checks (names as --list)")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"seconds for the whole run (default {BUDGET['full']:.0f}, --quick {BUDGET['quick']:.0f})")
    ap.add_argument("--check-timeout", type=float, default=None,
                    help="seconds each check may take (default: each check's own limit, see --list)")
    ap.add_argument("--scratch", default=None, help="where tables are written (default: a new temporary directory, "
                                                    "removed at the end)")
    ap.add_argument("--keep-scratch", action="store_true", help="keep the temporary table directory")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--report-fd", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--checks", nargs="+", default=[], help=argparse.SUPPRESS)
    ap.add_argument("--kind", default="cpu", help=argparse.SUPPRESS)
    ap.add_argument("--inject", action="append", default=[], help=argparse.SUPPRESS)  # CHECK=hang|crash|fail
    args = ap.parse_args(argv)
    for opt in ("budget", "check_timeout"):
        value = getattr(args, opt)
        if value is not None and value <= 0:
            print(f"gpu_check: --{opt.replace('_', '-')} must be > 0 seconds, got {value}", file=sys.stderr)
            return 2
    if args.worker:
        return worker(args)
    if args.list:
        for c in _checks_module().all_checks("cuda|hip"):
            print(f"{c.name}\t{c.what} (limit {c.timeout:.0f} s, --quick {c.quick_timeout:.0f} s)")
        return 0
    if not args.dry_run and _gpu_kind() == "none":
        print("gpu_check: no GPU visible to torch; `--dry-run` runs every check's CPU part", file=sys.stderr)
        return 1
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
