"""`engram-sglang ablate`: its statistics, its answer window, the reference scorer and bad
inputs. Its server scorer against a real server, in every mode, rides on the device server of
tests/e2e/test_e2e_serving.py (test_ablate_server_scores_equal_the_reference_in_every_mode)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from engram_sglang.core.errors import EngramError
from engram_sglang.tools.analysis import ablate, report
from engram_sglang.tools.analysis.inputs import MIN_DOC_TOKENS, Pair, documents, load_pairs
from engram_sglang.tools.analysis.scoring import ReferenceScorer
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
