"""One real server under KV-cache pressure, shared by test_e2e_retraction.py and test_e2e_modes.py.

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

A server start costs ~20 s of the suite's two cores, so both modules' waves run on one
server (`--engram-ablation on`, --engram-trace), one after the other, each on prompts of its
own: first the retraction waves with every request in the default mode, then the modes
waves (six requests in six modes) and the modes module's further requests. Each phase gets
its own slice of the trace and of the server's log.
"""

from __future__ import annotations

import functools
import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

from engram_sglang.serving.launch import Server, ServerError
from tests.support.demo_support import demo_dir, reference

POOL = 192  # KV-cache tokens
CHUNK = 16  # --chunked-prefill-size: re-prefills of retracted requests span chunks
FIRST_LENGTHS, FIRST_NEW = (10, 12), 80  # decoding when the second wave arrives
SECOND_LENGTHS, SECOND_NEW = (8, 11, 9, 12), 30
RETRACT_LINE = re.compile(r"KV cache pool is full\. Retract requests\. #retracted_reqs: (\d+)")

# The prompts of each phase (salts of `prompts`): distinct, so that the second phase finds
# nothing of the first in the radix cache and meets the same pressure.
RETRACTION_SALTS = (5, 13)
MODES_SALTS = (3, 11)
FIRST_MODES = ("off", "on")
SECOND_MODES = ("prefill", "decode", {"mode": "window", "from": 3, "until": 20}, "decode")
PREFIX_NEW = 6


def prompts(lengths, salt: int) -> list[list[int]]:
    tok = reference().tokenizer
    text = "\n".join(Path(m.__file__).read_text() for m in (functools, json, os))
    ids = tok(text)["input_ids"]
    return [ids[((i + salt) * 1499) % (len(ids) - 100):][:n] for i, n in enumerate(lengths)]


def generate(server: Server, prompt: list[int], new: int, mode=None) -> dict:
    # ignore_eos=False: SGLang reserves a running request's remaining tokens in full when
    # it ignores EOS, and then never over-commits. The demo model has no EOS token, so
    # every request still runs to max_new_tokens (checked by the tests).
    params = {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": False}
    if mode is not None:
        params["custom_params"] = {"engram": mode}
    return server.post("/generate", {"input_ids": prompt, "sampling_params": params})


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


def waves(server: Server, trace: Path, salts: tuple[int, int], modes: Optional[tuple] = None) -> dict:
    """The two waves (module docstring); `modes` gives each request's Engram mode in order
    (first wave, then second), None the server's default. Returns the prompts, their new
    tokens, the outputs, whether the first wave decoded before the second came, and the
    trace lines [start, end) of the phase."""
    first, second = prompts(FIRST_LENGTHS, salts[0]), prompts(SECOND_LENGTHS, salts[1])
    modes = modes or (None,) * (len(first) + len(second))
    out = {"prompts": first + second, "news": [FIRST_NEW] * len(first) + [SECOND_NEW] * len(second),
           "start": len(trace_lines(trace))}
    with ThreadPoolExecutor(len(first) + len(second)) as pool:
        sent = [pool.submit(generate, server, p, FIRST_NEW, m) for p, m in zip(first, modes)]
        out["decoding"] = wait_for_decode(trace, out["start"], len(first))
        sent += [pool.submit(generate, server, p, SECOND_NEW, m) for p, m in zip(second, modes[len(first):])]
        out["outs"] = [f.result() for f in sent]
    out["end"] = len(trace_lines(trace))
    return out


def hostile_requests(server: Server, prompt: list[int]) -> dict:
    """Bad requests a few ms each (issue 22 item 13): a 1 MiB mode value, a custom_params that
    is not an object, a batch with one bad element, and a streamed bad mode."""
    params = {"max_new_tokens": 2, "temperature": 0.0}
    vocab = json.loads((demo_dir() / "config.json").read_text())["vocab_size"]
    return {"vocab": vocab,
        "huge_mode": raw_post(server, {"input_ids": prompt, "sampling_params": {
            **params, "custom_params": {"engram": "x" * (1 << 20)}}}),
        "string_params": raw_post(server, {"input_ids": prompt, "sampling_params": {**params, "custom_params": "off"}}),
        "batch": raw_post(server, {"input_ids": [prompt, prompt[:5] + [vocab], prompt],
                                   "sampling_params": params}),
        "streamed_bad_mode": raw_post(server, {"input_ids": prompt, "stream": True, "sampling_params": {
            **params, "custom_params": {"engram": "sideways"}}}),
    }


def raw_post(server: Server, body: dict, timeout: float = 120) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(server.url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def log_size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def serve_under_pressure(work: Path) -> dict:
    """The shared server's two phases (module docstring): {"retraction": ..., "modes": ...},
    each with its outputs, its trace lines and its part of the log; "log" is the whole log."""
    trace, log = work / "trace.jsonl", work / "sglang.log"
    server = Server(demo_dir(), engram={"placement": "device", "trace": str(trace), "ablation": "on"},
                    max_total_tokens=POOL, log_path=log,
                    args=("--schedule-conservativeness", "0.05", "--chunked-prefill-size", str(CHUNK)))
    prefix_prompt = prompts((24,), 29)[0]
    with server:
        retraction = waves(server, trace, RETRACTION_SALTS)
        retraction["log_end"] = log_size(log)
        modes = waves(server, trace, MODES_SALTS, FIRST_MODES + SECOND_MODES)
        modes["log_start"] = retraction["log_end"]
        modes.update(modes=list(FIRST_MODES + SECOND_MODES), prefix_prompt=prefix_prompt)
        # The same prompt with Engram on twice (the second reuses the first's prefix: the
        # control), then off: it must not reuse the prefix computed with Engram on.
        modes["prefix"] = [generate(server, prefix_prompt, PREFIX_NEW, m) for m in ("on", "on", "off")]
        modes["bad"] = {}
        for bad in ("sideways", {"mode": "window"}, {"mode": "window", "from": 5, "until": 2}):
            try:
                generate(server, prefix_prompt, 2, bad)
                modes["bad"][json.dumps(bad)] = None
            except ServerError as e:
                modes["bad"][json.dumps(bad)] = str(e)
        modes["hostile"] = hostile_requests(server, prefix_prompt)
        modes["stats"] = server.engram_stats()
        # A full disk under the trace (a symlink to /dev/full: a real ENOSPC) must not stop serving.
        trace.rename(work / "trace.kept")
        trace.symlink_to("/dev/full")
        modes["full_disk"] = [generate(server, prefix_prompt, PREFIX_NEW, m)["output_ids"] for m in ("on", "off")]
        trace.unlink()
        (work / "trace.kept").rename(trace)
    steps, raw = trace_lines(trace), log.read_bytes()
    for phase, lo, hi in ((retraction, 0, retraction["log_end"]), (modes, modes["log_start"], len(raw))):
        phase["steps"] = steps[phase["start"]:phase["end"]]
        phase["log"] = raw[lo:hi].decode(errors="replace")
    return {"retraction": retraction, "modes": modes, "log": raw.decode(errors="replace")}
