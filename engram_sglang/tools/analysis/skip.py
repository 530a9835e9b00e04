"""A usefulness predictor before retrieval (issue 16 item 5), as an experiment on the reference
forward: a per-row history of gate scores (`engram-sglang scan --gate-stats FILE`: each row's
mean gate and read count over a corpus), and rows whose historical mean gate is below a
threshold skipped: not read, their slot filled with +0.0 (what a row a rank does not hold
reads as). Rows the history never saw are read. It reports, on other text, the share of
reads saved against the bits/token lost vs reading every row. The skipped row also leaves
the token's key, so the gate of its other rows moves: the measurement includes that.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np

from ...core.errors import EngramError
from ...core.recordfile import RecordFormat, read_record, write_record

GATE_STATS = RecordFormat("engram-gate-stats", 1, "gate-statistics",
                          missing_hint=" (engram-sglang scan --gate-stats writes one)")
FORMAT = GATE_STATS.tag


def write_gate_stats(path: str | os.PathLike, corpus, layer_ids: Sequence[int], fingerprint: str, meta: dict) -> Path:
    """Per Engram layer: the rows the corpus read (sorted), their mean gate and read count
    (a record file, recordfile.py; `.npz` is appended to a name without it, as numpy does)."""
    arrays = {}
    for i, L in enumerate(layer_ids):
        flat = corpus.hash_ids[:, i, :].reshape(-1)
        g = np.repeat(corpus.gates[:, i], corpus.hash_ids.shape[2])
        rows, inv, reads = np.unique(flat, return_inverse=True, return_counts=True)
        arrays[f"rows_{L}"] = rows.astype(np.int64)
        arrays[f"gate_{L}"] = (np.bincount(inv.reshape(-1), weights=g, minlength=len(rows)) / reads).astype(np.float32)
        arrays[f"reads_{L}"] = reads.astype(np.int64)
    return write_record(gate_stats_path(path), GATE_STATS, arrays, {"fingerprint": fingerprint, **meta})


def gate_stats_path(path: str | os.PathLike) -> Path:
    """The file a gate-statistics target names: `.npz` appended to a name without it."""
    path = Path(path)
    return path if path.suffix == ".npz" else path.with_name(path.name + ".npz")


def read_gate_stats(path: str | os.PathLike, fingerprint: str) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """layer id -> (rows, mean gate) of a gate-statistics file made for this Engram config."""
    with read_record(path, GATE_STATS) as record:
        meta = record.meta
        if meta.get("fingerprint") != fingerprint:
            raise EngramError(f"{record.path}: gate statistics {meta.get('format')} for config "
                              f"{meta.get('fingerprint')}, want {FORMAT} for {fingerprint}")
        return {L: (record.array(f"rows_{L}").astype(np.int64), record.array(f"gate_{L}").astype(np.float32))
                for L in record.numbered("rows_")}


def skipped_rows(stats: dict[int, tuple[np.ndarray, np.ndarray]], threshold: float) -> dict[int, np.ndarray]:
    """Per layer the (sorted) rows whose historical mean gate is below `threshold`."""
    return {L: rows[gate < threshold] for L, (rows, gate) in stats.items()}


class Skipping:
    """Wraps a reference model so its row reads skip `skip` (layer -> sorted row ids): those
    slots read +0.0; counts the reads made and skipped."""

    def __init__(self, reference, skip: dict[int, np.ndarray]):
        self.reference, self.skip = reference, skip
        self.reads = self.skipped = 0

    def __enter__(self):
        import torch

        ref, original = self.reference, self.reference.rows

        def rows(hash_ids, on=None):
            out = original(hash_ids, on)
            for i, L in enumerate(ref.engram.layer_ids):
                drop = torch.from_numpy(np.isin(hash_ids[:, i].numpy(), self.skip.get(L, ())))
                if on is not None:
                    drop &= on.unsqueeze(-1)
                    self.reads += int(on.sum()) * hash_ids.shape[2]
                else:
                    self.reads += hash_ids[:, i].numel()
                self.skipped += int(drop.sum())
                out[L] = out[L].masked_fill(drop.unsqueeze(-1), 0)
            return out

        ref.rows = rows  # the forward reads rows through self.rows
        return self

    def __exit__(self, *exc):
        del self.reference.rows  # back to the class's method


def random_rows(stats, skip: dict[int, np.ndarray], seed: int = 0) -> dict[int, np.ndarray]:
    """The control: per layer as many rows as `skip` holds, drawn at random from the rows the
    history saw (the predictor's candidates), so the gate's ranking is the only difference."""
    rng = np.random.default_rng(seed)
    return {L: np.sort(rng.choice(stats[L][0], size=len(rows), replace=False)) for L, rows in skip.items()}


def evaluate(reference, docs: Sequence[Sequence[int]], stats, thresholds: Sequence[float],
             control: bool = True) -> list[dict]:
    """Per threshold: share of reads saved, bits/token, and the difference vs no skipping;
    with `control`, the same for as many rows drawn at random (random_rows)."""
    from .report import bits
    from .scoring import ReferenceScorer

    scorer = ReferenceScorer(None, reference=reference)
    items = [(d, "on") for d in docs]
    tokens = sum(len(d) - 1 for d in docs)
    base = sum(bits(x) for x in scorer.score(items)) / tokens
    out = []
    for t in thresholds:
        skip = skipped_rows(stats, t)
        with Skipping(reference, skip) as s:
            b = sum(bits(x) for x in scorer.score(items)) / tokens
        row = {"threshold": float(t), "rows_skipped": int(sum(map(len, skip.values()))), "reads": s.reads,
               "reads_saved": s.skipped / max(1, s.reads), "bits_per_token": b, "diff_vs_all_rows": b - base}
        if control and row["rows_skipped"]:
            with Skipping(reference, random_rows(stats, skip)) as r:
                b = sum(bits(x) for x in scorer.score(items)) / tokens
            row.update(random_reads_saved=r.skipped / max(1, r.reads), random_diff_vs_all_rows=b - base)
        out.append(row)
    return out
