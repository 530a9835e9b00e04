"""Skipping reads by a per-row gate history (issue 16 item 5) on the demo model: reads saved vs
bits/token lost, on the reference forward (engram_sglang/tools/analysis/skip.py says how).

History: `scan`'s per-row mean gate over held-out standard-library files; evaluation: two other
held-out files (the README's ablation's code domain). The demo's tables are a memory of its
own corpus, so this demonstrates the experiment; it says nothing about DeepSeek.
Writes bench/out/skip_rows.json.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from pathlib import Path

from bench.common import OUT

STDLIB = Path(os.__file__).parent
HISTORY = [STDLIB / f for f in ("ast.py", "base64.py", "bdb.py", "calendar.py", "codecs.py", "configparser.py",
                                "contextlib.py", "copy.py", "csv.py", "difflib.py")]
EVAL = [STDLIB / "argparse.py", STDLIB / "dataclasses.py"]
THRESHOLDS = (0.0, 0.4, 0.5, 0.6, 2.0)


def main() -> int:
    from engram_sglang.models.reference import ReferenceModel
    from engram_sglang.tools.analysis.inputs import documents
    from engram_sglang.tools.analysis.scan import run_scan
    from engram_sglang.tools.analysis.skip import evaluate, read_gate_stats
    from engram_sglang.tools.demo.corpus import demo_corpus
    from engram_sglang.tools.demo.model import TABLE_DIR_NAME
    from engram_sglang.tools.demo.run import demo_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="build/demo", type=Path)
    ap.add_argument("--max-docs", type=int, default=6, help="documents of 512 tokens per file (default 6)")
    args = ap.parse_args()
    corpus = set(demo_corpus())
    assert all(p.read_text() not in corpus for p in HISTORY + EVAL), "a held-out file is in the demo corpus"
    model, _ = demo_model(args.workdir)
    ref = ReferenceModel(model, model / TABLE_DIR_NAME)
    OUT.mkdir(parents=True, exist_ok=True)
    stats_path = OUT / "skip_rows_gate_stats.npz"
    run_scan(ref, ref.tokenizer, HISTORY, max_docs=args.max_docs, gate_stats=stats_path, file=io.StringIO())
    stats = read_gate_stats(stats_path, ref.engram.fingerprint())
    docs = [d for f in EVAL for d in documents(ref.tokenizer, f, 512, args.max_docs)]
    rows = evaluate(ref, docs, stats, THRESHOLDS)
    print(f"history: {len(HISTORY)} held-out files (first {args.max_docs} documents each); evaluated on "
          f"{', '.join(p.name for p in EVAL)}: {len(docs)} documents, {sum(len(d) - 1 for d in docs):,} scored tokens")
    print(f"  {'skip rows with mean gate <':>27} {'rows':>7} {'reads saved':>12} {'bits/token':>11} {'vs all rows':>12}"
          f"   | as many random rows: {'reads saved':>11} {'vs all rows':>12}")
    for r in rows:
        ctl = (f"   | {'':>21} {r['random_reads_saved']:>11.1%} {r['random_diff_vs_all_rows']:>+12.3f}"
               if "random_reads_saved" in r else "")
        print(f"  {r['threshold']:>27.2f} {r['rows_skipped']:>7,} {r['reads_saved']:>12.1%} {r['bits_per_token']:>11.3f} "
              f"{r['diff_vs_all_rows']:>+12.3f}{ctl}")
    (OUT / "skip_rows.json").write_text(json.dumps({"history": [str(p) for p in HISTORY], "eval": [str(p) for p in EVAL],
                                                    "max_docs": args.max_docs, "rows": rows}, indent=2) + "\n")
    print(f"wrote {OUT / 'skip_rows.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
