"""`engram-sglang ablate` and `scan` on the demo model, scored on held-out text: the README's figures.

The demo's tables are a memory of its own corpus (engram_sglang/tools/demo/corpus.py: the first standard-library
files in name order, and some prose), so these figures demonstrate the tools; they say
nothing about DeepSeek's Engram. Domains:

* "own corpus": _pyio.py, the last file the tables were built from (what the tables remember);
* "code, held out": standard-library files after the corpus (argparse.py, dataclasses.py);
* "licences, held out": /usr/share/common-licenses/{Apache-2.0,GPL-3} when present;
* answer spans: from the held-out files, every `def` line with the 48 tokens before it as
  the prompt and the next line as the answer (first N_PAIRS).

Writes bench/out/analysis_{ablate.json,ablate.png,scan.json,pairs.jsonl} and prints both tables.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from bench.common import OUT

STDLIB = Path(os.__file__).parent
OWN = [STDLIB / "_pyio.py"]
CODE = [STDLIB / "argparse.py", STDLIB / "dataclasses.py"]
LICENCES = [p for p in (Path("/usr/share/common-licenses/Apache-2.0"), Path("/usr/share/common-licenses/GPL-3"))
            if p.is_file()]
N_PAIRS = 48
PROMPT_TOKENS = 48


def held_out_check() -> None:
    """The held-out files really are outside the demo corpus (and the own-corpus file inside)."""
    from engram_sglang.tools.demo.corpus import demo_corpus

    corpus = set(demo_corpus())
    assert all(p.read_text(errors="replace") not in corpus for p in CODE + LICENCES), "a held-out file is in the corpus"
    assert all(p.read_text(errors="replace") in corpus for p in OWN), "the own-corpus file is not in the corpus"


def make_pairs(tokenizer, path: Path) -> Path:
    pairs = []
    for f in CODE:
        lines = f.read_text().splitlines(keepends=True)
        for k, line in enumerate(lines[:-1]):
            if line.lstrip().startswith("def ") and lines[k + 1].strip():
                before = "".join(lines[:k])
                ids = tokenizer(before, add_special_tokens=False)["input_ids"][-PROMPT_TOKENS:]
                pairs.append({"prompt": tokenizer.decode(ids) + line, "answer": lines[k + 1].rstrip("\n")})
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs[:N_PAIRS]))
    return path


def main() -> int:
    from engram_sglang.tools.cli import main as cli
    from engram_sglang.tools.demo.run import demo_model
    from engram_sglang.tools.profiling import load_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="build/demo", type=Path)
    ap.add_argument("--max-docs", type=int, default=6, help="documents of 512 tokens per file (default 6)")
    ap.add_argument("--reference", action="store_true", help="score with the reference forward, no server")
    args = ap.parse_args()
    held_out_check()
    model, _ = demo_model(args.workdir)
    OUT.mkdir(parents=True, exist_ok=True)
    pairs = make_pairs(load_tokenizer(model), OUT / "analysis_pairs.jsonl")
    domains = [f"own corpus={p}" for p in OWN] + [f"code, held out={p}" for p in CODE]
    domains += [f"licences, held out={p}" for p in LICENCES]
    rc = cli(["ablate", "--model", str(model), *(["--reference"] if args.reference else []),
              *[x for d in domains for x in ("--domain", d)], "--pairs", str(pairs), "--max-docs", str(args.max_docs),
              "--json", str(OUT / "analysis_ablate.json"), "--png", str(OUT / "analysis_ablate.png")])
    if rc:
        return rc
    return cli(["scan", "--model", str(model), *map(str, CODE), "--max-docs", str(args.max_docs), "--top", "5",
                "--json", str(OUT / "analysis_scan.json")])


if __name__ == "__main__":
    sys.exit(main())
