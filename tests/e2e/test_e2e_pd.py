"""End to end on CPU: PD disaggregation, a prefill server, a decode server and SGLang's router
(`sglang_router.launch_router --pd-disaggregation --mini-lb`), the KV and the Engram state
moved by Mooncake over TCP (tests/support/pd_support.py: the CPU's flags, a network namespace
of the test's own).

One module fixture: the pair (`--engram-ablation on`, 16-token prefill chunks) behind the
router serves four requests at once in four Engram modes, prompts of one to three chunks; a
second decode server with the two negative controls (`--engram-debug skip-conv-transfer,
corrupt-history`) continues two more prompts of the same prefill server, driven as the
router drives a pair (bootstrap host, port and room to both servers); a third decode server
of other settings (`--engram-ablation off`) is sent one prompt of the same prefill server.

Checked: every completion equals the reference forward's in its mode, the decode server having
checked each request's Engram identity as it arrived (the refusal: tests/serving/test_pd.py);
on both sides every traced token's hash ids and row checksums equal the reference's; every
entry of every traced token's conv window equals the conv input its position had where it was computed (prefill,
another chunk, or decode), so the decode server's windows over prompt positions hold what the
prefill server computed. The controls fail on those checksums: conv windows over prompt
positions that do not hold the prefill server's conv inputs (and only those), hash ids that
are not the reference's (and only on the decode side). The decode server of other settings
refuses the transfer in one line (HTTP 400) and goes on serving.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from engram_sglang.serving.launch import ServerError, free_port
from engram_sglang.serving.modes import mask_for, parse_mode
from tests.support.demo_support import demo_dir, reference
from tests.support.pd_support import NoNamespace, Router, own_network_namespace, pd_server
from tests.support.pressure import prompts, trace_lines, trace_records

pytestmark = pytest.mark.slow

CHUNK = 16
LENGTHS, MODES = (10, 23, 40, 33), ("on", "prefill", "decode", {"mode": "window", "from": 5, "until": 30})
CONTROL_LENGTHS = (20, 14)
NEW = 10


def body(prompt: list[int], mode=None) -> dict:
    params = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
    if mode is not None:
        params["custom_params"] = {"engram": mode}
    return {"input_ids": prompt, "sampling_params": params}


def pd_generate(prefill, bootstrap_port: int, decode, request: dict) -> dict:
    """One request to a pair without the router: the same body, with the bootstrap fields, to both."""
    request = {**request, "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port,
               "bootstrap_room": random.getrandbits(62)}
    with ThreadPoolExecutor(2) as pool:
        sent = pool.submit(prefill.post, "/generate", request)
        out = decode.post("/generate", request)
        sent.result()
    return out


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    work = tmp_path_factory.mktemp("pd")
    traces = {k: work / f"{k}.jsonl" for k in ("prefill", "decode", "control")}
    engram = {"placement": "device", "ablation": "on"}
    try:
        with own_network_namespace():
            bootstrap = free_port()
            prefill = pd_server(demo_dir(), "prefill", engram={**engram, "trace": traces["prefill"]},
                                bootstrap_port=bootstrap, log_path=work / "prefill.log",
                                args=("--chunked-prefill-size", str(CHUNK), "--enable-metrics"))
            decode = pd_server(demo_dir(), "decode", engram={**engram, "trace": traces["decode"]},
                               log_path=work / "decode.log")
            control = pd_server(demo_dir(), "decode", log_path=work / "control.log",
                                engram={**engram, "trace": traces["control"],
                                        "debug": "skip-conv-transfer,corrupt-history"})
            stranger = pd_server(demo_dir(), "decode", log_path=work / "stranger.log",
                                 engram={"placement": "device", "ablation": "off"})
            servers = (prefill, decode, control, stranger)
            try:
                with ThreadPoolExecutor(len(servers)) as pool:
                    for f in [pool.submit(s.start) for s in servers]:
                        f.result()
                router = Router(prefill, bootstrap, decode, work / "router.log").start()
                try:
                    main, ctrl = prompts(LENGTHS, 17), prompts(CONTROL_LENGTHS, 41)
                    with ThreadPoolExecutor(len(main) + len(ctrl)) as pool:
                        outs = [pool.submit(router.post, "/generate", body(p, m)) for p, m in zip(main, MODES)]
                        controls = [pool.submit(pd_generate, prefill, bootstrap, control, body(p)) for p in ctrl]
                        outs, controls = [f.result() for f in outs], [f.result() for f in controls]
                    transfers = transfer_metrics(prefill)  # SGLang's own count of what its transfer moved
                    try:
                        # A control request's prompt: its prefill records equal that request's.
                        refused = str(pd_generate(prefill, bootstrap, stranger, body(ctrl[0])))
                    except ServerError as e:
                        refused = f"ServerError: {e}"
                    stranger_health = stranger.engram_stats()
                finally:
                    router.stop()
            finally:
                with ThreadPoolExecutor(len(servers)) as pool:  # each stop waits out SGLang's 5 s SIGTERM poll
                    list(pool.map(lambda s: s.stop(), servers))
    except NoNamespace as e:
        pytest.skip(f"PD servers run in a network namespace of the test's own: {e}")
    return {"prompts": main, "outs": outs, "control_prompts": ctrl, "controls": controls,
            "refused": refused, "stranger_health": stranger_health, "transfers": transfers, "work": work,
            "steps": {k: trace_lines(v) for k, v in traces.items()},
            "logs": {k: (work / f"{k}.log").read_text(errors="replace")
                     for k in ("prefill", "decode", "control", "stranger")}}


def transfer_metrics(server) -> dict:
    """SGLang's `sglang:kv_transfer_total_mb` histogram on the prefill server (`--enable-metrics`):
    the MiB each transferred request moved (its KV, plus every registered state component: our
    conv inputs and identity rows), summed and counted over the server's label sets."""
    import urllib.request

    with urllib.request.urlopen(server.url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    out = {"sum_mib": 0.0, "count": 0}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in ("sglang:kv_transfer_total_mb_sum", "sglang:kv_transfer_total_mb_count"):
            value = float(line.rsplit(" ", 1)[1])
            out["sum_mib" if name.endswith("_sum") else "count"] += value
    return out


def reference_forwards(prompts_, outs, modes):
    ref = reference()
    out = []
    for p, o, m in zip(prompts_, outs, modes):
        seq = p + o["output_ids"]
        on = mask_for(parse_mode(m), len(p), len(seq) - 1)
        out.append((seq, on, ref.forward(seq[:-1], engram_on=on)))
    return out


def records_of(steps, seqs):
    """Trace records matched to requests (a record's tokens at its positions are one request's)."""
    for rec in trace_records(steps):
        if rec["tok"] == [0] and rec["pos"] == [0]:
            continue  # SGLang's /health probe
        lo, hi = rec["pos"][0], rec["pos"][-1] + 1
        match = [i for i, seq in enumerate(seqs) if seq[lo:hi] == rec["tok"]]
        yield rec, (match[0] if len(match) == 1 else None)


def lookups_against_reference(steps, forwards) -> dict:
    ref = reference()
    seqs = [seq for seq, _, _ in forwards]
    counts = {"tokens": 0, "ids_wrong": 0, "sums_wrong": 0, "unmatched": 0}
    for rec, i in records_of(steps, seqs):
        if i is None:
            counts["unmatched"] += 1
            continue
        lo, hi = rec["pos"][0], rec["pos"][-1] + 1
        step = forwards[i][2]
        for j, layer in enumerate(ref.engram.layer_ids):
            counts["ids_wrong"] += sum(a != b for a, b in zip(rec["ids"][str(layer)], step.hash_ids[lo:hi, j].tolist()))
            counts["sums_wrong"] += sum(a != b for a, b in zip(rec["sum"][str(layer)], step.checksums[lo:hi, j].tolist()))
        counts["tokens"] += hi - lo
    return counts


def conv_windows(sides: dict, seqs) -> dict:
    """Every conv-window entry of every traced token against the conv input its position had
    where it was computed (the last entry of that position's own window), per side."""
    layers = reference().layers
    own: dict[tuple, int] = {}  # (request, layer, position) -> checksum of its conv input
    entries = []
    for side, steps in sides.items():
        for rec, i in records_of(steps, seqs):
            assert i is not None, (side, rec["pos"][:3])
            for layer, windows in rec["conv"].items():
                for pos, window in zip(rec["pos"], windows):
                    own[i, layer, pos] = window[-1]
                    entries.append((side, i, layer, pos, window))
    counts = {}
    for side, i, layer, pos, window in entries:
        c = counts.setdefault(side, {"entries": 0, "wrong": 0, "prompt_wrong": 0, "from_prompt": 0, "from_chunk": 0,
                                     "missing": 0})
        e = layers[int(layer)]
        prompt_len = len(seqs[i]) - NEW
        for j, got in enumerate(window):
            src = pos - (e.kernel_size - 1 - j) * e.dilation
            want = 0 if src < 0 else own.get((i, layer, src))
            if want is None:
                c["missing"] += 1
                continue
            c["entries"] += 1
            c["wrong"] += got != want
            if side != "prefill" and 0 <= src < prompt_len:
                c["from_prompt"] += 1
                c["prompt_wrong"] += got != want
            if side == "prefill" and src >= 0 and src // CHUNK != pos // CHUNK:
                c["from_chunk"] += 1
    return counts


@pytest.fixture(scope="module")
def checked(pd):
    main = reference_forwards(pd["prompts"], pd["outs"], MODES)
    ctrl = reference_forwards(pd["control_prompts"], pd["controls"], ["on"] * len(pd["controls"]))
    steps = pd["steps"]
    # The prefill server traced both pairs' prompts: split its records by request.
    seqs = [s for s, _, _ in main] + [s for s, _, _ in ctrl]
    out = {
        "greedy": [f.logits[len(p) - 1:].argmax(-1).tolist() for p, (_, _, f) in zip(pd["prompts"], main)],
        "lookups": {side: lookups_against_reference(steps[side], main + ctrl) for side in ("prefill", "decode")},
        "control_lookups": lookups_against_reference(steps["control"], main + ctrl),
        "conv": conv_windows({"prefill": steps["prefill"], "decode": steps["decode"]}, seqs),
        "control_conv": conv_windows({"prefill": steps["prefill"], "control": steps["control"]}, seqs)["control"],
    }
    print(f"PD checks: {out['lookups']} {out['conv']} control: {out['control_lookups']} {out['control_conv']}")
    return out


def test_pd_completions_through_the_router_equal_the_reference(pd, checked):
    """Four requests at once, four Engram modes, prompts over one to three prefill chunks."""
    for o in pd["outs"]:
        assert o["meta_info"]["finish_reason"]["type"] == "length" and len(o["output_ids"]) == NEW, o["meta_info"]
    assert [o["output_ids"] for o in pd["outs"]] == checked["greedy"]
    identities = set()
    for side in ("prefill", "decode"):
        line = next(ln for ln in pd["logs"][side].splitlines() if f"engram PD ({side}): conv state of 2" in ln)
        identities.add(line.split("identity: ")[1])
    # The decode server checked every request's identity row (serving/pd.py): one that had not
    # arrived, or differed, would have failed the request.
    assert len(identities) == 1 and "ablation on" in identities.pop()
    assert "its transfer is refused" not in pd["logs"]["decode"]


def test_pd_traced_lookups_on_both_sides_equal_the_reference(checked):
    for side, counts in checked["lookups"].items():
        assert counts["tokens"] > 0 and counts["unmatched"] == 0, (side, counts)
        assert counts["ids_wrong"] == 0 and counts["sums_wrong"] == 0, (side, counts)


def test_pd_conv_windows_on_decode_hold_the_prefill_servers_conv_inputs(checked):
    """Across prefill and decode (the transferred conv state) and across prefill chunks."""
    for side, c in checked["conv"].items():
        assert c["wrong"] == 0 and c["missing"] == 0 and c["entries"] > 0, (side, c)
    assert checked["conv"]["decode"]["from_prompt"] >= len(LENGTHS) * 4, checked["conv"]
    assert checked["conv"]["prefill"]["from_chunk"] > 0, checked["conv"]


def test_negative_control_conv_state_not_transferred_fails_on_the_window_checksums(checked):
    """Decode with `skip-conv-transfer`: its windows over prompt positions are wrong, and only those."""
    c = checked["control_conv"]
    assert c["from_prompt"] > 0 and c["prompt_wrong"] == c["from_prompt"], c
    assert c["wrong"] == c["prompt_wrong"], c


def test_negative_control_corrupted_history_on_decode_fails_on_the_hash_ids(pd, checked):
    """Decode with `corrupt-history`: its hash ids (and so rows) are not the reference's;
    the prefill server's, for the same prompts, are."""
    assert checked["control_lookups"]["ids_wrong"] > 0 and checked["control_lookups"]["sums_wrong"] > 0
    assert checked["lookups"]["prefill"]["ids_wrong"] == 0
    assert "engram-sglang DEBUG skip-conv-transfer" in pd["logs"]["control"]


def test_pd_decode_of_other_engram_settings_refuses_the_transfer_in_one_line(pd):
    """A decode server with `--engram-ablation off` behind a prefill server with it on: the
    request fails with HTTP 400 naming both identities, before any decode step; the server
    stays up."""
    assert pd["refused"].startswith("ServerError: POST /generate: HTTP 400"), pd["refused"]
    assert "differs from this decode server's" in pd["refused"] and "its transfer is refused" in pd["refused"]
    lines = [ln for ln in pd["logs"]["stranger"].splitlines() if "its transfer is refused" in ln]
    assert lines and all("ablation on) differs" in ln and "ablation off)" in ln for ln in lines), lines
    assert pd["stranger_health"], "the decode server of other settings answers /server_info after the refusal"


def test_pd_transfer_metrics_count_the_kv_and_the_engram_state(pd):
    """What SGLang's own transfer metrics (`sglang:kv_transfer_total_mb`, Mooncake's count:
    KV indices x the KV item bytes + state indices x the sum of every state component's item
    bytes) say the six requests moved, against what the prompts' KV and our two components come
    to. SGLang prices every state index at conv + identity bytes and counts the identity row as
    one more index per request; the bytes our components really add are written beside it
    (pd_transfer.json, for `python -m bench.engram_traffic --measured`)."""
    from engram_sglang.serving import pd as pd_mod

    raw = json.loads((demo_dir() / "config.json").read_text())
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    kv_per_token = 2 * raw["num_hidden_layers"] * raw["num_key_value_heads"] * head_dim * 2  # K and V, bf16
    conv_per_token = len(raw["engram_layer_ids"]) * raw["hidden_size"] * 2  # one bf16 conv input per layer
    sent = [len(p) for p in pd["prompts"]] + [len(p) for p in pd["control_prompts"]]
    t = pd["transfers"]
    assert t["count"] == len(sent)
    measured = round(t["sum_mib"] * 2**20)
    tokens = sum(sent)
    assert measured == kv_per_token * tokens + (conv_per_token + pd_mod.IDENTITY_BYTES) * (tokens + len(sent))
    ours = conv_per_token * tokens + pd_mod.IDENTITY_BYTES * len(sent)
    out = {"requests": len(sent), "prompt_tokens": tokens, "sglang_transfer_bytes": measured,
           "kv_bytes": kv_per_token * tokens, "engram_state_bytes": ours,
           "engram_state_vs_kv": ours / (kv_per_token * tokens),
           "how": "SGLang 0.5.23 sglang:kv_transfer_total_mb over a demo PD pair on the CPU (mooncake_tcp)"}
    (pd["work"] / "pd_transfer.json").write_text(json.dumps(out, indent=1))
    assert 0.4 < out["engram_state_vs_kv"] < 0.6  # the demo: 2 Engram layers' conv inputs vs 4 layers' K and V
