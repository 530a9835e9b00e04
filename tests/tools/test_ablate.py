"""`engram-sglang ablate`: its statistics, its answer window, the reference scorer, bad inputs,
and one real server scored against the reference forward in every mode."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from engram_sglang.core.errors import EngramError
from engram_sglang.tools.analysis import ablate, report
from engram_sglang.tools.analysis.inputs import MIN_DOC_TOKENS, Pair, documents, load_pairs
from engram_sglang.tools.analysis.scoring import ReferenceScorer, ServerScorer
from engram_sglang.tools.cli import main
from tests.support.demo_support import demo_dir, reference

STDLIB = Path(os.__file__).parent
CODE = STDLIB / "bisect.py"  # held out: the demo's tables are built from the first stdlib files only
PAIRS = [{"prompt": "def bisect_left(a, x, lo=0, hi=None):\n    if lo < 0:\n        raise ", "answer": "ValueError("},
         {"prompt": "class Error(Exception):\n    def __init__(self, msg):\n        self.", "answer": "msg = msg"}]
CHUNK = 64


def write_pairs(path: Path, pairs=PAIRS) -> Path:
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return path


# ------------------------------------------------------------------- statistics
def test_summary_is_total_bits_over_total_tokens_with_a_paired_interval():
    on = [[-math.log(2)] * 4, [-2 * math.log(2)] * 2]  # 4 bits over 4 tokens, 4 bits over 2
    off = [[-2 * math.log(2)] * 4, [-2 * math.log(2)] * 2]  # +4 bits, +0 bits
    rows = report.summarize("d", "domain", {"on": on, "off": off, "same": on})
    by = {r["mode"]: r for r in rows}
    assert by["on"]["bits_per_token"] == pytest.approx(8 / 6)
    assert by["off"]["bits_per_token"] == pytest.approx(12 / 6)
    assert by["off"]["diff_vs_on"] == pytest.approx(4 / 6)
    lo, hi = by["off"]["diff_ci95"]
    assert 0 <= lo <= 4 / 6 <= hi <= 1  # resamples range from 0 (doc 2 only) to 1 (doc 1 only)
    assert by["off"]["docs_worse"] == 1
    # Paired: a mode equal to on has no spread at all, however different the documents are.
    assert by["same"]["diff_ci95"] == [0.0, 0.0] and by["same"]["diff_stderr"] == 0.0


# ------------------------------------------------------------------- inputs
def test_documents_are_consecutive_chunks_and_short_tails_are_dropped():
    tok = reference().tokenizer
    ids = tok(CODE.read_text(), add_special_tokens=False)["input_ids"]
    docs = documents(tok, CODE, CHUNK)
    assert sum(docs, []) == ids[: sum(map(len, docs))]
    assert all(len(d) == CHUNK for d in docs[:-1])
    tail = len(ids) % CHUNK
    assert len(docs) == len(ids) // CHUNK + (1 if tail >= MIN_DOC_TOKENS else 0)
    assert len(documents(tok, CODE, CHUNK, max_docs=2)) == 2


def test_pairs_are_tokenized_apart_and_bad_lines_name_the_line(tmp_path):
    tok = reference().tokenizer
    pairs = load_pairs(write_pairs(tmp_path / "p.jsonl"), tok)
    assert pairs[1].answer == tok("msg = msg", add_special_tokens=False)["input_ids"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(PAIRS[0]) + "\n\n" + json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(EngramError, match=r"bad.jsonl:3: each line is an object with string fields prompt and answer"):
        load_pairs(bad, tok)
    bad.write_text("{not json\n")
    with pytest.raises(EngramError, match=r"bad.jsonl:1: not JSON"):
        load_pairs(bad, tok)


# ------------------------------------------------------------------- the answer window
def test_answer_window_starts_at_the_prompts_last_token():
    """Engram is on exactly at the positions whose logits score the answer: the prompt's
    tokens before the last predict as with Engram off (causality), the first answer token
    (predicted by the prompt's last token) already sees Engram."""
    tok = reference().tokenizer
    prompt = tok(PAIRS[0]["prompt"], add_special_tokens=False)["input_ids"]
    answer = tok(PAIRS[0]["answer"], add_special_tokens=False)["input_ids"]
    pair = Pair(prompt, answer)
    modes = ablate.pair_modes(pair)
    assert modes["answer-window"] == {"mode": "window", "from": len(prompt) - 1, "until": len(prompt) + len(answer) - 1}
    scorer = ReferenceScorer(None, reference=reference())
    ids = prompt + answer
    win, off, on = scorer.score([(ids, modes["answer-window"]), (ids, "off"), (ids, "on")])
    p = len(prompt)
    assert win[: p - 1] == off[: p - 1]  # logprob j scores token j + 1: tokens 1..P-1 are prompt tokens
    assert win[p - 1] != off[p - 1]  # the first answer token: Engram on at position P-1
    assert win[p - 1] != on[p - 1]  # ... but not before it


def test_reference_ablation_on_the_demo_model(tmp_path, capsys):
    """Held-out code, Engram off costs bits on every document; the table, JSON and PNG."""
    rc = main(["ablate", "--model", str(demo_dir()), "--reference", "--domain", f"code={CODE}",
               "--chunk-tokens", str(CHUNK), "--max-docs", "3", "--pairs", str(write_pairs(tmp_path / "p.jsonl")),
               "--json", str(tmp_path / "a.json"), "--png", str(tmp_path / "a.png")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "answer-window" in out and "code" in out
    payload = json.loads((tmp_path / "a.json").read_text())
    by = {(r["set"], r["mode"]): r for r in payload["rows"]}
    assert by[("code", "off")]["docs_worse"] == 3 and by[("code", "off")]["diff_ci95"][0] > 0
    assert by[("answer spans", "off")]["diff_vs_on"] > 0
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_server_that_ignores_modes_is_refused():
    """Bit-equal logprobs with Engram off mean the server never applied the mode: one line,
    never a table of zeros."""

    class Deaf:
        def score(self, items):
            return [[-1.0] * (len(ids) - 1) for ids, _ in items]

    with pytest.raises(EngramError, match="does not apply per-request Engram modes"):
        ablate.score_domains(Deaf(), reference().tokenizer, [("code", CODE)], CHUNK, 2)


# ------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize("case", ["missing-domain", "bad-pairs", "bad-domain-arg", "nothing"])
def test_bad_inputs_are_one_line_and_exit_2(tmp_path, capsys, case):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": 3}\n')
    args = {"missing-domain": ["--domain", f"code={tmp_path / 'nope.py'}"],
            "bad-pairs": ["--pairs", str(bad)],
            "bad-domain-arg": ["--domain", "no-equals-sign"],
            "nothing": []}[case]
    # A dead URL: every input is checked before the first request.
    assert main(["ablate", "--model", str(demo_dir()), "--url", "http://127.0.0.1:9", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("engram-sglang: error: ")
    assert {"missing-domain": "nope.py: no such text file", "bad-pairs": "bad.jsonl:1:",
            "bad-domain-arg": "--domain takes NAME=FILE", "nothing": "nothing to score"}[case] in err


# ------------------------------------------------------------------- a real server
@pytest.mark.slow
def test_server_scores_equal_the_reference_in_every_mode(tmp_path):
    """One server (--engram-ablation on): per document and mode, the served teacher-forced
    bits equal the reference forward's up to the server's bf16 logits; Engram off and the
    answer window change them as they change the reference's."""
    from engram_sglang.serving.launch import Server

    tok = reference().tokenizer
    docs = documents(tok, CODE, CHUNK, max_docs=2)
    pairs = load_pairs(write_pairs(tmp_path / "p.jsonl"), tok)
    ref = ReferenceScorer(None, reference=reference())
    seqs = [(d, ("on", "off")) for d in docs] + [(p.prompt + p.answer, ablate.pair_modes(p).values()) for p in pairs]
    items = [(ids, m) for ids, modes in seqs for m in modes]
    want = ref.score(items)
    with Server(demo_dir(), engram={"ablation": "on"}, max_total_tokens=4096,
                log_path=tmp_path / "sglang.log") as server:
        got = ServerScorer(server.url, concurrency=len(items)).score(items)
        rows = ablate.score_pairs(ServerScorer(server.url), pairs)
    for (ids, mode), g, w in zip(items, got, want):
        g, w = np.array(g), np.array(w)
        # Logits in bf16 round a logprob by up to ~1 nat where |logprob| is in the hundreds.
        assert np.abs(g - w).max() <= 2.0, (mode, np.abs(g - w).max())
        assert abs(g.sum() - w.sum()) <= 0.01 * abs(w.sum()), mode
    on = {id(ids): g for (ids, mode), g in zip(items, got) if mode == "on"}
    for (ids, mode), g in zip(items, got):
        if mode != "on":  # the mode really reached the server's forward
            assert sum(g) < sum(on[id(ids)]) - 1, (mode, sum(g), sum(on[id(ids)]))
    assert {r["mode"] for r in rows} == {"on", "answer-window", "off"}
