"""bench/gpu_check.py without a GPU: every check's CPU part passes (`--dry-run`), and the
parent's guards hold: a hung check is killed at its own limit and the run goes on in a fresh
worker, a crashed worker fails only the check it was running, the run's budget stops the
rest, the JSON report is written after every check, bad arguments exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"
# As a lent GPU runs it (`make gpu-check`): the script by its path, the checkout on PYTHONPATH.
GPU_MACHINE_ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def run_check(tmp_path, *args, timeout=300):
    # Its own TMPDIR: the run's scratch directory must be gone when it ends, whatever ended it.
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    env = {**GPU_MACHINE_ENV, "OUT": str(tmp_path), "TMPDIR": str(tmp)}
    r = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                       timeout=timeout, cwd=tmp_path)
    if "--keep-scratch" not in args:
        assert not list(tmp.glob("engram-gpu-check-*")), "the scratch directory was left behind"
    return r


def report(tmp_path) -> dict:
    return json.loads((tmp_path / "gpu_check_dry.json").read_text())


def listed() -> list[str]:
    r = subprocess.run([sys.executable, str(SCRIPT), "--list"], capture_output=True, text=True, timeout=60,
                       env=GPU_MACHINE_ENV)
    assert r.returncode == 0, r.stderr
    return [line.split("\t", 1)[0] for line in r.stdout.splitlines()]


def test_dry_run_passes_every_cpu_part(tmp_path):
    r = run_check(tmp_path, "--dry-run", "--budget", "400")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = report(tmp_path)
    assert rep["done"] and rep["info"]["mode"] == "dry"
    names = [c["check"] for c in rep["checks"]]
    assert names == rep["plan"]
    assert [n.replace("cuda|hip", "cpu") for n in listed()] == names  # --list names every check the run runs
    status = {c["check"]: c["status"] for c in rep["checks"]}
    assert status.pop("torch.compile") == "skip"
    assert {status.pop(n) for n in list(status) if n.startswith("2 GPUs:")} == {"skip"}  # needs 2 GPUs
    shm = next(c for c in rep["checks"] if c["check"] == "host store: shared /dev/shm copy")
    status.pop(shm["check"])
    assert shm["status"] == "ok" or shm["detail"].startswith("huge pages unavailable here"), shm
    assert set(status.values()) == {"ok"}, rep["checks"]
    # The table on stdout, and the decode-step harness's own report beside ours.
    assert " 0 failed of 19 checks" in r.stdout and "preflight: 0 problem(s)" in r.stdout
    assert json.loads((tmp_path / "decode_step.json").read_text())["summary"]["bits_equal_device"] is True
    hit = next(c for c in rep["checks"] if c["check"] == "hot-row cache: replays across maintenances")
    assert "first replay 0.00" in hit["detail"]


def test_hung_crashed_and_failing_checks(tmp_path):
    t0 = time.monotonic()
    # The last hang starts right after a failure's end: both events may come in one read.
    r = run_check(tmp_path, "--dry-run", "--only", "device", "tables", "hbm: auto", "host store: cpu",
                  "--inject", "device=hang", "--inject", "tables=crash", "--inject", "hbm: auto=fail",
                  "--inject", "host store: cpu=hang", "--check-timeout", "3", timeout=120)
    assert r.returncode == 1
    assert time.monotonic() - t0 < 45  # each hang cost its limit, not the hour it sleeps
    checks = {c["check"]: c for c in report(tmp_path)["checks"]}
    assert checks["device"]["status"] == "FAIL" and "timed out after 3 s" in checks["device"]["detail"]
    assert checks["tables"]["status"] == "FAIL" and "SIGSEGV" in checks["tables"]["detail"]
    assert checks["hbm: auto"]["status"] == "FAIL" and "injected failure" in checks["hbm: auto"]["detail"]
    assert "timed out after 3 s" in checks["host store: cpu"]["detail"], checks["host store: cpu"]
    assert "0 passed, 0 skipped, 4 failed of 4 checks" in r.stdout


def test_preflight_that_finds_nothing_can_run_stops_in_seconds(tmp_path):
    t0 = time.monotonic()
    r = run_check(tmp_path, "--dry-run", "--only", "device", "tables", "--inject", "preflight=fatal", timeout=60)
    assert r.returncode == 1 and time.monotonic() - t0 < 20  # no worker started
    assert "preflight: cannot run: injected (--inject preflight=fatal)" in r.stdout
    rep = report(tmp_path)
    assert rep["done"] and [c["detail"] for c in rep["checks"]] == ["not run: preflight: injected (--inject "
                                                                    "preflight=fatal)"] * 2


def test_budget_stops_the_run(tmp_path):
    r = run_check(tmp_path, "--dry-run", "--only", "device", "tables", "--inject", "device=hang", "--budget", "2",
                  timeout=60)
    assert r.returncode == 1
    checks = {c["check"]: c for c in report(tmp_path)["checks"]}
    assert "budget of 2 s was spent" in checks["device"]["detail"]
    assert checks["tables"]["detail"].startswith("not run: the run's budget")


def test_report_is_written_after_each_check(tmp_path):
    env = {**GPU_MACHINE_ENV, "OUT": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--dry-run", "--only", "device", "tables", "--inject",
                             "device=fail", "--inject", "tables=hang", "--check-timeout", "120"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tmp_path)
    try:
        seen = None
        deadline = time.monotonic() + 90  # a busy machine starts Python slowly
        while time.monotonic() < deadline and proc.poll() is None:
            path = tmp_path / "gpu_check_dry.json"
            if path.exists():
                rep = json.loads(path.read_text())
                if rep["checks"]:
                    seen = rep
                    break
            time.sleep(0.1)
        assert seen is not None and proc.poll() is None  # the first result is on disk while the second runs
        assert [c["check"] for c in seen["checks"]] == ["device"] and seen["done"] is False
    finally:
        proc.terminate()  # the parent kills its worker on the way out
        proc.communicate(timeout=60)


@pytest.mark.parametrize("args, message", [
    (["--dry-run", "--only", "no such check"], "no check named 'no such check'"),
    (["--dry-run", "--budget", "0"], "--budget must be > 0 seconds, got 0.0"),
    (["--dry-run", "--check-timeout", "-1"], "--check-timeout must be > 0 seconds, got -1.0"),
])
def test_bad_arguments_exit_2(tmp_path, args, message):
    r = run_check(tmp_path, *args, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"gpu_check: {message}" + ("; `--list` names them" if "named" in message
                                                                         else "")]


def test_speed_floors_pass_at_1_and_fail_at_100():
    from bench.gpu_checks import speed_floor_failures

    rows = [{"batch": "decode", "placement": "hbm", "backend": "cuda", "ids": 6144, "us": 20.0, "vs_copy": 0.3},
            {"batch": "prefill", "placement": "hbm", "backend": "cuda", "ids": 65536, "us": 900.0, "vs_copy": 0.45},
            {"batch": "prefill", "placement": "host", "backend": "cuda", "ids": 65536, "us": 9000.0, "vs_copy": 0.55}]
    assert speed_floor_failures(rows) == []
    assert len(speed_floor_failures(rows, 100)) == 3  # the negative control: every timing misses
    slow = [dict(rows[0], us=26.0), dict(rows[1], vs_copy=0.39), dict(rows[2], vs_copy=0.49)]
    assert len(speed_floor_failures(slow)) == 3
