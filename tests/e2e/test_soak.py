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
    store = open_store(root, "disk", cfg=cfg, direct=True, threads=8, retries=2, tp_rank=tp_rank, tp_size=tp_size,
                       shards="contiguous")[1]  # one range: the ids below stay outside it
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


# ------------------------------------------------------------------ write and short-read faults
# argv: matched dir, unmatched dir. Prints what each call did, as JSON.
WRITE_SCRIPT = textwrap.dedent("""
    import errno, json, os, sys
    from pathlib import Path

    full, other = Path(sys.argv[1]), Path(sys.argv[2])

    def attempt(fn):
        try:
            fn()
            return "ok"
        except OSError as e:
            return errno.errorcode[e.errno]

    def appended(path):
        with open(path, "a") as f:
            f.write("x\\n")

    def raw(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.write(fd, b"abc")
        finally:
            os.close(fd)

    def synced(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    out = {}
    for name, where in (("full", full), ("other", other)):
        out[name] = {"write_text": attempt(lambda: (where / "stats.json").write_text("{}")),
                     "append": attempt(lambda: appended(where / "trace.jsonl")),
                     "os_write": attempt(lambda: raw(where / "raw.bin")),
                     "fsync": attempt(lambda: synced(where / "raw.bin"))}
    print(json.dumps(out))
""")

# argv: matched file, unmatched file, O_DIRECT (0/1). Prints the lengths each call returned.
SHORT_SCRIPT = textwrap.dedent("""
    import json, mmap, os, sys

    matched, other, direct = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    want = open(matched, "rb").read()
    fd = os.open(matched, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    ofd = os.open(other, os.O_RDONLY)
    buf = mmap.mmap(-1, len(want))  # page-aligned, as O_DIRECT needs
    view = memoryview(buf)

    def pread(n, offset):  # os.pread's own buffer is not aligned: read into the mapping
        got = os.preadv(fd, [view[:n]], offset) if direct else None
        return bytes(buf[:got]) if direct else os.pread(fd, n, offset)

    out = {"pread": [], "preadv": [], "prefix_ok": True, "other": [],
           "one_byte": None if direct else len(os.pread(fd, 1, 0))}
    for _ in range(50):
        got = pread(len(want), 0)
        out["pread"].append(len(got))
        out["prefix_ok"] &= got == want[:len(got)]
        n = os.preadv(fd, [view[:4096], view[4096:]], 0)
        out["preadv"].append(n)
        out["prefix_ok"] &= bytes(buf[:n]) == want[:n]
        out["other"].append(len(os.pread(ofd, len(want), 0)))
    # Read again until done, as a reader must: the whole file, exactly.
    got = b""
    while len(got) < len(want):
        got += pread(len(want) - len(got), len(got))
    out["reread_ok"] = got == want
    print(json.dumps(out))
""")


def run_preloaded(script: str, argv: list, env: dict, stats: Path) -> tuple[dict, dict]:
    stats.mkdir(exist_ok=True)
    proc = subprocess.run([sys.executable, "-c", script, *map(str, argv)], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, LD_PRELOAD=str(FAULTS), ENGRAM_FAULTS_STATS_DIR=str(stats), **env))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), load_soak().fault_counts(stats)


def write_dirs(tmp_path) -> tuple[Path, Path]:
    (tmp_path / "full").mkdir()
    (tmp_path / "other").mkdir()
    return tmp_path / "full", tmp_path / "other"


def test_writes_to_matched_files_fail_with_enospc_and_others_are_untouched(tmp_path):
    """ENGRAM_FAULTS_WRITE_MATCH with WRITE_EVERY=1: write_text, open("a").write, os.write and
    fsync on the matched directory's files fail with ENOSPC (counted); the same calls on another
    directory succeed."""
    full, other = write_dirs(tmp_path)
    out, counts = run_preloaded(WRITE_SCRIPT, [full, other], {"ENGRAM_FAULTS_WRITE_MATCH": f"{full}/",
                                                              "ENGRAM_FAULTS_WRITE_EVERY": "1"}, tmp_path / "stats")
    assert out["full"] == {"write_text": "ENOSPC", "append": "ENOSPC", "os_write": "ENOSPC", "fsync": "ENOSPC"}
    assert out["other"] == {"write_text": "ok", "append": "ok", "os_write": "ok", "fsync": "ok"}
    assert counts["enospc_injected"] >= 4 and counts["enospc_bursts"] == counts["enospc_injected"], counts
    assert counts["write_calls"] == counts["enospc_injected"], counts
    assert (other / "stats.json").read_text() == "{}" and (other / "raw.bin").read_bytes() == b"abc"


def test_without_a_write_match_no_write_fails(tmp_path):
    """The negative control: the same schedule without ENGRAM_FAULTS_WRITE_MATCH fails nothing
    (writes are off unless asked for, whatever the read match)."""
    full, other = write_dirs(tmp_path)
    out, counts = run_preloaded(WRITE_SCRIPT, [full, other], {"ENGRAM_FAULTS_WRITE_EVERY": "1",
                                                              "ENGRAM_FAULTS_MATCH": "full"}, tmp_path / "stats")
    assert set(out["full"].values()) == {"ok"} and set(out["other"].values()) == {"ok"}
    assert counts.get("enospc_injected", 0) == 0


def test_an_enospc_burst_counts_matched_writes(tmp_path):
    """WRITE_EVERY=4, WRITE_BURST=2: the 4th and 5th matched calls fail (the write_text of the
    second directory pass is not matched, so it never moves the count)."""
    full, other = write_dirs(tmp_path)
    out, counts = run_preloaded(WRITE_SCRIPT, [full, other], {"ENGRAM_FAULTS_WRITE_MATCH": f"{full}/",
                                                              "ENGRAM_FAULTS_WRITE_EVERY": "4",
                                                              "ENGRAM_FAULTS_WRITE_BURST": "2"}, tmp_path / "stats")
    # write_text: 1 write; append: 1 write (at close); os_write: 1; fsync: 1 -> the 4th call fails.
    assert out["full"] == {"write_text": "ok", "append": "ok", "os_write": "ok", "fsync": "ENOSPC"}, out
    assert set(out["other"].values()) == {"ok"}
    assert counts["enospc_bursts"] == 1 and counts["enospc_injected"] == 1 and counts["write_calls"] == 4, counts


@pytest.mark.parametrize("direct", [False, True])
def test_short_reads_return_a_prefix_of_what_was_read(tmp_path, direct):
    """SHORT_EVERY=1: every matched pread/preadv of more than one byte (O_DIRECT: more than a
    page) returns a random shorter prefix (>= 1 byte; O_DIRECT: whole pages) of the file's bytes;
    reading again until done gets the whole file exactly; an unmatched file reads whole."""
    data = os.urandom(3 * 4096)
    (tmp_path / "layer-0.rows").write_bytes(data)
    (tmp_path / "other.bin").write_bytes(data)
    out, counts = run_preloaded(SHORT_SCRIPT, [tmp_path / "layer-0.rows", tmp_path / "other.bin", int(direct)],
                                {"ENGRAM_FAULTS_SHORT_EVERY": "1"}, tmp_path / "stats")
    lengths = out["pread"] + out["preadv"]
    assert all(1 <= n < len(data) for n in lengths), lengths
    assert len(set(lengths)) > 1 and out["prefix_ok"] and out["reread_ok"]
    if direct:
        assert all(n % 4096 == 0 for n in lengths), lengths
    assert out["other"] == [len(data)] * 50
    assert out["one_byte"] == (None if direct else 1)
    assert counts["short_reads"] >= 100 and counts["eio_injected"] == 0, counts


def test_without_a_short_schedule_reads_are_whole(tmp_path):
    """The negative control: the same reads with the library loaded but no short schedule."""
    data = os.urandom(3 * 4096)
    (tmp_path / "layer-0.rows").write_bytes(data)
    (tmp_path / "other.bin").write_bytes(data)
    out, counts = run_preloaded(SHORT_SCRIPT, [tmp_path / "layer-0.rows", tmp_path / "other.bin", 0], {},
                                tmp_path / "stats")
    assert out["pread"] == out["preadv"] == [len(data)] * 50
    assert counts.get("short_reads", 0) == 0 and counts["pread_calls"] >= 100, counts


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
    disk tier with EIO bursts and 50 ms stalls below the reader, and one out-of-range token id
    request (the other side classes start processes: left to `make soak`). Faults were
    injected, no request failed, every received token is the reference's, the bad id got HTTP
    400, the server still serves, and its open fds and shared memory do not grow."""
    from tests.support.demo_support import demo_dir

    proc = subprocess.run([sys.executable, "-m", "bench.soak", "--minutes", "0.33", "--placements",
                           "disk", "--pool", "12", "--warmup", "4", "--sample-s", "1", "--model-dir", str(demo_dir()),
                           "--workdir", str(tmp_path / "work"), "--out", str(tmp_path), "--eio-gap-ms", "300",
                           "--stall-prob", "0.02", "--classes", "badid"], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    report = json.loads((tmp_path / "soak.json").read_text())
    s = report["summary"][0]
    assert (tmp_path / "soak.png").stat().st_size > 10_000
    assert s["eio_injected"] > 0 and s["stalls"] > 0, s
    assert s["requests"] >= 32 and s["completed"] > 0 and s["disconnected"] + s["aborted"] > 0, s
    assert s["failed"] == 0 and s["lost"] == 0 and s["wrong_outside_failed"] == 0 and s["wrong_in_failed"] == 0, s
    assert s["tokens"] > 100 and s["served_after"] and s["contained"], s
    assert s["growth"]["fds"] <= 2 and abs(s["growth"]["shm_mib"]) < 1, s
    # One out-of-range id request (10 s in): HTTP 400, and the known prompt after it served.
    assert s["bad_id_requests"] == 1 and s["bad_id_400"] == 1 and s["served_after_bad_id"] == 1, s
    assert s["held"] == {"enospc": None, "badid": True, "short": None, "lock": None}, s
    assert proc.returncode == 0, proc.stdout[-2000:]
