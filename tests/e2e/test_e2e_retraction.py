"""End to end on CPU: decode retraction under KV-cache pressure, on real `sglang.launch_server`.

The set-up (tests/support/pressure.py, whose server this module shares with
test_e2e_modes.py): a 192-token KV pool, a low --schedule-conservativeness, a first wave of
two long generations already decoding when a second wave of shorter ones arrives, so that
decode runs out of KV slots and SGLang retracts requests (`KV cache pool is full. Retract
requests.`), frees their KV, requeues them and later prefills prompt + generated tokens again
(in 16-token chunks).

Checked: retraction happened (the log line and each request's `num_retractions`), every
completion equals the reference forward's greedy completion, and every traced token
(first prefill, decode, the re-prefill of generated tokens, decode after it) used the
reference's hash ids and rows.
"""

from __future__ import annotations

import pytest

from tests.support.demo_support import reference
from tests.support.pressure import CHUNK, POOL, RETRACT_LINE, SECOND_LENGTHS, trace_records

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pressured(pressure_run):
    run = pressure_run["retraction"]
    steps, second = run["steps"], run["prompts"][-len(SECOND_LENGTHS):]
    # How far the first wave got before the second was admitted (the margin of the set-up).
    starts = [i for i, s in enumerate(steps) if s["mode"] == "extend"
              and any(s["tok"][j:j + len(p[:CHUNK])] == p[:CHUNK] for p in second for j in range(len(s["tok"])))]
    lead = sum(1 for s in steps[: starts[0] if starts else len(steps)] if s["mode"] == "decode")
    print(f"retraction set-up: first wave decoded {lead} steps before the second wave's first prefill")
    return {**run, "lead": lead}


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
