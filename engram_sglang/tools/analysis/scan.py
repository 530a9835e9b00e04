"""`engram-sglang scan`: which n-grams open Engram's gate, which rows are read most, and
whether the two agree, per Engram layer and n-gram order.

The corpus is cut into documents (analysis/inputs.py), each run through the reference forward
(models/reference.py: exact, the same layer code the server runs), which gives every token's
hash ids and, per Engram layer, its gate a_t (layer.py `EngramLayer.gate`).

Attribution: the gate is one value per token and layer, computed from all of the token's
rows at once; scan attributes it whole to each of the token's n-grams (the last n tokens, for
every order n) and to each row the token read. An n-gram's gate score is the mean over its
occurrences; n-grams are keyed as the hash sees them (compressed token ids), shown as their
first occurrence's text, and a token whose n-gram reaches past the document start (a padded
look-back) has no n-gram of that order. A row's read count is how many tokens read it (one
read per token per hash column: what a server with Engram on everywhere reads); the most-read
rows are listed by the n-gram that read them most (every head of an order reads one row for
the same n-gram, so the heads' rows are one entry), with the reads of its most-read row and
how many other n-grams share that row (hash collisions). The rank correlation is Spearman's between a row's mean gate and its
read count, over the rows the corpus read.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ...core.config import DEFAULT_TABLE_DIR
from ...core.errors import EngramError

TOP = 10
MIN_COUNT = 3


@dataclass
class Corpus:
    """Everything scan needs of the documents, positions concatenated over documents."""

    tokens: np.ndarray  # int64 [T] raw token ids
    compressed: np.ndarray  # int64 [T] the hash's compressed ids
    doc_pos: np.ndarray  # int64 [T] position inside its document
    hash_ids: np.ndarray  # int64 [T, layers, columns]
    gates: np.ndarray  # float32 [T, layers]


def gates_and_ids(reference, docs: Sequence[Sequence[int]]) -> Corpus:
    """Run every document through the reference forward, catching each Engram layer's gate
    (a forward pre-hook computes it from the layer's own inputs)."""
    import torch

    layer_ids = list(reference.engram.layer_ids)
    caught: dict[int, torch.Tensor] = {}

    def hook_for(layer_id):
        def hook(module, args):
            caught[layer_id] = module.gate(args[0], args[1])
        return hook

    handles = [reference.layers[L].register_forward_pre_hook(hook_for(L)) for L in layer_ids]
    token_map = reference.hasher.token_map.numpy()
    tokens, ids, gates, pos = [], [], [], []
    try:
        for doc in docs:
            caught.clear()
            step = reference.forward(doc)
            tokens.append(np.asarray(doc, dtype=np.int64))
            ids.append(step.hash_ids.numpy())
            gates.append(torch.stack([caught[L].float() for L in layer_ids], dim=1).numpy())
            pos.append(np.arange(len(doc)))
    finally:
        for h in handles:
            h.remove()
    tok = np.concatenate(tokens)
    return Corpus(tok, token_map[tok].astype(np.int64), np.concatenate(pos), np.concatenate(ids), np.concatenate(gates))


def ngram_keys(c: Corpus, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions whose n-gram lies inside its document, their compressed n-grams [P, n])."""
    at = np.flatnonzero(c.doc_pos >= n - 1)
    keys = np.stack([c.compressed[at - (n - 1 - j)] for j in range(n)], axis=1)
    return at, keys


def _ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of x, ties given their mean rank."""
    order = np.argsort(x, kind="stable")
    _, first, inv, counts = np.unique(x[order], return_index=True, return_inverse=True, return_counts=True)
    mean_rank = first + (counts + 1) / 2.0  # ranks first+1 .. first+count, averaged
    out = np.empty(len(x), dtype=np.float64)
    out[order] = mean_rank[inv.reshape(-1)]
    return out


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation (Pearson's over tie-averaged ranks); NaN where either is constant."""
    ra, rb = _ranks(np.asarray(a, dtype=np.float64)), _ranks(np.asarray(b, dtype=np.float64))
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = np.sqrt((ra * ra).sum() * (rb * rb).sum())
    return float((ra * rb).sum() / den) if den > 0 else float("nan")


def layer_order(c: Corpus, tokenizer, i: int, n: int, n_heads: int, top: int, min_count: int) -> dict:
    """The figures of Engram layer index i, n-gram order n."""

    def text(pos: int) -> str:
        return tokenizer.decode(c.tokens[pos - n + 1:pos + 1].tolist())

    at, keys = ngram_keys(c, n)
    uniq, first, inv, counts = np.unique(keys, axis=0, return_index=True, return_inverse=True, return_counts=True)
    inv = inv.reshape(-1)
    mean_gate = np.bincount(inv, weights=c.gates[at, i], minlength=len(uniq)) / counts
    ok = np.flatnonzero(counts >= min_count)
    best = ok[np.lexsort((-counts[ok], -mean_gate[ok]))][:top]
    top_gate = [{"ngram": text(int(at[first[k]])), "mean_gate": float(mean_gate[k]), "count": int(counts[k])}
                for k in best]

    o = n - 2
    cols = slice(o * n_heads, (o + 1) * n_heads)
    rows = c.hash_ids[:, i, cols]  # [T, heads]
    flat = rows.reshape(-1)
    g = np.repeat(c.gates[:, i], n_heads)
    urows, rinv, reads = np.unique(flat, return_inverse=True, return_counts=True)
    row_gate = np.bincount(rinv.reshape(-1), weights=g, minlength=len(urows)) / reads
    rho = spearman(row_gate, reads) if len(urows) > 2 and reads.min() != reads.max() else float("nan")
    # Which n-gram read each hot row. Every head of an order reads one row for the same n-gram,
    # so the most-read rows come in sets of `n_heads`: one entry per leading n-gram, its rows listed.
    key_of = np.full(c.tokens.shape[0], -1, dtype=np.int64)
    key_of[at] = inv
    top_rows, by_gram = [], {}
    for k in np.lexsort((urows, -reads))[:top * n_heads * 4]:
        where = np.flatnonzero((rows == urows[k]).any(axis=1))
        grams = key_of[where]
        grams = grams[grams >= 0]
        if grams.size:
            g_ids, g_counts = np.unique(grams, return_counts=True)
            lead = int(g_ids[np.argmax(g_counts)])
            gram, others = text(int(at[first[lead]])), int(len(g_ids) - 1)
        else:
            lead, gram, others = -1, None, 0  # read only by padded look-backs (document starts)
        if lead in by_gram:
            by_gram[lead]["rows"].append(int(urows[k]))
            continue
        if len(top_rows) == top:
            continue
        by_gram[lead] = {"ngram": gram, "reads": int(reads[k]), "mean_gate": float(row_gate[k]),
                         "other_ngrams": others, "rows": [int(urows[k])]}
        top_rows.append(by_gram[lead])
    return {"ngrams": int(len(uniq)), "ngrams_min_count": int(len(ok)), "rows_read": int(len(urows)),
            "reads": int(flat.size), "spearman_gate_vs_reads": float(rho), "top_gate": top_gate, "top_rows": top_rows}


def run_scan(reference, tokenizer, files: Sequence[Path], *, chunk_tokens: int = 512, max_docs: Optional[int] = None,
             top: int = TOP, min_count: int = MIN_COUNT, gate_stats: Optional[Path] = None, file=None) -> dict:
    from .inputs import check_chunk_tokens, documents

    file = file or sys.stdout
    check_chunk_tokens(chunk_tokens)
    for name, v, lo in (("--top", top, 1), ("--min-count", min_count, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise EngramError(f"{name} must be a whole number >= {lo}, got {v!r}")
    if not files:
        raise EngramError("nothing to scan: name at least one text file")
    docs = []
    for f in files:
        docs += documents(tokenizer, f, chunk_tokens, max_docs)
    t0 = time.perf_counter()
    corpus = gates_and_ids(reference, docs)
    cfg = reference.engram
    out = {"files": [str(f) for f in files], "documents": len(docs), "tokens": int(corpus.tokens.shape[0]),
           "chunk_tokens": chunk_tokens, "min_count": min_count,
           "attribution": "a token's gate (one per token and Engram layer) is attributed whole to each of its "
                          "n-grams and to each row it read; an n-gram's score is its mean over occurrences",
           "gates": "exact, from the reference forward (models/reference.py)", "layers": {}}
    for i, L in enumerate(cfg.layer_ids):
        out["layers"][str(L)] = {str(n): layer_order(corpus, tokenizer, i, n, cfg.n_heads, top, min_count)
                                 for n in range(2, cfg.max_ngram_size + 1)}
    out["seconds"] = time.perf_counter() - t0
    if gate_stats is not None:
        from .skip import write_gate_stats

        path = write_gate_stats(gate_stats, corpus, cfg.layer_ids, cfg.fingerprint(),
                                {"files": out["files"], "tokens": out["tokens"]})
        print(f"wrote {path} (per Engram layer: each row read, its mean gate and reads; see analysis/skip.py)", file=file)
    print(render(out), file=file)
    return out


def render(out: dict) -> str:
    lines = [f"{out['documents']} documents, {out['tokens']:,} tokens ({', '.join(out['files'])}); gates {out['gates']}; "
             f"{out['attribution']}"]
    for L, orders in out["layers"].items():
        for n, s in orders.items():
            lines.append(f"\nlayer {L}, {n}-grams: {s['ngrams']:,} n-grams ({s['ngrams_min_count']:,} seen at least "
                         f"{out['min_count']} times), {s['rows_read']:,} rows read {s['reads']:,} times; Spearman "
                         f"(row mean gate vs row reads) {s['spearman_gate_vs_reads']:+.3f}")
            lines.append(f"  {'highest mean gate':<40} {'gate':>6} {'count':>6}   | {'most-read rows (n-gram)':<32} "
                         f"{'reads':>6} {'gate':>6} {'rows':>5} {'others':>6}")
            for a, b in zip_longest(s["top_gate"], s["top_rows"]):
                left = (f"  {a['ngram']!r:<40.40} {a['mean_gate']:6.3f} {a['count']:>6}" if a else f"  {'':<54}")
                right = (f"   | {b['ngram']!r:<32.32} {b['reads']:>6} {b['mean_gate']:6.3f} {len(b['rows']):>5} "
                         f"{b['other_ngrams']:>6}"
                         if b else "")
                lines.append(left + right)
    return "\n".join(lines)


def zip_longest(a, b):
    from itertools import zip_longest as z

    return z(a, b)


# ------------------------------------------------------------------------ command
def cmd_scan(args) -> int:
    from ...models.reference import ReferenceModel
    from ..outputs import check_output
    from ..profiling import corpus_files, load_tokenizer
    from .report import write_json
    from .skip import gate_stats_path

    if args.json:
        check_output(args.json, "--json")
    if args.gate_stats:
        check_output(args.gate_stats, "--gate-stats")
        check_output(gate_stats_path(args.gate_stats), "--gate-stats")
    files = corpus_files(args.corpus)
    tokenizer = load_tokenizer(args.model)
    reference = ReferenceModel(args.model, args.table_dir or Path(args.model) / DEFAULT_TABLE_DIR, tokenizer=tokenizer)
    out = run_scan(reference, tokenizer, files, chunk_tokens=args.chunk_tokens, max_docs=args.max_docs, top=args.top,
                   min_count=args.min_count, gate_stats=args.gate_stats)
    if args.json:
        print(f"wrote {write_json(args.json, out)}")
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "scan", help="per Engram layer and n-gram order: highest-gate n-grams, most-read rows, their rank correlation",
        description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--model", required=True, metavar="DIR", help="model directory (Qwen3 Engram family)")
    p.add_argument("--table-dir", help=f"table directory (default: MODEL/{DEFAULT_TABLE_DIR})")
    p.add_argument("corpus", nargs="+", metavar="FILE", help="text files (or directories of them)")
    p.add_argument("--chunk-tokens", type=int, default=512, help="tokens per document (default 512)")
    p.add_argument("--max-docs", type=int, default=None, help="at most this many documents per file")
    p.add_argument("--top", type=int, default=TOP, help=f"entries per table (default {TOP})")
    p.add_argument("--min-count", type=int, default=MIN_COUNT,
                   help=f"rank only n-grams seen at least this often (default {MIN_COUNT})")
    p.add_argument("--json", type=Path, help="write the figures as JSON here")
    p.add_argument("--gate-stats", type=Path, metavar="FILE.npz",
                   help="write each row's mean gate and read count here (the history analysis/skip.py reads)")
    p.set_defaults(func=cmd_scan)
    return p
