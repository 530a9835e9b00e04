"""Soak under faults: real `sglang.launch_server`, 32 streaming clients, read faults below the reader.

For each placement (`disk`: O_DIRECT reads behind a small DRAM row cache, so reads keep
going to the file; `host`: one shared copy in /dev/shm) it starts the demo model's server
with `build/kernels/libengram_faults.so` preloaded (kernels/io/engram_faults.c: EIO bursts
and stalls injected inside pread and native AIO, only on the table files, only while an arm
file exists), warms it up, arms the faults, and runs `--clients` threads against
127.0.0.1 for `--minutes`: each sends greedy streaming requests (mixed prompt lengths and
lengths of completion) and either reads them to the end, disconnects mid-stream, or aborts
them through /abort_request. Meanwhile it samples RSS, open file descriptors and shared
memory of every server process from /proc.

Afterwards every token any request received is checked against the demo model's reference
forward (teacher-forced: one forward per distinct completion proves it is the greedy one),
and the report says: requests by outcome, faults injected (the library's own counters),
read attempts the store retried, calls that failed after their retries, requests that
failed with an error finish reason while the server kept serving ("contained"), wrong
tokens, p50/p99 latency, and RSS / fds / shm growth between the steady part's start and
the end of the run.

Faults by default are ones the disk store's retries absorb (an outage of `--eio-burst-ms`
every `--eio-gap-ms`, shorter than its back-off between tries): served tokens must stay
exact and no request may fail. `--hard-faults` injects outages of `--hard-burst-ms` that
outlast every try: reads then fail for real, and the report counts the requests that failed
with an error finish reason and whether the server kept serving ("contained").

Beside the read faults, the fault classes of `--classes` (all by default):
* enospc: the server writes --engram-stats-file and --engram-trace into a directory whose
  writes get ENOSPC (the library's write faults: a full disk for `--enospc-burst-ms` once per
  `--enospc-gap-ms`); the server must keep serving (its log's warnings, the injected count and
  any temp files left beside the targets are reported).
* short: the server's table preads return short now and then (`--short-prob`); and once per
  round a separate process opens the tables with short reads from its first header read on
  (`--short-open-prob`) and compares rows of its filled host copy with the file's.
* lock (host placement): once per round a helper takes the shared copy's `.lock` with the
  project's lock() and freezes itself (SIGSTOP) for `--freeze-s`; meanwhile a second process
  opens the same copy (what a server starting on the node does; a serving server takes the
  lock only to open and to leave its copy). Reported: how long it waited, the lines it logged
  about the lock, and whether it opened once the holder was thawed (SIGCONT). The copy lives in
  a /dev/shm directory of the soak's own, so no other server on the node is stalled.
* badid: once per round a request with an out-of-range token id (-1, the vocabulary size, and
  through /v1/completions): it must get HTTP 400, and a known prompt right after it must be
  served (its tokens are checked with the rest).
A round starts 10 s after arming and then every `--side-every-s`.

Prints a table, writes OUT/NAME.json and OUT/NAME.png (RSS, fds, shm and latency over time).

    python -m bench.soak [--minutes 2] [--placements disk,host] [--clients 32] [--hard-faults]
                         [--classes enospc,short,lock,badid]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from bench.common import OUT, machine, print_table
from engram_sglang.serving.launch import Server, _group_members

ROOT = Path(__file__).resolve().parents[1]
FAULTS_LIB = ROOT / "build" / "kernels" / "libengram_faults.so"
PROMPT_LENGTHS = (3, 8, 16, 33, 64, 100, 150)
NEW_TOKENS = (4, 8, 16, 32)
REQUEST_TIMEOUT_S = 120.0  # one request, start to last chunk: a client never waits longer
RETRIES = 2  # --engram-disk-retries of the soak's disk server
CLASSES = ("enospc", "short", "lock", "badid")  # the fault classes beside the read faults (--classes)


# ------------------------------------------------------------------ workload
def prompt_pool(tokenizer, n: int, seed: int) -> list[tuple[list[int], int]]:
    """n (prompt ids, new tokens) pairs cut from offline text at seeded places."""
    from engram_sglang.tools.demo.run import demo_corpus

    ids = tokenizer("\n".join(demo_corpus(200_000)[1:]))["input_ids"]
    rng = random.Random(seed)
    pool = []
    for i in range(n):
        length = PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)]
        start = rng.randrange(0, len(ids) - length)
        pool.append((ids[start:start + length], NEW_TOKENS[(i // len(PROMPT_LENGTHS) + i) % len(NEW_TOKENS)]))
    return pool


@dataclass
class Result:
    client: int
    item: int  # index into the pool
    kind: str  # full | disconnect | abort
    outcome: str = "lost"  # completed | disconnected | aborted | failed | lost | cut (by the soak's end)
    output_ids: list = field(default_factory=list)
    t_start: float = 0.0
    t_first: Optional[float] = None
    t_end: float = 0.0
    message: str = ""


def stream_request(port: int, rid: str, prompt: list[int], new: int, kind: str, cut: int, res: Result,
                   live: dict, stop: threading.Event) -> None:
    """One streaming /generate request; `kind` says whether the client reads it to the end,
    closes the connection after `cut` chunks, or aborts it by rid after `cut` chunks. The
    connection is in `live` while it is open: at the soak's end the main thread shuts it
    down (outcome "cut"), so no client outlives the soak by a request."""
    body = json.dumps({"input_ids": prompt, "rid": rid, "stream": True,
                       "sampling_params": {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S / 2)
    deadline = res.t_start + REQUEST_TIMEOUT_S
    try:
        conn.connect()
        live[res.client] = conn.sock
        if stop.is_set():
            raise ConnectionAbortedError("the soak ended")
        conn.request("POST", "/generate", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            res.outcome, res.message = "failed", f"HTTP {resp.status}: {resp.read(300).decode(errors='replace')}"
            return
        chunks, aborted = 0, False
        while time.monotonic() < deadline:
            line = resp.readline()
            if not line:
                if stop.is_set():
                    res.outcome = "cut"
                res.message = "stream ended without [DONE]"
                return
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                break
            out = json.loads(line[6:])
            if "error" in out:
                res.outcome, res.message = "failed", str(out["error"].get("message", out["error"]))[:300]
                res.t_end = time.monotonic()
                return
            res.output_ids = list(out.get("output_ids") or res.output_ids)  # cumulative (SGLang's default)
            if res.t_first is None and res.output_ids:
                res.t_first = time.monotonic()
            chunks += 1
            finish = (out.get("meta_info") or {}).get("finish_reason")
            if finish:
                res.t_end = time.monotonic()
                if finish.get("type") == "abort":
                    res.outcome = "aborted" if aborted else "failed"
                    res.message = str(finish.get("message", ""))[:300]
                else:
                    res.outcome = "completed" if len(res.output_ids) == new else "failed"
                continue
            if kind == "disconnect" and chunks >= cut:
                res.outcome, res.t_end = "disconnected", time.monotonic()
                return  # the finally closes the socket mid-stream
            if kind == "abort" and chunks >= cut and not aborted:
                aborted = True
                abort = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                try:
                    abort.request("POST", "/abort_request", body=json.dumps({"rid": rid}),
                                  headers={"Content-Type": "application/json"})
                    abort.getresponse().read()
                finally:
                    abort.close()
        else:
            res.message = f"no end after {REQUEST_TIMEOUT_S:.0f} s"
    except (OSError, http.client.HTTPException, ValueError) as e:
        res.outcome, res.message = ("cut" if stop.is_set() else "lost"), f"{type(e).__name__}: {e}"[:300]
    finally:
        live.pop(res.client, None)
        conn.close()
        if not res.t_end:
            res.t_end = time.monotonic()


def client_loop(index: int, port: int, pool, stop: threading.Event, deadline: float, seed: int,
                results: list, lock: threading.Lock, live: dict) -> None:
    """Requests one after another until the deadline (or the server died)."""
    rng = random.Random(seed * 1000 + index)
    n = 0
    while not stop.is_set() and time.monotonic() < deadline:
        item = rng.randrange(len(pool))
        prompt, new = pool[item]
        roll = rng.random()
        kind = "full" if roll < 0.7 else ("disconnect" if roll < 0.85 else "abort")
        res = Result(client=index, item=item, kind=kind, t_start=time.monotonic())
        stream_request(port, f"soak-{seed}-{index}-{n}", prompt, new, kind, rng.randrange(1, new), res, live, stop)
        with lock:
            results.append(res)
        n += 1
        if res.outcome == "lost":
            stop.wait(0.5)  # the server may be gone: the sampler decides; do not spin


# ------------------------------------------------------------------ /proc sampling
def _status_kib(pid: int, key: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _shm_paths(pid: int) -> set[str]:
    """/dev/shm files a process holds open or mapped."""
    paths = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("/dev/shm/"):
                paths.add(target)
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                    paths.add(parts[5].strip().removesuffix(" (deleted)"))
    except OSError:
        pass
    return paths


def sample_processes(pgid: int) -> dict:
    """RSS, shared-memory RSS and open fds summed over the server's processes, and the bytes
    of the /dev/shm files they hold."""
    rss = shm_rss = fds = 0
    shm = set()
    pids = _group_members(pgid)
    for pid in pids:
        rss += _status_kib(pid, "VmRSS")
        shm_rss += _status_kib(pid, "RssShmem")
        try:
            fds += len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            pass
        shm |= _shm_paths(pid)
    shm_bytes = 0
    for p in shm:
        try:
            shm_bytes += os.stat(p).st_size
        except OSError:
            pass
    return {"procs": len(pids), "rss_mib": rss / 1024, "shm_rss_mib": shm_rss / 1024, "fds": fds,
            "shm_files": len(shm), "shm_mib": shm_bytes / 2**20}


def fault_counts(stats_dir: Path) -> dict:
    """The fault library's counters, summed over every process that wrote some."""
    total: dict = {}
    for path in stats_dir.glob("faults-*.bin"):
        data = path.read_bytes()
        header = data[:256].split(b"\n", 1)[0].decode()
        names = header.split("fields=", 1)[1].split(",")
        for k, name in enumerate(names):
            total[name] = total.get(name, 0) + int.from_bytes(data[256 + 8 * k:264 + 8 * k], "little")
    return total


# ------------------------------------------------------------------ the side fault classes
# A helper that takes a shared copy's `.lock` with the project's own lock() and freezes itself
# (SIGSTOP) holding it, as a filler under a cgroup freezer or `docker pause` would.
HOLDER_SCRIPT = """
import os, signal, sys
from pathlib import Path
from engram_sglang.core.stores.shmcopy import lock
fd = lock(Path(sys.argv[1]))
print("held", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
os.close(fd)
"""

# A second, short-lived process opening the same tables as a shared host copy (what a server
# starting on the node does): it waits on the `.lock` while the holder is frozen.
OPENER_SCRIPT = """
import json, logging, sys, time
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
import torch
from engram_sglang.core.stores import open_store
print("ready", flush=True)  # imported: the open (and its wait) starts now
t = time.monotonic()
stores = open_store(sys.argv[1], "host", shared=True, shm_dir=sys.argv[2])
opened = time.monotonic() - t
rows = next(iter(stores.values())).gather(torch.arange(8))
print(json.dumps({"open_s": opened, "rows": list(rows.shape)}), flush=True)
"""

# Opens the tables under short reads from the start (headers, the host fill's preadv) and
# compares rows gathered from the filled host copy with the mapped file's.
SHORT_OPEN_SCRIPT = """
import json, sys
import torch
from engram_sglang.core import rowformat
from engram_sglang.core.stores import open_store
from engram_sglang.core.tablefile import open_tables
import numpy as np
stores = open_store(sys.argv[1], "host")
tables = open_tables(sys.argv[1])
gen = torch.Generator().manual_seed(int(sys.argv[2]))
same = True
for layer, store in stores.items():
    table = np.asarray(tables[layer])
    ids = torch.randint(0, table.shape[0], (64,), generator=gen)
    want = rowformat.dequantize(torch.from_numpy(table[ids.numpy()]))
    same &= torch.equal(rowformat.bf16_bits(store.gather(ids)), rowformat.bf16_bits(want))
print(json.dumps({"exact": bool(same)}), flush=True)
"""


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def _python(script: str, *argv, env: Optional[dict] = None, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *map(str, argv)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})), **kw)


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


def frozen_lock_round(copy: Path, table_dir: Path, shm_dir: Path, freeze_s: float) -> dict:
    """One frozen holder of `copy`'s lock and a second process opening the copy, thawed
    `freeze_s` after the opener's open began: how long the open took (open_s: the wait, then
    the attach), the lines it logged about the lock, and its outcome."""
    holder = _python(HOLDER_SCRIPT, copy)
    out = {"copy": copy.name, "holder_pid": holder.pid}
    opener = None
    try:
        held = holder.stdout.readline().strip() == "held"
        deadline = time.monotonic() + 60
        while held and not _stopped(holder.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not held or not _stopped(holder.pid):
            out.update(outcome="holder failed", message=_last_line(holder.stderr.read() if holder.poll() is not None
                                                                   else ""))
            return out
        t0 = time.monotonic()
        opener = _python(OPENER_SCRIPT, table_dir, shm_dir)
        # Imports take seconds on a loaded machine: the freeze is counted from the open's start.
        out["opener_ready"] = opener.stdout.readline().strip() == "ready"
        out["import_s"] = time.monotonic() - t0
        time.sleep(freeze_s)
        out["opener_done_while_frozen"] = opener.poll() is not None
        os.kill(holder.pid, signal.SIGCONT)
        t_cont = time.monotonic()
        try:
            stdout, stderr = opener.communicate(timeout=120 + freeze_s)
        except subprocess.TimeoutExpired:
            opener.kill()
            stdout, stderr = opener.communicate()
            out["timed_out"] = True
        t_end = time.monotonic()
        lock_lines = [ln for ln in stderr.splitlines() if ".lock" in ln or "lock" in ln.lower()]
        out.update(rc=opener.returncode, wall_s=t_end - t0, after_cont_s=t_end - t_cont, lock_lines=len(lock_lines),
                   lock_line_examples=[ln[:200] for ln in lock_lines[:2]])
        ok = opener.returncode == 0 and stdout.strip()
        out["outcome"] = "opened" if ok else "failed"
        if ok:
            out["open_s"] = json.loads(stdout.strip().splitlines()[-1])["open_s"]
        else:
            out["message"] = _last_line(stderr)
        return out
    finally:
        for proc in (holder, opener):
            if proc is not None and proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                proc.kill()
                proc.wait()


def short_open_round(table_dir: Path, stats_dir: Path, seed: int, prob: float) -> dict:
    """A process opening the tables with short reads from its first pread on."""
    env = {"LD_PRELOAD": str(FAULTS_LIB), "ENGRAM_FAULTS_STATS_DIR": str(stats_dir), "ENGRAM_FAULTS_MATCH": ".rows",
           "ENGRAM_FAULTS_SEED": str(seed), "ENGRAM_FAULTS_SHORT_PROB": str(prob)}
    proc = _python(SHORT_OPEN_SCRIPT, table_dir, seed, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    if proc.returncode == 0 and stdout.strip():
        return {"outcome": "exact" if json.loads(stdout.strip().splitlines()[-1])["exact"] else "wrong"}
    return {"outcome": "failed", "message": _last_line(stderr)}


def bad_id_request(port: int, vocab: int, k: int) -> dict:
    """One request with an out-of-range token id (cycling -1, the vocabulary size, and the same
    through /v1/completions): it must get HTTP 400 and nothing else."""
    if k % 3 == 2:
        path, body = "/v1/completions", {"model": "default", "prompt": [5, vocab, 7], "max_tokens": 2}
    else:
        path, body = "/generate", {"input_ids": [5, -1 if k % 3 == 0 else vocab, 7],
                                   "sampling_params": {"max_new_tokens": 2}}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return {"path": path, "id": body.get("input_ids", body.get("prompt"))[1], "status": resp.status,
                "body": resp.read(300).decode(errors="replace")}
    except (OSError, http.client.HTTPException) as e:
        return {"path": path, "status": None, "body": f"{type(e).__name__}: {e}"[:300]}
    finally:
        conn.close()


def server_copies(shm_dir: Path, pids: list[int]) -> list[Path]:
    """The shared copies in the soak's own `shm_dir`, those one of `pids` holds first (where
    /proc/locks tells), lowest layer first (the one a second opener waits on first)."""
    from engram_sglang.core.stores.shmadmin import list_copies

    copies = [c for c in list_copies(shm_dir) if "holders" in c]
    copies.sort(key=lambda c: (not (c["holders"] and set(c["holders"]) & set(pids)), c["layer"]))
    return [shm_dir / c["name"] for c in copies]


def side_faults(name: str, server, model_dir: Path, shm_dir: Optional[Path], work: Path, args, vocab: int, pool,
                t0: float, deadline: float, stop: threading.Event, side: dict, lock: threading.Lock,
                results: list) -> None:
    """The fault classes beside the clients, one round each per `--side-every-s` (the first 10 s
    in): an out-of-range id request followed by a known prompt, a short-read open and, on the
    host placement, a frozen lock holder with a second opener."""
    from engram_sglang.tools.demo.model import TABLE_DIR_NAME

    table_dir = model_dir / TABLE_DIR_NAME
    k, next_t = 0, t0 + 10
    while not stop.wait(max(0.0, next_t - time.monotonic())) and time.monotonic() < deadline - 5:
        if "badid" in args.classes:
            bad = bad_id_request(server.port, vocab, k)
            bad["t"] = time.monotonic() - t0
            # The server must go on serving exact tokens: a known prompt right after, checked with the rest.
            prompt, new = pool[k % len(pool)]
            res = Result(client=-2, item=k % len(pool), kind="full", t_start=time.monotonic())
            stream_request(server.port, f"soak-after-bad-{k}", prompt, new, "full", new, res, {}, stop)
            bad["after"] = res.outcome
            with lock:
                results.append(res)
                side["bad_ids"].append(bad)
        if "short" in args.classes and not stop.is_set():
            side["short_opens"].append(short_open_round(table_dir, work / "faults-open", args.seed + k,
                                                        args.short_open_prob))
        if "lock" in args.classes and shm_dir is not None and not stop.is_set():
            copies = server_copies(shm_dir, _group_members(server.proc.pid))
            if copies:
                side["frozen_locks"].append(frozen_lock_round(copies[0], table_dir, shm_dir, args.freeze_s))
            else:
                side["frozen_locks"].append({"outcome": "no copy held by the server"})
        k += 1
        next_t = t0 + 10 + k * args.side_every_s


def side_summary(side: dict, write_dir: Path, faults: dict, classes: tuple) -> dict:
    bad, opens, locks = side["bad_ids"], side["short_opens"], side["frozen_locks"]
    leftovers = sorted(p.name for p in write_dir.iterdir() if p.name not in ("stats.json", "trace.jsonl")) \
        if write_dir.is_dir() else []
    trace = write_dir / "trace.jsonl"
    return {
        "bad_id_requests": len(bad), "bad_id_400": sum(b["status"] == 400 for b in bad),
        "bad_id_other": [f"{b['path']} id {b.get('id')}: {b['status']} {b['body'][:120]}" for b in bad
                         if b["status"] != 400][:3],
        "served_after_bad_id": sum(b["after"] == "completed" for b in bad),
        "enospc_injected": faults.get("enospc_injected", 0), "enospc_bursts": faults.get("enospc_bursts", 0),
        "write_calls_matched": faults.get("write_calls", 0), "write_leftovers": leftovers[:5],
        "trace_bytes": trace.stat().st_size if trace.exists() else 0,
        "short_reads": faults.get("short_reads", 0),
        "short_opens": len(opens), "short_opens_exact": sum(o["outcome"] == "exact" for o in opens),
        "short_open_failures": sorted({o.get("message", o["outcome"]) for o in opens if o["outcome"] != "exact"})[:3],
        "frozen_locks": len(locks), "frozen_lock_opened": sum(x.get("outcome") == "opened" for x in locks),
        "frozen_lock_wait_lines": sum(x.get("lock_lines", 0) for x in locks),
        "frozen_lock_max_wait_s": max((x.get("open_s", 0.0) for x in locks), default=None),
        "frozen_lock_outcomes": [{k: v for k, v in x.items() if k != "holder_pid"} for x in locks][:3],
        # Per class: None where it did not run, else whether it held.
        # enospc: injected, and the server lived through it (set by summarize, which knows that).
        "held": {"enospc": None if "enospc" not in classes else bool(faults.get("enospc_injected", 0)),
                 "badid": None if not bad else all(b["status"] == 400 and b["after"] == "completed" for b in bad),
                 "short": None if "short" not in classes else (not opens or all(o["outcome"] == "exact" for o in opens)),
                 "lock": None if not locks else all(x.get("outcome") == "opened" for x in locks)},
    }


# ------------------------------------------------------------------ one server
def fault_env(args, stats_dir: Path, arm: Path, write_dir: Path) -> dict:
    env = {"LD_PRELOAD": str(FAULTS_LIB), "ENGRAM_FAULTS_STATS_DIR": str(stats_dir), "ENGRAM_FAULTS_ARM": str(arm),
           "ENGRAM_FAULTS_MATCH": ".rows", "ENGRAM_FAULTS_SEED": str(args.seed),
           "ENGRAM_FAULTS_STALL_PROB": str(args.stall_prob), "ENGRAM_FAULTS_STALL_MS": str(args.stall_ms),
           "ENGRAM_FAULTS_EIO_EVERY": "1"}
    # Outages: every table read fails for BURST_MS, one per GAP_MS while reads flow. A short
    # one fails a call's AIO read and first pread, and its later tries (after 10 + 20 ms of
    # back-off) get through; a long one outlasts every try, so the calls in it fail.
    burst, gap = (args.hard_burst_ms, args.hard_gap_ms) if args.hard_faults else (args.eio_burst_ms, args.eio_gap_ms)
    env.update(ENGRAM_FAULTS_EIO_BURST_MS=str(burst), ENGRAM_FAULTS_EIO_GAP_MS=str(gap))
    if "enospc" in args.classes:
        # The stats file and the trace (and their temp files) are in write_dir: a full disk for
        # ENOSPC_BURST_MS once per ENOSPC_GAP_MS of writes, while armed.
        env.update(ENGRAM_FAULTS_WRITE_MATCH=f"{write_dir}/", ENGRAM_FAULTS_WRITE_EVERY="1",
                   ENGRAM_FAULTS_WRITE_BURST_MS=str(args.enospc_burst_ms),
                   ENGRAM_FAULTS_WRITE_GAP_MS=str(args.enospc_gap_ms))
    if "short" in args.classes:
        env["ENGRAM_FAULTS_SHORT_PROB"] = str(args.short_prob)
    return env


def placement_flags(name: str, args, shm_dir: Optional[Path] = None) -> dict:
    if name == "disk":
        flags = {"placement": "disk", "disk_direct": "on", "disk_dram_cache_mib": args.dram_cache_mib,
                 "disk_retries": RETRIES}
    else:
        flags = {"placement": "host", "host_shared": "on"}
        if shm_dir is not None:
            flags["shm_dir"] = str(shm_dir)
    return flags


def server_flags(name: str, args, write_dir: Path, shm_dir: Optional[Path]) -> dict:
    flags = placement_flags(name, args, shm_dir)
    if "enospc" in args.classes:
        flags.update(stats_file=str(write_dir / "stats.json"), trace=str(write_dir / "trace.jsonl"))
    return flags


def log_counts(log: Path) -> dict:
    text = log.read_text(errors="replace") if log.exists() else ""
    # The store logs each failed try, and each call whose rows still fail after them (with
    # the requests it fails).
    return {"read_retries": len(re.findall(r"failed \(.*\), try \d+ of \d+", text)),
            "reads_failed_after_retries": len(re.findall(r"engram layer \d+: .* failed after \d+ tries", text)),
            "enospc_log_lines": text.count("No space left on device"),
            "last_error": (re.findall(r"^\w*(?:Error|Exception): .*$", text, re.M) or [""])[-1][:200],
            "tracebacks": text.count("Traceback (most recent call last)")}


def run_placement(name: str, model_dir: Path, pool, args, work: Path, vocab: int) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    stats_dir = work / "faults"
    shutil.rmtree(stats_dir, ignore_errors=True)
    stats_dir.mkdir()
    (work / "faults-open").mkdir(exist_ok=True)  # the short-read openers' counters, apart from the server's
    write_dir = work / "enospc"
    write_dir.mkdir(exist_ok=True)
    arm = work / "faults.armed"
    arm.unlink(missing_ok=True)
    log = work / "sglang.log"
    # The host copy in a directory of its own: the frozen holder must never stall another
    # server of the node on the same tables.
    shm_dir = Path(tempfile.mkdtemp(prefix="engram-soak-", dir="/dev/shm")) if name == "host" else None
    server = Server(model_dir, engram=server_flags(name, args, write_dir, shm_dir), max_total_tokens=8192,
                    log_path=log, args=("--chunked-prefill-size", str(args.chunk)),
                    env=fault_env(args, stats_dir, arm, write_dir))
    print(f"soak {name}: starting the server (log: {log})", flush=True)
    t_boot = time.monotonic()
    server.start()
    times = {"boot_s": time.monotonic() - t_boot}
    results: list[Result] = []
    samples: list[dict] = []
    lock = threading.Lock()
    stop = threading.Event()
    died_at = None
    side: dict = {"bad_ids": [], "short_opens": [], "frozen_locks": []}
    side_thread = None
    t0 = time.monotonic()
    try:
        # Warm-up, unarmed: the first pool items once (the server's lazy set-up, first reads).
        for prompt, new in pool[: args.warmup]:
            server.generate(prompt, min(new, 4))
        arm.touch()
        t0 = time.monotonic()
        times["warmup_s"] = t0 - t_boot - times["boot_s"]
        deadline = t0 + args.minutes * 60
        pgid = server.proc.pid
        live: dict = {}  # client -> its open socket
        threads = [threading.Thread(target=client_loop, args=(i, server.port, pool, stop, deadline, args.seed,
                                                               results, lock, live), daemon=True)
                   for i in range(args.clients)]
        for t in threads:
            t.start()
        side_thread = threading.Thread(target=side_faults, daemon=True,
                                       args=(name, server, model_dir, shm_dir, work, args, vocab, pool, t0, deadline,
                                             stop, side, lock, results))
        side_thread.start()
        print(f"soak {name}: {args.clients} clients for {args.minutes:g} min, faults armed", flush=True)
        while time.monotonic() < deadline:
            s = sample_processes(pgid)
            s.update(t=time.monotonic() - t0, faults=fault_counts(stats_dir))
            with lock:
                s["requests"] = len(results)
            samples.append(s)
            if server.proc.poll() is not None:
                died_at = s["t"]
                print(f"soak {name}: the server died after {died_at:.0f} s", flush=True)
                break
            stop.wait(args.sample_s)
        stop.set()
        for sock in list(live.values()):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in threads:
            t.join(REQUEST_TIMEOUT_S + 10)
        side_thread.join(REQUEST_TIMEOUT_S + 300 + args.freeze_s)  # a round in progress finishes (holder thawed)
        times["soak_s"] = time.monotonic() - t0
        arm.unlink(missing_ok=True)
        faults = fault_counts(stats_dir)
        after = {"alive": server.proc.poll() is None}
        if after["alive"]:
            # Still serving: one more request after the faults, checked like the rest.
            prompt, new = pool[0]
            try:
                out = server.generate(prompt, new)["output_ids"]
                results.append(Result(client=-1, item=0, kind="full", outcome="completed", output_ids=out))
                after["served_after"] = True
                after["engram"] = server.engram_stats()
            except Exception as e:  # noqa: BLE001 - reported, not raised: the soak's verdict
                after.update(served_after=False, error=str(e)[:300])
        else:
            after["served_after"] = False
        times["after_s"] = time.monotonic() - t0 - times["soak_s"]
    finally:
        stop.set()
        t_stop = time.monotonic()
        server.stop()
        times["stop_s"] = time.monotonic() - t_stop
        if shm_dir is not None:
            shutil.rmtree(shm_dir, ignore_errors=True)
    lat = sorted(r.t_end - r.t_start for r in results if r.outcome == "completed" and r.client >= 0)
    ttft = sorted(r.t_first - r.t_start for r in results if r.t_first is not None and r.client >= 0)
    return {"placement": name, "flags": placement_flags(name, args), "times": times, "died_at_s": died_at,
            "after": after, "faults": faults, "log": log_counts(log), "samples": samples,
            "side": side, "side_summary": side_summary(side, write_dir, faults, args.classes),
            "latency_s": _percentiles(lat), "ttft_s": _percentiles(ttft),
            "requests": [r.__dict__ for r in results], "t0": t0}


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0, "p50": None, "p99": None}
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return {"n": len(values), "p50": pick(0.5), "p99": pick(0.99), "max": values[-1]}


# ------------------------------------------------------------------ checks
def check_tokens(runs: list[dict], pool, model_dir: Path) -> None:
    """Marks every request's tokens right or wrong against the reference forward: each distinct
    completion of a pool item is teacher-forced once (every token must be the argmax after the
    tokens before it); a completion that is a prefix of a checked one needs no forward."""
    from engram_sglang.models.reference import ReferenceModel
    from engram_sglang.tools.demo.model import TABLE_DIR_NAME

    ref = ReferenceModel(model_dir, model_dir / TABLE_DIR_NAME)
    good: dict[int, list[list[int]]] = {}
    bad: dict[int, list[list[int]]] = {}

    def verdict(item: int, out: list[int]) -> bool:
        if any(g[:len(out)] == out for g in good.get(item, [])):
            return True
        if any(b == out for b in bad.get(item, [])):
            return False
        prompt = pool[item][0]
        logits = ref.forward(prompt + out[:-1]).logits
        want = logits[len(prompt) - 1:].argmax(dim=-1).tolist()
        ok = want == out
        (good if ok else bad).setdefault(item, []).append(out)
        return ok

    for run in runs:
        reqs = run["requests"]
        order = sorted(range(len(reqs)), key=lambda k: -len(reqs[k]["output_ids"]))  # longest first
        for k in order:
            r = reqs[k]
            r["tokens_ok"] = verdict(r["item"], r["output_ids"]) if r["output_ids"] else True
        run["checked_forwards"] = sum(len(v) for v in good.values()) + sum(len(v) for v in bad.values())
        good.clear()
        bad.clear()


def summarize(run: dict, args) -> dict:
    reqs = [r for r in run["requests"] if r["client"] >= 0]
    by = {k: sum(r["outcome"] == k for r in reqs) for k in ("completed", "disconnected", "aborted", "cut", "failed", "lost")}
    tokens = sum(len(r["output_ids"]) for r in run["requests"])
    wrong = [r for r in run["requests"] if not r["tokens_ok"]]
    wrong_ok = sum(r["outcome"] != "failed" for r in wrong)
    samples = run["samples"]
    duration = samples[-1]["t"] if samples else 0.0

    def window(lo: float, hi: float, key: str) -> list[float]:
        return [s[key] for s in samples if lo * duration <= s["t"] <= hi * duration] or [samples[-1][key]]

    def median(v):
        v = sorted(v)
        return v[len(v) // 2]

    # Growth once the caches are full: the steady part's start (a third into the run) vs its end.
    growth = {key: median(window(0.85, 1.0, key)) - median(window(0.3, 0.45, key))
              for key in ("rss_mib", "fds", "shm_mib")} if samples else {}
    f = run["faults"]
    failed = [r for r in reqs if r["outcome"] == "failed"]
    # A contained failure says which table and why (the file and the errno's text).
    named = [r for r in failed if ".rows" in r["message"] and re.search(r"error|errno|short read", r["message"], re.I)]
    side = dict(run["side_summary"])
    if side["held"]["enospc"]:
        side["held"] = dict(side["held"], enospc=bool(run["after"]["served_after"] and run["died_at_s"] is None))
    return {
        "placement": run["placement"], "minutes": duration / 60, "requests": len(reqs), **by,
        "tokens": tokens, "wrong_outside_failed": wrong_ok, "wrong_in_failed": len(wrong) - wrong_ok,
        "eio_injected": f.get("eio_injected", 0), "eio_bursts": f.get("eio_bursts", 0), "stalls": f.get("stalls", 0),
        "table_reads": f.get("matched_reads", 0), **run["log"],
        "server_alive": run["after"]["alive"], "served_after": run["after"]["served_after"],
        "failed_named": len(named), "failure_examples": sorted({r["message"][:200] for r in failed})[:3],
        "contained": bool(run["after"]["served_after"] and wrong_ok == 0 and run["died_at_s"] is None
                          and len(named) == len(failed)),
        "p50_s": run["latency_s"]["p50"], "p99_s": run["latency_s"]["p99"], "ttft_p50_s": run["ttft_s"]["p50"],
        "rss_mib_end": samples[-1]["rss_mib"] if samples else None, "fds_end": samples[-1]["fds"] if samples else None,
        "shm_mib_end": samples[-1]["shm_mib"] if samples else None,
        "growth": growth,
        **side,
        # A few MiB of allocator noise is not a leak; fds and shm must not move at all.
        "no_growth": bool(growth) and growth["rss_mib"] <= max(32.0, 0.03 * samples[-1]["rss_mib"])
        and growth["fds"] <= 2 and abs(growth["shm_mib"]) < 1,
    }


# ------------------------------------------------------------------ report
def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(9, 11), sharex=True)
    eio = axes[3].twinx()
    eio.set_ylabel("EIO injected, cumulative (dashed)")
    for color, run in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], runs):
        t = [s["t"] for s in run["samples"]]
        name = run["placement"]
        axes[0].plot(t, [s["rss_mib"] for s in run["samples"]], color=color, label=name)
        axes[1].plot(t, [s["fds"] for s in run["samples"]], color=color, label=name)
        axes[2].plot(t, [s["shm_mib"] for s in run["samples"]], color=color, label=name)
        done = [r for r in run["requests"] if r["outcome"] == "completed" and r["client"] >= 0]
        axes[3].scatter([r["t_end"] - run["t0"] for r in done], [r["t_end"] - r["t_start"] for r in done], s=3,
                        color=color, label=name)
        eio.plot(t, [s["faults"].get("eio_injected", 0) for s in run["samples"]], "--", color=color, lw=0.8)
    for ax, label in zip(axes, ("RSS, all server processes (MiB)", "open fds", "/dev/shm held (MiB)",
                                "request latency (s)")):
        ax.set_ylabel(label)
        ax.legend(loc="upper left")
    axes[3].set_xlabel("seconds since faults were armed")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(summaries: list[dict]) -> None:
    header = ["placement", "min", "requests", "completed", "disconn.", "aborted", "cut", "failed", "lost", "tokens",
              "wrong", "EIO inj.", "bursts", "stalls", "retried", "failed reads", "alive", "contained", "p50 s",
              "p99 s", "RSS MiB", "dRSS", "fds", "dfds", "shm MiB", "ENOSPC inj.", "short reads", "short opens ok",
              "bad id 400", "lock opened", "lock wait lines", "lock wait s"]
    rows = [[s["placement"], round(s["minutes"], 1), s["requests"], s["completed"], s["disconnected"], s["aborted"],
             s["cut"], s["failed"], s["lost"], s["tokens"], s["wrong_outside_failed"], s["eio_injected"], s["eio_bursts"],
             s["stalls"], s["read_retries"], s["reads_failed_after_retries"], s["served_after"], s["contained"],
             s["p50_s"] or 0.0, s["p99_s"] or 0.0, round(s["rss_mib_end"] or 0), round(s["growth"].get("rss_mib", 0), 1),
             s["fds_end"], s["growth"].get("fds", 0), round(s["shm_mib_end"] or 0, 1), s["enospc_injected"],
             s["short_reads"], f"{s['short_opens_exact']}/{s['short_opens']}",
             f"{s['bad_id_400']}/{s['bad_id_requests']}", f"{s['frozen_lock_opened']}/{s['frozen_locks']}",
             s["frozen_lock_wait_lines"], round(s["frozen_lock_max_wait_s"] or 0.0, 1)] for s in summaries]
    print_table("soak (wrong = tokens unlike the reference outside failed requests; d = growth over the steady part)",
                header, rows)
    for s in summaries:
        print(f"{s['placement']}: classes held: " + ", ".join(f"{k} {v}" for k, v in s["held"].items()))
        if not s["server_alive"] and s["last_error"]:
            print(f"  the server died: {s['last_error']}")
        for why in s["bad_id_other"] + s["short_open_failures"] + [
                f"lock: {x.get('outcome')}: {x.get('message', '')}" for x in s["frozen_lock_outcomes"]
                if x.get("outcome") != "opened"]:
            print(f"  {why}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=2.0, help="soak time per placement, faults armed")
    p.add_argument("--placements", default="disk,host")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--pool", type=int, default=48, help="distinct (prompt, length) pairs the clients draw from")
    p.add_argument("--warmup", type=int, default=8, help="pool items sent once before the faults are armed")
    p.add_argument("--chunk", type=int, default=64, help="--chunked-prefill-size")
    p.add_argument("--dram-cache-mib", type=int, default=1, help="disk: the DRAM row cache (small: reads keep going to the file)")
    p.add_argument("--eio-burst-ms", type=int, default=15, help="outage length (shorter than the store's back-off: absorbed)")
    p.add_argument("--eio-gap-ms", type=int, default=500, help="one outage per this many ms of reads")
    p.add_argument("--stall-prob", type=float, default=0.01, help="probability a table read call stalls")
    p.add_argument("--stall-ms", type=int, default=50)
    p.add_argument("--hard-faults", action="store_true",
                   help="read outages that outlast the retries (needs contained read errors in the server)")
    p.add_argument("--hard-burst-ms", type=int, default=300)
    p.add_argument("--hard-gap-ms", type=int, default=10_000)
    p.add_argument("--classes", default=",".join(CLASSES),
                   help=f"fault classes beside the read faults: a comma list of {', '.join(CLASSES)}, or none")
    p.add_argument("--enospc-burst-ms", type=int, default=2000, help="the stats/trace directory is full this long")
    p.add_argument("--enospc-gap-ms", type=int, default=20_000, help="once per this many ms of writes")
    p.add_argument("--short-prob", type=float, default=0.05, help="probability a table pread/preadv returns short")
    p.add_argument("--short-open-prob", type=float, default=0.5,
                   help="the same in the process that opens the tables under short reads each round")
    p.add_argument("--freeze-s", type=float, default=15.0, help="how long the lock holder stays frozen (SIGSTOP)")
    p.add_argument("--side-every-s", type=float, default=60.0,
                   help="one round of the side classes (bad id, short-read open, frozen lock) per this many s")
    p.add_argument("--sample-s", type=float, default=2.0, help="/proc sampling period")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--model-dir", help="the demo model (default: built once under --workdir)")
    p.add_argument("--workdir", default=str(ROOT / "build" / "soak"))
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--name", default="soak")
    args = p.parse_args(argv)
    if not FAULTS_LIB.is_file():
        print(f"soak: {FAULTS_LIB} is missing: run `make faults`", file=sys.stderr)
        return 2
    if not (0 < args.minutes <= 24 * 60) or not (1 <= args.clients <= 256):
        print(f"soak: --minutes must be in (0, 1440] and --clients in [1, 256], got {args.minutes}, {args.clients}",
              file=sys.stderr)
        return 2
    args.classes = tuple(c for c in args.classes.split(",") if c and c != "none")
    if any(c not in CLASSES for c in args.classes):
        print(f"soak: --classes {','.join(args.classes)}: expected a comma list of {', '.join(CLASSES)} or none",
              file=sys.stderr)
        return 2
    placements = args.placements.split(",")
    unknown = [n for n in placements if n not in ("disk", "host")]
    if unknown:
        print(f"soak: --placements {args.placements}: unknown {unknown[0]!r} (expected disk, host or disk,host)",
              file=sys.stderr)
        return 2
    workdir = Path(args.workdir)
    if args.model_dir:
        model_dir = Path(args.model_dir)
    else:
        from engram_sglang.tools.demo.run import demo_model

        model_dir, _ = demo_model(workdir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pool = prompt_pool(tokenizer, args.pool, args.seed)
    runs = []
    for name in placements:
        runs.append(run_placement(name, model_dir, pool, args, Path(tempfile.mkdtemp(prefix=f"{name}-", dir=_mk(workdir))),
                                  len(tokenizer)))
    print("soak: checking every served token against the reference forward", flush=True)
    t_check = time.monotonic()
    check_tokens(runs, pool, model_dir)
    check_s = time.monotonic() - t_check
    summaries = [summarize(r, args) for r in runs]
    report(summaries)
    for run in runs:
        print(f"{run['placement']}: " + ", ".join(f"{k[:-2]} {v:.0f} s" for k, v in run["times"].items()))
    print(f"token check: {check_s:.0f} s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine(), "args": vars(args), "summary": summaries, "check_s": check_s,
               "runs": [{k: v for k, v in r.items() if k != "requests"} |
                        {"requests": [{k: v for k, v in q.items() if k != "output_ids"} | {"tokens": len(q["output_ids"])}
                                      for q in r["requests"]]}
                        for r in runs]}
    (out / f"{args.name}.json").write_text(json.dumps(payload, indent=1))
    plot(runs, out / f"{args.name}.png")
    print(f"wrote {out / (args.name + '.json')} and {out / (args.name + '.png')}")
    return 0 if all(s["contained"] and s["wrong_outside_failed"] == 0 and False not in s["held"].values()
                    for s in summaries) else 1


def _mk(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


if __name__ == "__main__":
    sys.exit(main())
