"""The soak's fault library below the native reader, its token check, and a short soak.

The library (kernels/io/engram_faults.c, `make faults`) is LD_PRELOADed into a subprocess:
a fault there is a failed pread or AIO completion inside kernels/io, under DiskStore's
retries, exactly where a disk would put it. The short soak runs bench/soak.py against a real
`sglang.launch_server` (disk tier, O_DIRECT behind a DRAM row cache) with faults that the
retries absorb: every token must match the reference and no request may fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engram_sglang.core.hashing import EngramLayout
from engram_sglang.core.tablefile import write_tables
from tests.support.tables import small_config

ROOT = Path(__file__).resolve().parents[2]
FAULTS = ROOT / "build" / "kernels" / "libengram_faults.so"
CFG = small_config(400)

pytestmark = pytest.mark.skipif(not FAULTS.is_file(), reason=f"{FAULTS} is not built (make faults)")

# Reads a disk store (O_DIRECT, native AIO, retries 2) call after call and compares every
# call's rows with the table's; prints counts as JSON. argv: tables, arm file, other file,
# tp_rank, tp_size, calls.
STORE_SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np, torch
    from tests.support.tables import small_config
    from engram_sglang.core import rowformat
    from engram_sglang.core.stores import TableIOError, open_store
    from engram_sglang.core.tablefile import open_tables

    root, arm, other, tp_rank, tp_size, calls = sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:])
    cfg = small_config(400)
    table = np.asarray(open_tables(root, cfg)[1])
    store = open_store(root, "disk", cfg=cfg, direct=True, threads=8, retries=2, tp_rank=tp_rank, tp_size=tp_size)[1]
    lo, hi = store.row_range
    gen = torch.Generator().manual_seed(7)

    def call(i):
        if tp_size > 1 and i % 4 == 3:  # none of the ids in this rank's rows
            ids = torch.randint(0, lo, (40,), generator=gen) if lo else torch.randint(hi, table.shape[0], (40,), generator=gen)
        else:
            ids = torch.randint(0, table.shape[0], (40,), generator=gen)
        want = rowformat.dequantize(torch.from_numpy(table[ids.numpy()]))
        want[(ids < lo) | (ids >= hi)] = 0  # other ranks' rows: +0.0, summed in by the all-reduce
        try:
            got = store.gather(ids)
        except TableIOError as e:
            return "failed", str(e)
        same = torch.equal(rowformat.bf16_bits(got), rowformat.bf16_bits(want))
        return ("exact" if same else "wrong"), ""

    out = {{"unarmed": [call(i)[0] for i in range(5)]}}
    open(arm, "w").close()
    time.sleep(0.05)  # the library looks for the arm file every 20 ms
    fd = os.open(other, os.O_RDONLY)  # not a table file: its preads are never touched
    out["other_reads_ok"] = all(len(os.pread(fd, 16, 0)) == 16 for _ in range(200))
    results = [call(i) for i in range(calls)]
    out["outcomes"] = [r[0] for r in results]
    out["errors"] = [r[1] for r in results if r[1]]
    print(json.dumps(out))
""")


def load_soak():
    from bench import soak

    return soak


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    gen = torch.Generator().manual_seed(3)
    rows = {L: torch.randint(0, 256, (EngramLayout(CFG).rows(L), 264), dtype=torch.uint8, generator=gen).numpy()
            for L in CFG.layer_ids}
    return write_tables(tmp_path_factory.mktemp("soak-tables") / "t", CFG, rows, progress=False)


def run_store(tables, tmp_path, faults: dict, *, tp_rank=0, tp_size=1, calls=120) -> tuple[dict, dict]:
    stats = tmp_path / "stats"
    stats.mkdir()
    other = tmp_path / "other.bin"
    other.write_bytes(os.urandom(4096))
    env = dict(os.environ, LD_PRELOAD=str(FAULTS), ENGRAM_FAULTS_STATS_DIR=str(stats),
               ENGRAM_FAULTS_ARM=str(tmp_path / "armed"), **faults)
    script = STORE_SCRIPT.format()
    proc = subprocess.run([sys.executable, "-c", script, str(tables), str(tmp_path / "armed"), str(other),
                           str(tp_rank), str(tp_size), str(calls)], env=env, capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), load_soak().fault_counts(stats)


def test_bursts_within_the_retries_and_stalls_leave_every_row_exact(tables, tmp_path):
    """15 ms outages (every table read fails) every 100 ms and 5 ms stalls, on rank 1 of 2 (a
    quarter of the calls have no ids in its rows): the store's AIO read and first pread fail
    inside an outage, its later tries (after 10 + 20 ms of back-off) get through, so every
    call returns the table's bits (with retries=0 about one call in ten fails here); faults
    reached both AIO completions and preads; nothing was injected before arming or into
    another file."""
    out, counts = run_store(tables, tmp_path, {"ENGRAM_FAULTS_EIO_EVERY": "1", "ENGRAM_FAULTS_EIO_BURST_MS": "15",
                                               "ENGRAM_FAULTS_EIO_GAP_MS": "100", "ENGRAM_FAULTS_STALL_PROB": "0.05",
                                               "ENGRAM_FAULTS_STALL_MS": "5"}, tp_rank=1, tp_size=2)
    assert out["unarmed"] == ["exact"] * 5
    assert out["other_reads_ok"]
    assert out["outcomes"] == ["exact"] * 120, (out["errors"][:3], counts)
    assert counts["eio_bursts"] >= 2 and counts["eio_injected"] >= counts["eio_bursts"], counts
    assert counts["aio_events"] > 0 and counts["pread_calls"] > 0 and counts["stalls"] > 0, counts
    assert counts["stall_us"] == 5000 * counts["stalls"]


def test_an_outage_longer_than_the_retries_fails_only_the_calls_that_read_in_it(tables, tmp_path):
    """One 300 ms outage (every table read fails): the calls that read during it raise
    TableIOError naming the file and the errno (never rows filled with zeros), the calls
    after it are exact again."""
    out, counts = run_store(tables, tmp_path, {"ENGRAM_FAULTS_EIO_EVERY": "200", "ENGRAM_FAULTS_EIO_BURST_MS": "300",
                                               "ENGRAM_FAULTS_EIO_GAP_MS": "1000000"})
    outcomes = out["outcomes"]
    assert "wrong" not in outcomes
    assert outcomes.count("failed") >= 1 and counts["eio_bursts"] == 1, (outcomes, counts)
    assert all("layer-1.rows" in e and "Input/output error" in e and "after 3 tries" in e for e in out["errors"])
    last_failed = max(i for i, o in enumerate(outcomes) if o == "failed")
    assert outcomes[last_failed + 1:] and set(outcomes[last_failed + 1:]) == {"exact"}


@pytest.mark.parametrize("name, value", [("ENGRAM_FAULTS_EIO_PROB", "0.5x"), ("ENGRAM_FAULTS_STALL_PROB", "1.5"),
                                         ("ENGRAM_FAULTS_STALL_MS", "-50")])
def test_a_bad_setting_stops_the_process_with_one_line(name, value):
    """A setting the library cannot honour is refused, not read as 0 (a soak would then report
    faults it never injected)."""
    proc = subprocess.run(["/bin/true"], env=dict(os.environ, LD_PRELOAD=str(FAULTS), **{name: value}),
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"engram_faults: {name}={value}: expected a number in [0, "
                                                + ("1]" if "PROB" in name else "1e+12]")]


# ------------------------------------------------------------------ the soak itself
@pytest.mark.slow
def test_token_check_finds_a_wrong_token():
    """The soak's verdict on served tokens: the greedy completion and its prefixes pass, the
    same completion with one token changed fails."""
    from tests.support.demo_support import demo_dir, reference_completion

    soak = load_soak()
    prompt = [5, 6, 7, 8, 9, 10, 11]
    good = list(reference_completion(tuple(prompt), 4))
    bad = good[:2] + [(good[2] + 1) % 1500] + good[3:]
    requests = [{"item": 0, "output_ids": good}, {"item": 0, "output_ids": good[:2]}, {"item": 0, "output_ids": bad},
                {"item": 0, "output_ids": []}]
    runs = [{"requests": requests}]
    soak.check_tokens(runs, [(prompt, 4)], demo_dir())
    assert [r["tokens_ok"] for r in requests] == [True, True, False, True]


@pytest.mark.slow
def test_short_soak_on_real_sglang_serves_exactly_under_absorbed_faults(tmp_path):
    """bench/soak.py for 20 s: 32 streaming clients (some disconnect, some abort) against the
    disk tier with EIO bursts and 50 ms stalls below the reader. Faults were injected, no
    request failed, every received token is the reference's, the server still serves, and
    its open fds and shared memory do not grow."""
    from tests.support.demo_support import demo_dir

    proc = subprocess.run([sys.executable, "-m", "bench.soak", "--minutes", "0.33", "--placements",
                           "disk", "--pool", "12", "--warmup", "4", "--sample-s", "1", "--model-dir", str(demo_dir()),
                           "--workdir", str(tmp_path / "work"), "--out", str(tmp_path), "--eio-gap-ms", "300",
                           "--stall-prob", "0.02"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    report = json.loads((tmp_path / "soak.json").read_text())
    s = report["summary"][0]
    assert (tmp_path / "soak.png").stat().st_size > 10_000
    assert s["eio_injected"] > 0 and s["stalls"] > 0, s
    assert s["requests"] >= 32 and s["completed"] > 0 and s["disconnected"] + s["aborted"] > 0, s
    assert s["failed"] == 0 and s["lost"] == 0 and s["wrong_outside_failed"] == 0 and s["wrong_in_failed"] == 0, s
    assert s["tokens"] > 100 and s["served_after"] and s["contained"], s
    assert s["growth"]["fds"] <= 2 and abs(s["growth"]["shm_mib"]) < 1, s
    assert proc.returncode == 0, proc.stdout[-2000:]
