"""`engram-sglang scan`: attribution and rank correlation on a corpus whose answers are known
by hand, and read counts on the demo model checked against the hasher alone."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

from engram_sglang.tools.analysis.inputs import documents
from engram_sglang.tools.analysis.scan import Corpus, layer_order, run_scan
from engram_sglang.tools.cli import main
from tests.support.demo_support import demo_dir, reference

CODE = Path(os.__file__).parent / "bisect.py"  # held out from the demo's tables


class Spaced:
    """A tokenizer stand-in: token ids joined by spaces."""

    def decode(self, ids):
        return " ".join(map(str, ids))


def hand_corpus() -> Corpus:
    """One document 1 2 1 2 1 3; bigrams (1,2) at positions 1, 3; (2,1) at 2, 4; (1,3) at 5.
    Two heads; head 0 puts (1,3) in (1,2)'s row 10 (a collision); position 0 has a padded
    look-back (rows 100, 101) and no bigram."""
    tokens = np.array([1, 2, 1, 2, 1, 3])
    head0 = [100, 10, 20, 10, 20, 10]
    head1 = [101, 11, 21, 11, 21, 31]
    ids = np.stack([head0, head1], axis=1)[:, None, :]  # [T, layers=1, columns=2]
    gates = np.array([0.1, 0.9, 0.2, 0.7, 0.3, 0.5], dtype=np.float32)[:, None]
    return Corpus(tokens, tokens.copy(), np.arange(6), ids, gates)


def test_gate_attribution_and_read_counts_by_hand():
    s = layer_order(hand_corpus(), Spaced(), 0, 2, n_heads=2, top=2, min_count=2)
    assert [(g["ngram"], g["count"]) for g in s["top_gate"]] == [("1 2", 2), ("2 1", 2)]
    assert [g["mean_gate"] for g in s["top_gate"]] == pytest.approx([0.8, 0.25])
    assert s["ngrams"] == 3 and s["ngrams_min_count"] == 2 and s["reads"] == 12 and s["rows_read"] == 7
    first, second = s["top_rows"]
    assert first == {"ngram": "1 2", "reads": 3, "mean_gate": pytest.approx(0.7), "other_ngrams": 1, "rows": [10, 11]}
    assert second["ngram"] == "2 1" and second["rows"] == [20, 21] and second["reads"] == 2
    # Rank correlation over every row read: (reads, mean gate) per row, written out by hand.
    reads = [3, 2, 1, 2, 2, 1, 1]  # rows 10, 20, 100, 11, 21, 31, 101
    gate = [0.7, 0.25, 0.1, 0.8, 0.25, 0.5, 0.1]
    assert s["spearman_gate_vs_reads"] == pytest.approx(spearmanr(gate, reads).statistic)


def test_spearman_with_ties_equals_scipys(rng=np.random.default_rng(3)):
    from engram_sglang.tools.analysis.scan import spearman

    for _ in range(20):
        a, b = rng.integers(0, 6, 40).astype(float), rng.normal(size=40).round(1)
        assert spearman(a, b) == pytest.approx(spearmanr(a, b).statistic, abs=1e-12)
    assert np.isnan(spearman(np.ones(5), np.arange(5)))


def test_scan_on_the_demo_model_counts_what_the_hasher_reads(tmp_path, capsys):
    ref = reference()
    tok = ref.tokenizer
    out = run_scan(ref, tok, [CODE], chunk_tokens=64, max_docs=3, top=3)
    docs = documents(tok, CODE, 64, 3)
    ids = torch.cat([ref.hasher.hash_sequence(torch.tensor(d)) for d in docs]).numpy()  # [T, layers, columns]
    H = ref.engram.n_heads
    for i, L in enumerate(ref.engram.layer_ids):
        for n in range(2, ref.engram.max_ngram_size + 1):
            s = out["layers"][str(L)][str(n)]
            cols = ids[:, i, (n - 2) * H:(n - 1) * H].reshape(-1)
            assert s["reads"] == cols.size
            top = s["top_rows"][0]
            rows, counts = np.unique(cols, return_counts=True)
            assert top["reads"] == counts.max() and counts[np.searchsorted(rows, top["rows"][0])] == counts.max()
            # The n-gram named for the row really hashes to it.
            gram = tok(top["ngram"], add_special_tokens=False)["input_ids"]
            if len(gram) == n:
                assert top["rows"][0] in ref.hasher.hash_sequence(torch.tensor(gram)).numpy()[-1, i]
            assert all(0 < g["mean_gate"] < 1 for g in s["top_gate"])
            assert -1 <= s["spearman_gate_vs_reads"] <= 1
    assert "Spearman" in capsys.readouterr().out


def test_scan_cli_json_and_a_missing_file(tmp_path, capsys):
    assert main(["scan", "--model", str(demo_dir()), str(CODE), "--chunk-tokens", "64", "--max-docs", "1",
                 "--json", str(tmp_path / "s.json")]) == 0
    data = json.loads((tmp_path / "s.json").read_text())
    assert "attributed whole to each of its n-grams" in data["attribution"] and data["documents"] == 1
    capsys.readouterr()
    assert main(["scan", "--model", str(demo_dir()), str(tmp_path / "nope.txt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope.txt: no such file or directory" in err


def test_gate_stats_round_trip_and_skipped_rows(tmp_path):
    from engram_sglang.core.errors import EngramError
    from engram_sglang.tools.analysis.skip import random_rows, read_gate_stats, skipped_rows, write_gate_stats

    path = write_gate_stats(tmp_path / "g.npz", hand_corpus(), [7], "fp", {})
    stats = read_gate_stats(path, "fp")
    rows, gate = stats[7]
    assert rows.tolist() == [10, 11, 20, 21, 31, 100, 101]
    assert gate.tolist() == pytest.approx([0.7, 0.8, 0.25, 0.25, 0.5, 0.1, 0.1])
    assert skipped_rows(stats, 0.3)[7].tolist() == [20, 21, 100, 101]
    control = random_rows(stats, skipped_rows(stats, 0.3))[7]
    assert len(set(control.tolist())) == 4 and set(control.tolist()) <= set(rows.tolist())
    assert control.tolist() == random_rows(stats, skipped_rows(stats, 0.3))[7].tolist()  # seeded
    with pytest.raises(EngramError, match="want engram-gate-stats-v1 for other"):
        read_gate_stats(path, "other")


def test_skipping_rows_reads_zeros_and_counts_reads():
    from engram_sglang.tools.analysis.scoring import ReferenceScorer
    from engram_sglang.tools.analysis.skip import Skipping

    ref = reference()
    doc = documents(ref.tokenizer, CODE, 64, 1)[0]
    scorer = ReferenceScorer(None, reference=ref)
    (plain,) = scorer.score([(doc, "on")])
    with Skipping(ref, {}) as s:
        assert scorer.score([(doc, "on")])[0] == plain  # nothing skipped: bit-equal
    assert s.skipped == 0 and s.reads == len(doc) * ref.engram.hash_columns * len(ref.engram.layer_ids)
    L = ref.engram.layer_ids[0]
    read = np.unique(ref.hasher.hash_sequence(torch.tensor(doc)).numpy()[:, 0])
    with Skipping(ref, {L: read}) as s:  # every row of the first Engram layer
        skipped = scorer.score([(doc, "on")])[0]
        assert s.skipped == len(doc) * ref.engram.hash_columns and skipped != plain
        assert ref.rows(ref.hasher.hash_sequence(torch.tensor(doc)))[L].abs().sum() == 0
    assert "rows" not in vars(ref)  # the model reads its rows again
