"""End to end on CPU: Engram modes per request (serving/modes.py) on real `sglang.launch_server`.

The server of tests/support/pressure.py (`--engram-ablation on`, the retraction set-up of
test_e2e_retraction.py: a 192-token KV pool, a first wave decoding when a second arrives),
after its retraction phase: six requests in six modes (off, on, prefill, decode, a window,
decode) share decode and prefill steps, and SGLang retracts some of the second wave, whose
modes depend on position (prefill, decode, window), and prefills their generated tokens
again. Then, on the same server: a prompt served with Engram on and again with it off (the
prefix cache must not hand the off request the on request's KV), and requests with bad
modes (HTTP 400, one line).

Checked: every completion equals the reference forward's in its mode (teacher forcing, one
forward per request with its per-position mask), every traced token's hash ids and row
checksums equal the reference's (+0.0 rows for tokens with Engram off), a step holds tokens
of several modes with Engram on and off, and the stores served exactly the rows of the
tokens with Engram on (the retraction phase's tokens, all on, included).
"""

from __future__ import annotations

import json

import pytest

from engram_sglang.serving.modes import mask_for, parse_mode
from tests.support.demo_support import reference
from tests.support.pressure import PREFIX_NEW, RETRACT_LINE, trace_records

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(pressure_run):
    """The modes phase: its trace lines and log part, plus the whole log (start-up lines)."""
    return {**pressure_run["modes"], "whole_log": pressure_run["log"]}


@pytest.fixture(scope="module")
def checked(served):
    """Each wave request's reference forward over its whole sequence in its mode (teacher
    forcing: the model is causal and a token's mode depends only on its position), and every
    trace record of the waves against it."""
    ref = reference()
    seqs = [p + o["output_ids"] for p, o in zip(served["prompts"], served["outs"])]
    masks = [mask_for(parse_mode(m), len(p), len(s) - 1) for m, p, s in zip(served["modes"], served["prompts"], seqs)]
    forwards = [ref.forward(s[:-1], m) for s, m in zip(seqs, masks)]
    greedy = [f.logits[len(p) - 1:].argmax(-1).tolist() for f, p in zip(forwards, served["prompts"])]
    counts = {"tokens": 0, "ids_wrong": 0, "sums_wrong": 0, "on_wrong": 0, "unmatched": 0, "reprefilled_by_position": 0}
    steps = served["steps"]
    for rec in trace_records(steps):
        if rec["tok"] == [0] and rec["pos"] == [0]:
            continue  # SGLang's /health probe
        lo, hi = rec["pos"][0], rec["pos"][-1] + 1
        match = [i for i, s in enumerate(seqs) if s[lo:hi] == rec["tok"]]
        if len(match) != 1:
            counts["unmatched"] += 1
            continue
        i = match[0]
        for j, layer in enumerate(ref.engram.layer_ids):
            counts["ids_wrong"] += sum(a != b for a, b in zip(rec["ids"][str(layer)], forwards[i].hash_ids[lo:hi, j].tolist()))
            counts["sums_wrong"] += sum(a != b for a, b in zip(rec["sum"][str(layer)], forwards[i].checksums[lo:hi, j].tolist()))
        counts["tokens"] += hi - lo
        rec["request"] = i
        # A prefill over generated tokens of a request whose mode depends on position.
        extend_end = max((p + 1 for p, m in zip(rec["pos"], rec["mode"]) if m == "extend"), default=0)
        if extend_end > len(served["prompts"][i]) and served["modes"][i] not in ("on", "off"):
            counts["reprefilled_by_position"] += extend_end - len(served["prompts"][i])
    # Each traced token's on/off flag against its request's mask, step by step.
    mixed = 0
    for step in steps:
        kinds = {}
        for slot, pos, tok, on in zip(step["req"], step["pos"], step["tok"], step["on"]):
            match = [i for i, s in enumerate(seqs) if pos < len(s) and s[pos] == tok]
            if len(match) == 1:
                counts["on_wrong"] += int(bool(on) != masks[match[0]][pos])
                kinds.setdefault(json.dumps(served["modes"][match[0]]), set()).add(bool(on))
        flags = set().union(*kinds.values()) if kinds else set()
        if len(kinds) >= 3 and flags == {True, False}:
            mixed += 1
    counts["mixed_steps"] = mixed
    print(f"modes trace: {counts}")
    return {"greedy": greedy, "trace": counts, "masks": masks}


def test_a_batch_mixes_modes_and_each_request_equals_the_reference_in_its_mode(served, checked):
    assert served["decoding"], "the first wave never reached decode"
    for o, new in zip(served["outs"], served["news"]):
        assert o["meta_info"]["finish_reason"]["type"] == "length" and len(o["output_ids"]) == new, o["meta_info"]
    assert [o["output_ids"] for o in served["outs"]] == checked["greedy"], served["modes"]
    counts = checked["trace"]
    assert counts["mixed_steps"] >= 1, "no step held tokens of three modes with Engram on and off"
    assert counts["on_wrong"] == 0 and counts["unmatched"] == 0 and counts["tokens"] > 200, counts
    assert counts["ids_wrong"] == 0 and counts["sums_wrong"] == 0, counts


def test_the_modes_change_the_completions(served, checked):
    """The control: the same requests all with Engram on complete differently (the modes
    are not a no-op on this model)."""
    ref = reference()
    seqs = [p + o["output_ids"] for p, o in zip(served["prompts"], served["outs"])]
    differ = 0
    for s, p, m in zip(seqs, served["prompts"], served["modes"]):
        if m == "on":
            continue
        on = ref.forward(s[:-1]).logits[len(p) - 1:].argmax(-1).tolist()
        differ += on != s[len(p):]
    assert differ >= 3, differ


def test_retracted_requests_keep_their_modes(served, checked):
    """SGLang retracted requests and prefilled their generated tokens again; those tokens
    kept the mode their position gives (checked token by token above), not the batch kind's."""
    retracts = sum(int(n) for n in RETRACT_LINE.findall(served["log"]))
    per_request = [o["meta_info"]["num_retractions"] for o in served["outs"]]
    assert retracts >= 1 and sum(per_request) == retracts, (per_request, retracts)
    by_position = [n for n, m in zip(per_request, served["modes"]) if m not in ("on", "off")]
    assert sum(by_position) >= 1, (per_request, served["modes"])
    assert checked["trace"]["reprefilled_by_position"] >= 1, checked["trace"]


def test_an_off_request_does_not_reuse_a_prefix_computed_with_engram_on(served):
    ref = reference()
    prompt = served["prefix_prompt"]
    on1, on2, off = served["prefix"]
    assert on2["meta_info"]["cached_tokens"] >= len(prompt) - 1, "the control: an on request reuses the on prefix"
    assert off["meta_info"]["cached_tokens"] == 0, off["meta_info"]
    assert on1["output_ids"] == on2["output_ids"] == ref.generate(prompt, PREFIX_NEW)[0]
    assert off["output_ids"] == ref.generate(prompt, PREFIX_NEW, "off")[0]
    assert off["output_ids"] != on1["output_ids"]


def test_a_full_disk_under_the_trace_does_not_stop_serving(served):
    ref, prompt = reference(), served["prefix_prompt"]
    assert served["full_disk"] == [ref.generate(prompt, PREFIX_NEW, m)[0] for m in ("on", "off")]
    assert served["log"].count("No space left on device") >= 1


def test_a_bad_mode_gets_http_400_with_one_line(served):
    for bad, error in served["bad"].items():
        assert error is not None and "HTTP 400" in error, (bad, error)
        message = json.loads(error.split(": ", 2)[2])["error"]["message"]
        assert message.startswith('sampling_params.custom_params["engram"]') and "\n" not in message, message


def _message(body: bytes) -> str:
    return json.loads(body)["error"]["message"]


def test_hostile_requests_get_one_short_line(served):
    """A 1 MiB mode value is echoed cut to 64 characters (the body stays small); a custom_params
    that is not a JSON object is HTTP 400, not the server's mode; a batch's bad element is named."""
    hostile = served["hostile"]
    status, body = hostile["huge_mode"]
    assert status == 400 and len(body) < 1000, (status, len(body))
    assert _message(body).endswith(f"... ({(1 << 20) + 2} bytes)"), _message(body)
    status, body = hostile["string_params"]
    assert status == 400 and _message(body).startswith("sampling_params.custom_params must be a JSON object"), body
    status, body = hostile["batch"]
    assert status == 400 and _message(body).startswith(f"batch[1] of 3: input_ids: token id {hostile['vocab']} "), body
    assert len([ln for ln in served["whole_log"].splitlines() if "x" * 65 in ln]) == 0  # nor a 1 MiB log line


def test_a_streamed_bad_mode_is_http_400_before_the_stream(served):
    """SGLang's /generate with "stream": true answers 200 before the tokenizer manager checks
    the request (its checks then arrive as an error event); plugin/http_server.py checks it
    first: HTTP 400 with the same one line as unstreamed."""
    status, body = served["hostile"]["streamed_bad_mode"]
    assert status == 400, (status, body)
    assert _message(body).startswith('sampling_params.custom_params["engram"] must be'), body


def test_tokens_with_engram_off_read_no_rows(served):
    """The stores served exactly the rows of the tokens with Engram on (24 per token and
    layer on this model: every hash column of every order)."""
    stats = served["stats"]
    cols = reference().engram.hash_columns
    assert stats["engram_off_tokens"] > 100, stats
    on_tokens = stats["tokens"] - stats["engram_off_tokens"]
    assert all(t["rows_served"] == on_tokens * cols for t in stats["tables"]), (on_tokens, stats["tables"])


def test_the_server_said_once_that_cuda_graphs_are_off(served):
    """(Rides on this server, started with --engram-ablation on and --engram-trace: one
    notice, the trace's; the modes' own reason is tested in test_modes.py.)"""
    log = served["whole_log"]
    assert log.count("engram-sglang notice: ") == 1
    assert log.count("engram-sglang notice: --engram-trace writes each step's ids") == 1
    assert "'cuda_graph_backend_decode': 'disabled', 'cuda_graph_backend_prefill': 'disabled'" in log
