"""Run the fuzz harnesses: `make fuzz` (FUZZ_SECONDS each) and tests/tools/test_fuzz.py (a fixed
seed and run count) both come here.

    python -m fuzz.runner [--seconds S | --runs N] [--seed S] [--out build/fuzz] [TARGET ...]

Each target (fuzz/fuzz_TARGET.py) runs in its own process under libFuzzer, starting from
its seed corpus fuzz/corpus/TARGET (read only: new inputs go to OUT/TARGET/corpus). A
finding stops it and leaves the input in OUT/TARGET/ (crash-*, timeout-*, oom-*); replay it
with `python -m fuzz.fuzz_TARGET FILE`, then add it to the corpus as a regression case
(fuzz/corpus/TARGET/regression-WHAT) with a test in tests/tools/test_fuzz.py.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
TARGETS = ("tables", "config", "convert")
# A parse of these few-KiB inputs takes milliseconds: 10 s is a hang. The harness process
# holds torch (~600 MiB); a parser that allocates what a few-KiB input claims (petabytes of
# rows) crosses libFuzzer's 2 GiB RSS limit, which is checked while the input runs.
PER_INPUT_TIMEOUT_S = 10
RSS_LIMIT_MB = 2048


@dataclass
class Result:
    target: str
    returncode: int
    seconds: float
    log: Path
    findings: list[Path]
    stats: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.findings

    def summary(self) -> str:
        if self.ok:
            return f"fuzz {self.target}: OK in {self.seconds:.0f} s ({self.stats})"
        tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-60:])
        found = ", ".join(map(str, self.findings)) or "none written"
        return (f"fuzz {self.target}: FAILED (exit {self.returncode}) in {self.seconds:.0f} s; input(s): {found}\n"
                f"replay: {sys.executable} -m fuzz.fuzz_{self.target} FILE\n--- log tail ({self.log}) ---\n{tail}")


def command(target: str, out: Path, *, runs: Optional[int], seconds: Optional[int], seed: int) -> list[str]:
    if target not in TARGETS:
        raise SystemExit(f"fuzz: unknown target {target!r}; targets: {', '.join(TARGETS)}")
    new = out / "corpus"
    new.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", f"fuzz.fuzz_{target}", f"-seed={seed}", f"-timeout={PER_INPUT_TIMEOUT_S}",
           f"-rss_limit_mb={RSS_LIMIT_MB}", "-max_len=4096", f"-artifact_prefix={out}/", "-print_final_stats=1"]
    if runs is not None:
        cmd.append(f"-runs={runs}")
    if seconds is not None:
        cmd.append(f"-max_total_time={seconds}")
    return cmd + [str(new), str(HERE / "corpus" / target)]


def run(target: str, out_root: Path, *, runs: Optional[int] = None, seconds: Optional[int] = None,
        seed: int = 1, env: Optional[dict] = None) -> Result:
    """One libFuzzer process for `target`; its log and any finding land in out_root/target."""
    out = out_root / target
    out.mkdir(parents=True, exist_ok=True)
    before = set(out.iterdir())
    log = out / "log.txt"
    t0 = time.monotonic()
    env = {**os.environ, **(env or {})}
    # The harness's work files, removed here: libFuzzer ends the process without Python's
    # clean-up. tmpfs when there is one (converts fsync).
    scratch = None
    if not env.get("FUZZ_SCRATCH"):
        shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        scratch = env["FUZZ_SCRATCH"] = tempfile.mkdtemp(prefix=f"engram-fuzz-{target}-", dir=shm)
    try:
        with open(log, "wb") as f:
            # stdin closed: a parser that reads a stray /dev/stdin must not wait on a terminal.
            # Through a small shell that forks the harness: Linux hands a process its parent's
            # peak RSS at exec (ru_maxrss), and libFuzzer's RSS limit reads that peak, so a
            # harness started straight from a big process (pytest late in `make test`) would
            # be "out of memory" before its first input. A grandchild starts from the shell's.
            rc = subprocess.run(["/bin/sh", "-c", '"$@"; exit $?', "sh",
                                 *command(target, out, runs=runs, seconds=seconds, seed=seed)],
                                stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, env=env,
                                cwd=HERE.parent).returncode  # `-m fuzz.X` from the repository root
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    seconds_taken = time.monotonic() - t0
    findings = sorted(p for p in set(out.iterdir()) - before if re.match(r"(crash|timeout|oom|leak|slow-unit)-", p.name))
    text = log.read_text(errors="replace")
    done = re.findall(r"#(\d+)\s+DONE\s+cov: (\d+) ft: \d+ corp: (\d+)", text)
    stats = f"{done[-1][0]} inputs, coverage {done[-1][1]}, corpus {done[-1][2]}" if done else "no DONE line"
    return Result(target, rc, seconds_taken, log, findings, stats)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("targets", nargs="*", default=list(TARGETS), help=f"default: all ({', '.join(TARGETS)})")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--seconds", type=int, help="fuzz each target this long")
    how.add_argument("--runs", type=int, help="fuzz each target for this many inputs")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("build/fuzz"), help="corpus growth, logs and findings")
    args = p.parse_args(argv)
    if args.seconds is None and args.runs is None:
        args.seconds = 60
    failed = 0
    for target in args.targets:
        result = run(target, args.out.resolve(), runs=args.runs, seconds=args.seconds, seed=args.seed)
        print(result.summary(), flush=True)
        failed += not result.ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
