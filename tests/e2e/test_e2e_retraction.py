"""End to end on CPU: decode retraction under KV-cache pressure, on real `sglang.launch_server`.

SGLang admits a request when its prompt plus its *full* max_new_tokens fits in the free
KV pool, but counts requests that are already running at only `new_token_ratio` of their
remaining tokens (0.7 x --schedule-conservativeness at start-up; requests with ignore_eos
count in full). So: a tiny pool (--max-total-tokens 192), a low ratio
(--schedule-conservativeness 0.05), a first wave of two long generations that is already
decoding when a second wave of shorter ones arrives. The second wave is admitted against
a pool the first wave will still grow into: while a second-wave request runs (30 steps)
the first wave grows by 60 tokens, more than the pool had left after admission (less than
one more request, ~41 tokens), so decode runs out of KV slots however far the first wave
had got (up to ~50 steps) when the second arrived. SGLang then retracts requests (`KV cache
pool is full. Retract requests.`): frees their KV, requeues them, and later prefills
prompt + generated tokens again (here in 16-token chunks). It retracts the request with
the fewest generated tokens first, which has a few dozen by then.

Checked: retraction happened (the log line and each request's `num_retractions`), every
completion equals the reference forward's greedy completion, and every traced token
(first prefill, decode, the re-prefill of generated tokens, decode after it) used the
reference's hash ids and rows.
"""

from __future__ import annotations

import functools
import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engram_sglang.serving.launch import Server
from tests.support.demo_support import demo_dir, reference

pytestmark = pytest.mark.slow

POOL = 192  # KV-cache tokens
CHUNK = 16  # --chunked-prefill-size: re-prefills of retracted requests span chunks
FIRST_LENGTHS, FIRST_NEW = (10, 12), 80  # decoding when the second wave arrives
SECOND_LENGTHS, SECOND_NEW = (8, 11, 9, 12), 30
RETRACT_LINE = re.compile(r"KV cache pool is full\. Retract requests\. #retracted_reqs: (\d+)")


def prompts(lengths, salt: int) -> list[list[int]]:
    tok = reference().tokenizer
    text = "\n".join(Path(m.__file__).read_text() for m in (functools, json, os))
    ids = tok(text)["input_ids"]
    return [ids[((i + salt) * 1499) % (len(ids) - 100):][:n] for i, n in enumerate(lengths)]


def generate(server: Server, prompt: list[int], new: int) -> dict:
    # ignore_eos=False: SGLang reserves a running request's remaining tokens in full when
    # it ignores EOS, and then never over-commits. The demo model has no EOS token, so
    # every request still runs to max_new_tokens (checked below).
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": False}}
    return server.post("/generate", body)


def trace_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for_decode(trace: Path, after: int, width: int, timeout: float = 120) -> bool:
    """Until a decode step of `width` requests follows the first `after` trace lines (the
    whole first wave decodes)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(s["mode"] == "decode" and len(set(s["req"])) >= width for s in trace_lines(trace)[after:]):
            return True
        time.sleep(0.05)
    return False


def trace_records(steps: list[dict]) -> list[dict]:
    """Per request lifetime in a slot (as demo_support.trace_requests, plus each token's
    step mode and conv-window checksums): a slot's tokens continue its record while their
    positions follow on."""
    records, current = [], {}
    for step in steps:
        for t, (slot, pos, tok) in enumerate(zip(step["req"], step["pos"], step["tok"])):
            r = current.get(slot)
            if r is None or r["pos"][-1] + 1 != pos:
                r = current[slot] = {"tok": [], "pos": [], "mode": [], "ids": {}, "sum": {}, "conv": {}}
                records.append(r)
            r["tok"].append(tok)
            r["pos"].append(pos)
            r["mode"].append(step["mode"])
            for key in ("ids", "sum", "conv"):  # conv: each token's conv-window entry checksums
                for layer, values in step.get(key, {}).items():
                    r[key].setdefault(layer, []).append(values[t])
    return records


@pytest.fixture(scope="module")
def pressured(tmp_path_factory):
    work = tmp_path_factory.mktemp("retraction")
    trace = work / "trace.jsonl"
    first, second = prompts(FIRST_LENGTHS, 3), prompts(SECOND_LENGTHS, 11)
    server = Server(demo_dir(), engram={"placement": "device", "trace": str(trace)}, max_total_tokens=POOL,
                    args=("--schedule-conservativeness", "0.05", "--chunked-prefill-size", str(CHUNK)),
                    log_path=work / "sglang.log")
    with server, ThreadPoolExecutor(len(first) + len(second)) as pool:
        before = len(trace_lines(trace))  # the /health probe's step
        waves = [pool.submit(generate, server, p, FIRST_NEW) for p in first]
        decoding = wait_for_decode(trace, before, len(first))
        waves += [pool.submit(generate, server, p, SECOND_NEW) for p in second]
        outs = [w.result() for w in waves]
    steps = trace_lines(trace)
    # How far the first wave got before the second was admitted (the margin of the set-up).
    starts = [i for i, s in enumerate(steps) if s["mode"] == "extend"
              and any(s["tok"][j:j + len(p[:CHUNK])] == p[:CHUNK] for p in second for j in range(len(s["tok"])))]
    lead = sum(1 for s in steps[: starts[0] if starts else len(steps)] if s["mode"] == "decode")
    print(f"retraction set-up: first wave decoded {lead} steps before the second wave's first prefill")
    return {"prompts": first + second, "news": [FIRST_NEW] * len(first) + [SECOND_NEW] * len(second),
            "outs": outs, "decoding": decoding, "lead": lead,
            "log": (work / "sglang.log").read_text(errors="replace"), "steps": steps}


@pytest.fixture(scope="module")
def checked(pressured):
    """The reference forward of each request's full sequence (teacher forcing: the model is
    causal, so greedy completions agree iff every served token is the argmax there), and
    every trace record against it."""
    ref = reference()
    requests = [p + o["output_ids"] for p, o in zip(pressured["prompts"], pressured["outs"])]
    forwards = [ref.forward(seq[:-1]) for seq in requests]
    greedy = [f.logits[len(p) - 1:].argmax(-1).tolist() for f, p in zip(forwards, pressured["prompts"])]
    counts = {"tokens": 0, "ids_wrong": 0, "sums_wrong": 0, "unmatched": 0, "reprefilled": 0, "after_reprefill": 0,
              "reprefill_chunks": 0}
    covered = [set() for _ in requests]
    for rec in trace_records(pressured["steps"]):
        if rec["tok"] == [0] and rec["pos"] == [0]:
            continue  # SGLang's /health probe
        lo, hi = rec["pos"][0], rec["pos"][-1] + 1
        match = [i for i, seq in enumerate(requests) if seq[lo:hi] == rec["tok"]]
        if len(match) != 1:
            counts["unmatched"] += 1
            continue
        i = match[0]
        step = forwards[i]
        for j, layer in enumerate(ref.engram.layer_ids):
            counts["ids_wrong"] += sum(a != b for a, b in zip(rec["ids"][str(layer)], step.hash_ids[lo:hi, j].tolist()))
            counts["sums_wrong"] += sum(a != b for a, b in zip(rec["sum"][str(layer)], step.checksums[lo:hi, j].tolist()))
        counts["tokens"] += hi - lo
        covered[i].update(range(lo, hi))
        # A prefill that covers generated tokens is the re-prefill of a retracted request.
        prompt_len = len(pressured["prompts"][i])
        extend_end = max((p + 1 for p, m in zip(rec["pos"], rec["mode"]) if m == "extend"), default=0)
        if extend_end > prompt_len:
            counts["reprefilled"] += extend_end - prompt_len
            counts["after_reprefill"] += sum(1 for m in rec["mode"] if m == "decode")
            counts["reprefill_chunks"] = max(counts["reprefill_chunks"], -(-(extend_end - lo) // CHUNK))
    # Every token a request fed the model (all but its last output) was traced at least once.
    counts["untraced"] = sum(len(seq) - 1 - len(c) for seq, c in zip(requests, covered))
    print(f"retraction trace: {counts}")
    return {"greedy": greedy, "trace": counts}


def test_kv_pressure_retracted_requests(pressured):
    assert pressured["decoding"], "the first wave never reached decode"
    retracts = [int(n) for n in RETRACT_LINE.findall(pressured["log"])]
    per_request = [o["meta_info"]["num_retractions"] for o in pressured["outs"]]
    assert sum(retracts) >= 1, ("SGLang never retracted a request (no 'KV cache pool is full' line); the first "
                                f"wave had decoded {pressured['lead']} steps when the second was admitted")
    assert sum(per_request) == sum(retracts) >= 1, (per_request, retracts)


def test_completions_of_retracted_and_other_requests_equal_the_reference(pressured, checked):
    for o, new in zip(pressured["outs"], pressured["news"]):
        assert o["meta_info"]["finish_reason"]["type"] == "length" and len(o["output_ids"]) == new, o["meta_info"]
    served = [o["output_ids"] for o in pressured["outs"]]
    retracted = [o["meta_info"]["num_retractions"] > 0 for o in pressured["outs"]]
    assert served == checked["greedy"], f"retracted: {retracted}"


def test_traced_hash_ids_and_rows_of_retracted_requests_equal_the_reference(checked):
    """Every step, token by token; among them the re-prefilled generated tokens of the
    retracted requests and their decode steps after it (history rebuilt from scratch)."""
    counts = checked["trace"]
    assert counts["unmatched"] == 0 and counts["untraced"] == 0, counts
    assert counts["reprefilled"] >= 1 and counts["after_reprefill"] >= 1, counts
    assert counts["ids_wrong"] == 0 and counts["sums_wrong"] == 0, counts


def test_conv_cache_is_allocated_with_the_kv_pool_and_counted_in_its_token_cost(pressured):
    """(Rides on this module's server.) The per-KV-slot conv caches exist before the server
    is up, not from the first forward (on a GPU that may be a CUDA-graph capture), and
    SGLang sized the KV pool with their bytes in each token's cost."""
    from engram_sglang.tools.demo.model import ENGRAM_LAYERS, HIDDEN

    lines = pressured["log"].splitlines()
    first = lambda text: next(i for i, line in enumerate(lines) if text in line)  # noqa: E731
    caches = [i for i, line in enumerate(lines) if f"engram conv cache: {POOL + 2} slots x {HIDDEN}" in line]
    assert len(caches) == len(ENGRAM_LAYERS), caches
    assert first("KV Cache is allocated") < min(caches) and max(caches) < first("Uvicorn running on")
    assert max(caches) < first("Prefill batch")
    assert f"each KV-cache token also holds {len(ENGRAM_LAYERS) * HIDDEN * 2} B of Engram state" in pressured["log"]


def test_traced_server_said_once_that_cuda_graphs_are_off(pressured):
    """(Rides on this module's server, started with --engram-trace.) The launcher turned
    SGLang's CUDA graphs off for the per-step trace, in one line, and SGLang took the flags."""
    assert pressured["log"].count("engram-sglang notice: --engram-trace writes each step's ids") == 1
    assert "'cuda_graph_backend_decode': 'disabled', 'cuda_graph_backend_prefill': 'disabled'" in pressured["log"]
