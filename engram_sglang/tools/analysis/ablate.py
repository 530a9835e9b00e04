"""`engram-sglang ablate`: what Engram is worth in bits/token, per domain and mode.

Teacher forcing through a real SGLang server's input logprobs (analysis/scoring.py), against
a running server (`--url`) or one it starts on `--model` with `--engram-ablation on`:

* per domain (`--domain NAME=FILE`, a name given again adds a file): each file cut into documents (analysis/inputs.py), each
  scored with Engram on and off (every token is a prompt token under teacher forcing, so
  "prefill" equals on and "decode" equals off);
* answer spans (`--pairs FILE.jsonl`, fields prompt and answer): only the answer's tokens
  are scored, with Engram on everywhere, on only at the positions whose next-token
  prediction is scored (a window from the prompt's last token through the answer's
  second-to-last: "answer-window"), and nowhere.

The table gives bits/token (total bits / total tokens of the set) per mode and the difference
vs on with a 95% interval from a paired bootstrap over documents (analysis/report.py).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from ...core.config import DEFAULT_TABLE_DIR
from ...core.errors import EngramError
from . import report
from .inputs import Pair, check_chunk_tokens, documents, load_pairs, parse_domain
from .scoring import ReferenceScorer, ServerScorer, window

DOMAIN_MODES = ("on", "off")
ANSWER_WINDOW = "answer-window"


def pair_modes(pair: Pair) -> dict:
    """The modes of one pair by name: Engram everywhere, at the positions whose logits score
    the answer ([P-1, P+A-1) for prompt length P, answer length A), nowhere."""
    p, a = len(pair.prompt), len(pair.answer)
    return {"on": "on", ANSWER_WINDOW: window(p - 1, p + a - 1), "off": "off"}


def score_domains(scorer, tokenizer, domains: Sequence[tuple[str, Path]], chunk_tokens: int,
                  max_docs: Optional[int]) -> list[dict]:
    rows = []
    files: dict[str, list[Path]] = {}
    for name, path in domains:  # a name given twice is one domain of several files
        files.setdefault(name, []).append(path)
    for name, paths in files.items():
        docs = [d for path in paths for d in documents(tokenizer, path, chunk_tokens, max_docs)]
        per_mode = {}
        for mode in DOMAIN_MODES:
            per_mode[mode] = scorer.score([(d, mode) for d in docs])
        if per_mode["off"] == per_mode["on"]:
            # Bit-equal logprobs with Engram off: the server ignored the mode (a plugin without
            # modes, or SGLang dropping custom_params); figures of 0 would be silently wrong.
            raise EngramError(f"domain {name}: the server returned the same logprobs with Engram off as on for all "
                              f"{len(docs)} documents: it does not apply per-request Engram modes (start it with "
                              f"--engram-ablation on, with an engram-sglang that has them)")
        rows += report.summarize(name, "domain", per_mode)
    return rows


def score_pairs(scorer, pairs: Sequence[Pair], set_name: str = "answer spans") -> list[dict]:
    """Answer-token logprobs of every pair in each of pair_modes."""
    names = list(pair_modes(pairs[0]))
    items, spans = [], []
    for pair in pairs:
        ids = pair.prompt + pair.answer
        modes = pair_modes(pair)
        items += [(ids, modes[m]) for m in names]
        spans.append((len(pair.prompt) - 1, len(ids) - 1))  # logprob j scores token j + 1
    got = scorer.score(items)
    per_mode = {m: [] for m in names}
    for k, (lo, hi) in enumerate(spans):
        for j, m in enumerate(names):
            per_mode[m].append(got[k * len(names) + j][lo:hi])
    return report.summarize(set_name, "answer", per_mode)


def run_ablate(scorer, tokenizer, *, domains: Sequence[tuple[str, Path]] = (), pairs: Optional[Path] = None,
               chunk_tokens: int = 512, max_docs: Optional[int] = None, source: str = "", file=None) -> dict:
    file = file or sys.stdout
    check_chunk_tokens(chunk_tokens)
    if max_docs is not None and (isinstance(max_docs, bool) or not isinstance(max_docs, int) or max_docs < 1):
        raise EngramError(f"--max-docs must be a whole number >= 1, got {max_docs!r}")
    if not domains and pairs is None:
        raise EngramError("nothing to score: give --domain NAME=FILE and/or --pairs FILE.jsonl")
    pair_list = load_pairs(pairs, tokenizer) if pairs is not None else None
    for _, path in domains:  # every file checked before the first (slow) request
        documents(tokenizer, path, chunk_tokens, 1)
    t0 = time.perf_counter()
    rows = score_domains(scorer, tokenizer, domains, chunk_tokens, max_docs)
    if pair_list:
        rows += score_pairs(scorer, pair_list)
    seconds = time.perf_counter() - t0
    print(f"teacher-forced bits/token ({source}; documents of {chunk_tokens} tokens, the first token of each "
          f"unscored; answer spans: answer tokens only; vs on: paired bootstrap over documents, "
          f"{report.BOOTSTRAP} draws; worse: documents with more bits than with Engram on)", file=file)
    print(report.table(rows), file=file)
    print(f"  scored in {seconds:.1f} s", file=file)
    return {"source": source, "chunk_tokens": chunk_tokens, "max_docs": max_docs,
            "domains": [[name, str(path)] for name, path in domains], "pairs": str(pairs) if pairs else None,
            "modes": {"domain": list(DOMAIN_MODES), "answer": ["on", ANSWER_WINDOW, "off"]},
            "bootstrap": {"draws": report.BOOTSTRAP, "seed": report.SEED}, "rows": rows, "seconds": seconds}


# ------------------------------------------------------------------------ command
def _engram_flag(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--engram takes KEY=VALUE (an --engram-KEY flag of the server), got {text!r}")
    return key.removeprefix("engram-").removeprefix("--engram-"), value


def cmd_ablate(args) -> int:
    from ..outputs import check_output
    from ..profiling import load_tokenizer

    for flag, target in (("--json", args.json), ("--png", args.png)):
        if target:  # before the scoring (and a server start) of minutes
            check_output(target, flag)
    domains = [parse_domain(d) for d in args.domain or ()]
    if not 1 <= args.concurrency <= 1024:
        raise EngramError(f"--concurrency must be from 1 to 1024, got {args.concurrency}")
    if args.reference:
        if args.url:
            raise EngramError("--reference scores with the reference forward: leave out --url")
        tokenizer = load_tokenizer(args.model)
        scorer = ReferenceScorer(args.model, args.table_dir)
        payload = run_ablate(scorer, tokenizer, domains=domains, pairs=args.pairs, chunk_tokens=args.chunk_tokens,
                             max_docs=args.max_docs, source=f"reference forward of {args.model}")
    elif args.url:
        tokenizer = load_tokenizer(args.model)
        payload = run_ablate(ServerScorer(args.url, args.concurrency), tokenizer, domains=domains, pairs=args.pairs,
                             chunk_tokens=args.chunk_tokens, max_docs=args.max_docs, source=f"server {args.url}")
    else:
        payload = _with_server(args, domains)
    if args.json:
        print(f"wrote {report.write_json(args.json, payload)}")
    if args.png:
        print(f"wrote {report.plot(args.png, payload['rows'], 'engram-sglang ablate: ' + payload['source'])}")
    return 0


def _with_server(args, domains) -> dict:
    from ...serving.launch import Server
    from ..profiling import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    # Check the inputs before a server start costs half a minute.
    if args.pairs is not None:
        load_pairs(args.pairs, tokenizer)
    for _, path in domains:
        documents(tokenizer, path, args.chunk_tokens, 1)
    engram = {"ablation": "on", **dict(args.engram or ())}
    if args.table_dir:
        engram["table_dir"] = args.table_dir
    log = Path(tempfile.gettempdir()) / f"engram-ablate-{int(time.time())}.log"
    server = Server(args.model, engram=engram, max_total_tokens=max(8192, 2 * args.chunk_tokens * args.concurrency),
                    log_path=log)
    print(f"starting sglang on {args.model} (log: {log}) ...", flush=True)
    with server:
        return run_ablate(ServerScorer(server.url, args.concurrency), tokenizer, domains=domains, pairs=args.pairs,
                          chunk_tokens=args.chunk_tokens, max_docs=args.max_docs,
                          source=f"sglang on {args.model}")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "ablate", help="teacher-forced bits/token with Engram on, off and on the answer span only (a real server)",
        description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--model", required=True, metavar="DIR",
                   help="model directory (its tokenizer; the server's model when no --url)")
    p.add_argument("--url", help="a running server (started with --engram-ablation on), e.g. http://127.0.0.1:30000")
    p.add_argument("--reference", action="store_true",
                   help="score with the PyTorch reference forward instead of a server (Qwen3 Engram models)")
    p.add_argument("--table-dir", help=f"table directory (default: MODEL/{DEFAULT_TABLE_DIR})")
    p.add_argument("--engram", action="append", type=_engram_flag, metavar="KEY=VALUE",
                   help="an --engram-KEY VALUE flag for the server this starts, e.g. placement=disk (repeatable)")
    p.add_argument("--domain", action="append", metavar="NAME=FILE",
                   help="a domain's text file (repeatable; the same NAME again adds a file to that domain)")
    p.add_argument("--pairs", type=Path, metavar="FILE.jsonl", help="prompt/answer pairs, one JSON object a line")
    p.add_argument("--chunk-tokens", type=int, default=512, help="tokens per document (default 512)")
    p.add_argument("--max-docs", type=int, default=None, help="at most this many documents per file (its first)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    p.add_argument("--json", type=Path, help="write the figures as JSON here")
    p.add_argument("--png", type=Path, help="write the figure (bits/token; difference vs on) here")
    p.set_defaults(func=cmd_ablate)
    return p
