"""End to end on CPU: real `sglang.launch_server` serving the demo model over HTTP.

One server runs at a time (SGLang's scheduler keeps a core busy; two cores are shared):
each module-scoped fixture starts a server, sends its requests, reads its trace, stops it
and returns the results; the tests then compare results. Every completion is checked
against the PyTorch reference forward, and every traced step's hash ids and row
checksums against the reference's, token by token.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import pytest

from engram_sglang.serving.launch import Server, _group_alive, _TreeRecord, free_port
from tests.support.demo_support import demo_dir, reference, reference_completion, table_dir, trace_requests

pytestmark = pytest.mark.slow

LENGTHS = (3, 7, 12, 20, 33, 50, 70, 90)
NEW_TOKENS = (4, 8, 12, 16)
N_MIXED = 32


def corpus_prompts(n: int, salt: int = 0) -> list[list[int]]:
    """n prompts of mixed lengths (token ids), cut from offline text at fixed places."""
    import functools as _functools
    import json as _json

    tok = reference().tokenizer
    text = "\n".join(Path(m.__file__).read_text() for m in (_functools, _json, os))
    ids = tok(text)["input_ids"]
    return [ids[((i + salt) * 997) % (len(ids) - 100):][: LENGTHS[i % len(LENGTHS)]] for i in range(n)]


MIXED = corpus_prompts(N_MIXED)
MIXED_NEW = [NEW_TOKENS[i % len(NEW_TOKENS)] for i in range(N_MIXED)]
LONG = [p for p in corpus_prompts(16, salt=101) if len(p) >= 33][:3]
EXTENDED = [p + q[:9] for p, q in zip(LONG, corpus_prompts(3, salt=7))]


def want(prompt: list[int], n: int) -> list[int]:
    return list(reference_completion(tuple(prompt), n))


class Run:
    """A server's lifetime: start, requests (each recorded with its full token list), trace."""

    def __init__(self, tmp_path_factory, name: str, args=(), **engram):
        self.work = tmp_path_factory.mktemp(name)
        self.trace = self.work / "trace.jsonl"
        engram.setdefault("trace", str(self.trace))
        self.server = Server(demo_dir(), engram=engram, args=args, max_total_tokens=4096,
                             log_path=self.work / "sglang.log")
        self.sent: list[list[int]] = []
        self.results: dict = {}
        self.traced: Optional[int] = None  # the trace lines the checks cover (None: all)

    def __enter__(self) -> "Run":
        self.server.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop()

    def generate(self, prompt: list[int], n: int) -> dict:
        out = self.server.generate(prompt, n)
        self.sent.append(prompt + out["output_ids"])
        return out

    def complete(self, prompts, news) -> list[list[int]]:
        return [self.generate(p, n)["output_ids"] for p, n in zip(prompts, news)]

    def check_trace(self) -> dict:
        """Every traced token against the reference forward of the request it belongs to:
        counts of tokens checked, wrong hash ids, wrong row checksums (of those, the ones whose
        hash ids are right), unmatched records."""
        ref = reference()
        forwards = {}
        counts = {"tokens": 0, "ids_wrong": 0, "sums_wrong": 0, "sums_wrong_ids_right": 0, "unmatched": 0}
        for rec in trace_requests(self.trace, self.traced):
            if rec["tok"] == [0] and rec["pos"] == [0]:
                continue  # SGLang's /health probe
            lo, hi = rec["pos"][0], rec["pos"][-1] + 1
            match = next((s for s in self.sent if s[lo:hi] == rec["tok"]), None)
            if match is None:
                counts["unmatched"] += 1
                continue
            key = tuple(match[:-1])
            if key not in forwards:
                forwards[key] = ref.forward(list(key))
            step = forwards[key]
            for i, layer in enumerate(ref.engram.layer_ids):
                for id_got, id_want, sum_got, sum_want in zip(rec["ids"][str(layer)], step.hash_ids[lo:hi, i].tolist(),
                                                              rec["sum"][str(layer)], step.checksums[lo:hi, i].tolist()):
                    counts["ids_wrong"] += id_got != id_want
                    counts["sums_wrong"] += sum_got != sum_want
                    counts["sums_wrong_ids_right"] += id_got == id_want and sum_got != sum_want
            counts["tokens"] += hi - lo
        return counts

    def steps(self) -> list[dict]:
        return [json.loads(line) for line in self.trace.read_text().splitlines()[:self.traced]]

    def stop_tracing_checks(self) -> None:
        """Requests from here on are not this module's (their tokens are not in `sent`)."""
        self.traced = len(self.trace.read_text().splitlines())


def engram_samples(server) -> list:
    """The engram_* samples of the server's /metrics (served with `--enable-metrics`)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(server.url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("engram_")]


def bad_id_requests(run: Run) -> list[tuple[int, str]]:
    """Requests holding a token id outside the model's vocabulary (issue 22, item 1): -1 and
    the vocabulary size by /generate, one by /v1/completions. (HTTP status, error message) each."""
    vocab = json.loads((demo_dir() / "config.json").read_text())["vocab_size"]
    bodies = [("/generate", {"input_ids": [5, -1, 7], "sampling_params": {"max_new_tokens": 2}}),
              ("/generate", {"input_ids": [5, vocab, 7], "sampling_params": {"max_new_tokens": 2}}),
              ("/v1/completions", {"prompt": [5, vocab, 7], "max_tokens": 2})]
    out = []
    for path, body in bodies:
        req = urllib.request.Request(run.server.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                out.append((r.status, r.read().decode(errors="replace")))
        except urllib.error.HTTPError as e:
            reply = json.loads(e.read())
            error = reply.get("error", reply)
            out.append((e.code, error.get("message") if isinstance(error, dict) else str(error)))
    return out


def ablate_scores(server: Server, work: Path) -> dict:
    """`engram-sglang ablate` against a real server: teacher-forced scores of held-out
    documents (Engram on and off) and of question/answer pairs in each of their modes, sent
    at once, and the pairs' report rows."""
    from engram_sglang.tools.analysis import ablate
    from engram_sglang.tools.analysis.inputs import documents, load_pairs
    from engram_sglang.tools.analysis.scoring import ServerScorer
    from tests.tools.test_ablate import CHUNK, CODE, write_pairs

    tok = reference().tokenizer
    pairs = load_pairs(write_pairs(work / "pairs.jsonl"), tok)
    seqs = [(d, ("on", "off")) for d in documents(tok, CODE, CHUNK, max_docs=2)]
    seqs += [(p.prompt + p.answer, ablate.pair_modes(p).values()) for p in pairs]
    items = [(ids, m) for ids, modes in seqs for m in modes]
    return {"items": items, "scores": ServerScorer(server.url, concurrency=len(items)).score(items),
            "rows": ablate.score_pairs(ServerScorer(server.url), pairs)}


def prefix_runs(run: Run) -> dict:
    """Long prompts, then prompts extending them (radix-cache hits: prefill starts mid-sequence)."""
    first = [run.generate(p, 12) for p in LONG]
    second = [run.generate(p, 12) for p in EXTENDED]
    return {"long": [o["output_ids"] for o in first], "extended": [o["output_ids"] for o in second],
            "cached": [o["meta_info"]["cached_tokens"] for o in second]}


# ------------------------------------------------------------------ server runs
@pytest.fixture(scope="module")
def device_run(tmp_path_factory):
    """Device placement with `--engram-ablation on` (requests without a mode are served with
    Engram on); after this module's requests, `engram-sglang ablate`'s server scorer on the
    same server (a server start costs ~20 s of the suite's two cores)."""
    with Run(tmp_path_factory, "device", placement="device", ablation="on") as run:
        with ThreadPoolExecutor(N_MIXED) as pool:
            run.results["concurrent"] = [o["output_ids"] for o in pool.map(lambda a: run.generate(*a), zip(MIXED, MIXED_NEW))]
        run.results["prefix"] = prefix_runs(run)
        run.results["stats"] = run.server.engram_stats()
        run.stop_tracing_checks()
        run.results["ablate"] = ablate_scores(run.server, run.work)
    run.results["trace"] = run.check_trace()
    run.results["widest_step"] = max(len(set(s["req"])) for s in run.steps())
    return run.results


@pytest.fixture(scope="module")
def host_run(tmp_path_factory):
    """Host placement, prefill in chunks of 16 tokens."""
    with Run(tmp_path_factory, "host", args=("--chunked-prefill-size", "16"), placement="host") as run:
        run.results["bad_ids"] = bad_id_requests(run)  # first: every completion below comes after them
        run.results["sequential"] = run.complete(MIXED[:12], MIXED_NEW[:12])
        run.results["prefix"] = prefix_runs(run)
    run.results["trace"] = run.check_trace()
    run.results["full_chunks"] = sum(1 for s in run.steps() if s["mode"] == "extend" and len(s["pos"]) == 16)
    return run.results


@pytest.fixture(scope="module")
def disk_run(tmp_path_factory):
    """Disk placement read by O_DIRECT behind a DRAM row cache, prefill in chunks of 32
    tokens: each chunked prompt's next chunk is read ahead into that cache. With SGLang's
    metrics on: /metrics scraped once it is up and after the requests."""
    with Run(tmp_path_factory, "disk", args=("--chunked-prefill-size", "32", "--enable-metrics"), placement="disk",
             disk_direct="on", disk_dram_cache_mib=1) as run:
        run.results["metrics_at_start"] = engram_samples(run.server)
        run.results["sequential"] = run.complete(MIXED, MIXED_NEW)
        run.results["stats"] = run.server.engram_stats()
        run.results["metrics"] = engram_samples(run.server)
    run.results["trace"] = run.check_trace()
    return run.results


@pytest.fixture(scope="module")
def expected():
    return [want(p, n) for p, n in zip(MIXED, MIXED_NEW)]


# ------------------------------------------------------------------------ tests
def test_32_concurrent_mixed_requests_equal_sequential_and_reference(device_run, disk_run, expected):
    """32 requests of 3..90 prompt tokens and 4..16 new tokens sent at once (device) give the
    tokens they give one at a time (disk), and the reference's."""
    assert device_run["concurrent"] == disk_run["sequential"]
    assert device_run["concurrent"] == expected
    assert device_run["widest_step"] >= 8, "the requests did not share steps"


def test_placements_agree_with_each_other_and_the_reference(device_run, host_run, disk_run, expected):
    assert host_run["sequential"] == disk_run["sequential"][:12] == device_run["concurrent"][:12] == expected[:12]
    assert device_run["stats"]["placement"] == "device" and disk_run["stats"]["placement"] == "disk"
    assert all(t["rows_served"] > 0 for t in disk_run["stats"]["tables"])


def test_disk_tier_reads_the_next_prefill_chunk_ahead_into_its_dram_cache(disk_run):
    """Prompts of 33..90 tokens in 32-token chunks: rows of the next chunks were read ahead
    and then hit in the DRAM row cache; the traced ids and checksums above stay exact."""
    tables = disk_run["stats"]["tables"]
    assert all(t["read_ahead_rows"] > 0 for t in tables), tables
    assert all(t["dram_cache_hits"] > 0 and t["direct"] for t in tables), tables


def test_metrics_name_their_rank_and_count_from_start_up(disk_run):
    """A real scrape of SGLang's /metrics (its multiprocess collector): every engram_* series
    names its tp/dp/pp rank and none a `pid`; the error, read-fault and DRAM-cache counters
    are there (errors at 0) before any request; the DRAM cache's hits, the step wait and the
    version and tables are series that agree with /server_info."""
    import engram_sglang

    start, end, stats = disk_run["metrics_at_start"], disk_run["metrics"], disk_run["stats"]
    for samples in (start, end):
        assert samples
        for s in samples:
            assert {"tp_rank": "0", "dp_rank": "0", "pp_rank": "0"}.items() <= s.labels.items(), s
            assert "pid" not in s.labels, s
    layers = sorted(str(t["layer_id"]) for t in stats["tables"])

    def values(samples, name, **labels):
        return {s.labels.get("layer"): s.value for s in samples
                if s.name == name and labels.items() <= s.labels.items()}

    assert values(start, "engram_read_faults_total", placement="disk") == {None: 0.0}
    assert values(start, "engram_read_errors_total") == {L: 0.0 for L in layers}
    assert sorted(values(start, "engram_dram_cache_lookups_total")) == layers
    assert sorted(values(start, "engram_dram_cache_hits_total")) == layers
    # Published between steps (every 8th): at most what /server_info says, and not nothing.
    hits = values(end, "engram_dram_cache_hits_total")
    for t in stats["tables"]:
        assert 0 < hits[str(t["layer_id"])] <= t["dram_cache_hits"], (hits, t)
    steps = values(end, "engram_step_wait_seconds_count", placement="disk")[None]
    assert 0 < steps <= stats["steps"], (steps, stats["steps"])
    info = [s for s in end if s.name == "engram_build_info"]
    assert len(info) == 1 and info[0].value == 1, info
    assert info[0].labels["version"] == stats["engram_version"] == engram_sglang.__version__
    assert info[0].labels["table_identity"] == stats["table_identity"]
    assert info[0].labels["table_fingerprint"] == stats["table_fingerprint"]
    assert stats["table_fingerprint"] == json.loads((table_dir() / "manifest.json").read_text())["config_fingerprint"]


@pytest.mark.parametrize("run", ["device_run", "host_run", "disk_run"])
def test_traced_hash_ids_and_row_checksums_equal_the_reference(run, request):
    """Every step a server ran (prefill chunks, prefix-hit prefills, decode, batched and
    single), token by token: the hash ids and the checksum of the rows each layer used."""
    counts = request.getfixturevalue(run)["trace"]
    assert counts["tokens"] > 200 and counts["unmatched"] == 0, counts
    assert counts["ids_wrong"] == 0 and counts["sums_wrong"] == 0, counts


def test_chunked_prefill_and_prefix_cache_hits_give_the_same_completions(host_run, device_run):
    assert host_run["full_chunks"] >= 2, "the host server did not prefill in 16-token chunks"
    for run in (host_run, device_run):
        assert run["prefix"]["long"] == [want(p, 12) for p in LONG]
        assert run["prefix"]["extended"] == [want(p, 12) for p in EXTENDED]
        assert all(c >= len(p) - 1 for c, p in zip(run["prefix"]["cached"], LONG)), run["prefix"]["cached"]


def test_an_out_of_range_token_id_fails_its_request_with_400_and_the_server_keeps_serving(host_run):
    """-1 and the vocabulary size as ids (/generate), and in an OpenAI completions prompt: HTTP
    400 each, one line naming the id and the vocabulary size; the same server then serves every
    prompt exactly as the reference (it used to die: the hasher raised in the scheduler's forward)."""
    vocab = json.loads((demo_dir() / "config.json").read_text())["vocab_size"]
    for (status, message), bad in zip(host_run["bad_ids"], (-1, vocab, vocab)):
        assert status == 400, (status, message)
        assert f"token id {bad} " in message and f"vocabulary of {vocab} tokens" in message, message
        assert "\n" not in message, message
    assert host_run["sequential"] == [want(p, n) for p, n in zip(MIXED[:12], MIXED_NEW[:12])]


def test_ablate_server_scores_equal_the_reference_in_every_mode(device_run):
    """`engram-sglang ablate` on a real server (--engram-ablation on): per document and mode,
    the served teacher-forced bits equal the reference forward's up to the server's bf16
    logits; Engram off and the answer window change them as they change the reference's."""
    import numpy as np

    from engram_sglang.tools.analysis.scoring import ReferenceScorer

    scored = device_run["ablate"]
    items, got = scored["items"], scored["scores"]
    want = ReferenceScorer(None, reference=reference()).score(items)
    for (ids, mode), g, w in zip(items, got, want):
        g, w = np.array(g), np.array(w)
        # Logits in bf16 round a logprob by up to ~1 nat where |logprob| is in the hundreds.
        assert np.abs(g - w).max() <= 2.0, (mode, np.abs(g - w).max())
        assert abs(g.sum() - w.sum()) <= 0.01 * abs(w.sum()), mode
    on = {id(ids): g for (ids, mode), g in zip(items, got) if mode == "on"}
    for (ids, mode), g in zip(items, got):
        if mode != "on":  # the mode really reached the server's forward
            assert sum(g) < sum(on[id(ids)]) - 1, (mode, sum(g), sum(on[id(ids)]))
    assert {r["mode"] for r in scored["rows"]} == {"on", "answer-window", "off"}


# ------------------------------------------------------------- negative controls
def test_negative_controls_are_caught(tmp_path_factory):
    """One server with both controls: `corrupt-history` hashes with a lost history (the ids of
    tokens whose n-grams reach back past their own prompt chunk are wrong), `skip-wait` reads
    rows without waiting for the prefetch (every row is wrong). Each must fail the checks the
    real servers pass, on its own: wrong hash ids, and wrong row checksums of tokens whose
    hash ids are right (which a lost history alone cannot give)."""
    prompts = MIXED[2:5]
    with Run(tmp_path_factory, "controls", placement="device", debug="corrupt-history,skip-wait") as run:
        got = run.complete(prompts, [8] * len(prompts))
    counts = run.check_trace()
    assert got != [want(p, 8) for p in prompts]
    assert counts["unmatched"] == 0 and counts["tokens"] > 0, counts
    assert counts["ids_wrong"] > 0, counts  # corrupt-history
    assert counts["sums_wrong_ids_right"] > 0, counts  # skip-wait


# ------------------------------------------------------------------ start-up
@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_bad_table_dir_fails_start_up_with_one_line_and_leaves_nothing(tmp_path, damage):
    tables = tmp_path / "tables"
    if damage == "truncated":
        shutil.copytree(table_dir(), tables)
        path = tables / "layer-3.rows"
        path.write_bytes(path.read_bytes()[:-264])
        expect = "layer-3.rows: truncated"
    else:
        expect = "table directory does not exist"
    # Run by hand (not Server.start, which stops the tree itself): its temp files go in tmp_path.
    server = Server(demo_dir(), engram={"table_dir": tables}, log_path=tmp_path / "sglang.log", port=free_port(),
                    env={"TMPDIR": str(tmp_path)})
    proc = subprocess.Popen(server.cmd, env=server.env, stdout=open(server.log_path, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    tree = _TreeRecord(proc.pid).watch()  # what its processes hold in /dev/shm, removed after (as Server.stop does)
    try:
        rc = proc.wait(timeout=300)  # SGLang must exit by itself
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        tree.close()
        tree.remove_leftovers()
    # Exit status 2 with the line last, not SGLang's traceback and SIGKILL of the tree (137).
    assert rc == 2, rc
    time.sleep(2)
    assert not _group_alive(proc.pid), "a half-started SGLang process was left behind"
    line = server.failure_line()
    assert line.startswith("engram-sglang: ") and expect in line and "\n" not in line, line
    log = server.log_path.read_text().rstrip().splitlines()
    last = max(i for i, ln in enumerate(log) if "engram-sglang: error: " in ln)
    # After the line only SGLang's `finally` ending the other processes ("kill_process_tree called").
    assert log[last].endswith(line) and all("kill_process_tree" in ln for ln in log[last + 1:]), log[last:]
    assert not [ln for ln in log if "Traceback" in ln or "Scheduler hit an exception" in ln], log[-30:]


def test_bad_flag_values_are_refused_before_anything_starts(tmp_path):
    server = Server(demo_dir(), engram={"placement": "ssd"}, log_path=tmp_path / "sglang.log", env={"TMPDIR": str(tmp_path)})
    proc = subprocess.run(server.cmd, env=server.env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--engram-placement: invalid choice: 'ssd'" in proc.stderr
    server = Server(demo_dir(), engram={"disk_threads": "0"}, log_path=tmp_path / "sglang.log",
                    env={"TMPDIR": str(tmp_path)})
    proc = subprocess.run(server.cmd, env=server.env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "engram-sglang: error: ENGRAM_DISK_THREADS (--engram-disk-threads) must be >= 1, got 0")
