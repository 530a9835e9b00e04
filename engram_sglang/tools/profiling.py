"""`engram-sglang profile`: how hot the rows of a model's Engram tables are on real text.

Text is tokenized with the model's tokenizer and hashed with its Engram config, served as
DECODE_BATCH concurrent request streams (the corpus' tokens cut into equal streams, each
hashed whole, one token per stream per decode step). The profile counts the reads of every
row and writes the hottest rows with their counts (a profile file, profile_format.py, that a
hot-row cache pre-warms from, `HotRowCache(profile=...)`); it prints the skew: the share of reads served
by the hottest 0.1%, 1% and 5% of rows, counted both of the table's rows and of the
distinct rows the text touched, per layer and n-gram order, and the share of duplicate
ids inside one decode batch.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np
import torch

from ..core.config import EngramConfig
from ..core.errors import EngramError
from ..core.hashing import EngramLayout, NgramHasher
from ..core.profile_format import FORMAT, MAX_PROFILE_ROWS, Profile, ProfileLayer, read_profile, write_profile_rows  # noqa: F401  (re-exported)
from .outputs import check_output

DECODE_BATCH = 256  # concurrent requests of a decode step, one token each
SHARES = (0.001, 0.01, 0.05)  # hottest shares of rows reported
MAX_STREAMS = 1 << 16
MAX_TOKENS = 1 << 40


# ------------------------------------------------------------------------ inputs
def load_tokenizer(model_dir: str | os.PathLike):
    """The model's fast tokenizer: tokenizer.json when present, else AutoTokenizer (local files only)."""
    model_dir = Path(model_dir)
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if (model_dir / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, use_fast=True)
    except (OSError, ValueError) as e:
        raise EngramError(f"{model_dir}: no tokenizer.json and AutoTokenizer cannot load one ({e})") from None


def corpus_files(paths: Sequence[str | os.PathLike]) -> list[Path]:
    """Files named, and the files under directories named (sorted), in order."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.is_file())
        elif p.is_file():
            out.append(p)
        else:
            raise EngramError(f"{p}: no such file or directory")
    return out


def read_texts(files: Iterable[Path], skipped: Optional[list] = None) -> Iterable[str]:
    """UTF-8 text of each file; binary files (a NUL byte, or not UTF-8) are skipped (and
    appended to `skipped`)."""
    for f in files:
        try:
            data = f.read_bytes()
        except OSError as e:
            raise EngramError(f"{f}: cannot read the corpus file ({e.strerror})") from None
        try:
            if b"\0" in data:
                raise UnicodeDecodeError("utf-8", data, 0, 1, "NUL byte")
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            if skipped is not None:
                skipped.append(f)
            continue
        yield text


def tokenize(tokenizer, texts: Iterable[str], max_tokens: Optional[int] = None) -> np.ndarray:
    """Token ids of the texts, one after the other (no special tokens), int64."""
    backend = tokenizer.backend_tokenizer
    parts, total = [], 0
    batch: list[str] = []

    def flush():
        nonlocal total
        for enc in backend.encode_batch(batch, add_special_tokens=False):
            parts.append(np.asarray(enc.ids, dtype=np.int64))
            total += len(enc.ids)
        batch.clear()

    for text in texts:
        batch.append(text)
        if len(batch) >= 64:
            flush()
        if max_tokens is not None and total >= max_tokens:
            break
    flush()
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return tokens[:max_tokens] if max_tokens is not None else tokens


# ------------------------------------------------------------------------ counting
@dataclass
class LayerCounts:
    """Reads of one layer: `counts[r]` for every table row r, and duplicates per decode step."""

    layer_id: int
    counts: torch.Tensor  # int32 [rows]: 4 bytes per table row (DeepSeek-V4.1: 1.5 GB per layer)
    column_bounds: tuple[int, ...]  # column c owns rows [b[c], b[c+1])
    n_heads: int
    dup: np.ndarray  # per order: ids that repeat one already in the same decode step
    reads_by_order: np.ndarray

    @property
    def rows(self) -> int:
        return self.counts.numel()


def count_reads(hasher: NgramHasher, tokens: np.ndarray, streams: int = DECODE_BATCH,
                window: int = 512, trace: Optional[list] = None) -> tuple[list[LayerCounts], int]:
    """Cut `tokens` into `streams` equal streams, hash each whole (in windows of steps, with
    history), count reads per row and duplicates per decode step. Returns (per layer, steps).
    With `trace` (a list), each window's ids [steps, streams, layers, columns] are appended
    to it in decode order (the planner replays them through the caches)."""
    cfg, layout = hasher.cfg, hasher.layout
    steps = tokens.shape[0] // streams
    if steps == 0:
        raise EngramError(f"the corpus has {tokens.shape[0]} tokens: fewer than one per stream ({streams} streams)")
    n_orders = cfg.max_ngram_size - 1
    H = cfg.n_heads
    per = tokens[: steps * streams].reshape(streams, steps)
    layers = [LayerCounts(L, torch.zeros(layout.rows(L), dtype=torch.int32), layout.column_bounds(i), H,
                          np.zeros(n_orders, dtype=np.int64), np.zeros(n_orders, dtype=np.int64))
              for i, L in enumerate(cfg.layer_ids)]
    back = cfg.max_ngram_size - 1
    for a in range(0, steps, window):
        b = min(steps, a + window)
        ids = torch.stack([
            hasher.hash_sequence(torch.from_numpy(per[s, a:b]), history=per[s, max(0, a - back):a].tolist(), start=a)
            for s in range(streams)
        ])  # [streams, b - a, L, C]
        if trace is not None:
            trace.append(ids.permute(1, 0, 2, 3).numpy())
        for i, lc in enumerate(layers):
            layer_ids = ids[:, :, i, :]
            lc.counts.index_add_(0, layer_ids.reshape(-1), torch.ones(1, dtype=torch.int32).expand(layer_ids.numel()))
            # Duplicates inside a step: ids [step, stream, column]; per order (columns o*H..).
            by_step = layer_ids.permute(1, 0, 2)  # [b - a, streams, C]
            for o in range(n_orders):
                cols = by_step[:, :, o * H:(o + 1) * H].reshape(b - a, -1)
                srt = cols.sort(dim=1).values
                lc.dup[o] += int((srt[:, 1:] == srt[:, :-1]).sum())
                lc.reads_by_order[o] += cols.numel()
    return layers, steps


def hottest_share(counts: np.ndarray, k: int) -> float:
    """Share of the reads in `counts` that its k most-read entries serve."""
    total = counts.sum(dtype=np.int64)
    if total == 0 or k <= 0:
        return 0.0
    k = min(k, counts.shape[0])
    top = np.partition(counts, counts.shape[0] - k)[counts.shape[0] - k:]
    return float(top.sum(dtype=np.int64) / total)


def skew(lc: LayerCounts, order_index: Optional[int] = None) -> dict:
    """Skew of one layer (or of one n-gram order's columns): reads, rows, distinct rows
    touched, and the hottest-share of reads by share of table rows and of distinct rows."""
    b = lc.column_bounds
    if order_index is None:
        counts = lc.counts.numpy()
    else:
        lo, hi = b[order_index * lc.n_heads], b[(order_index + 1) * lc.n_heads]
        counts = lc.counts[lo:hi].numpy()
    touched = counts[counts > 0]
    out = {"reads": int(counts.sum(dtype=np.int64)), "rows": int(counts.shape[0]), "distinct": int(touched.shape[0])}
    for share in SHARES:
        out[f"table_{share:g}"] = hottest_share(touched, math.ceil(share * counts.shape[0]))
        out[f"distinct_{share:g}"] = hottest_share(touched, math.ceil(share * touched.shape[0]))
    return out


# ------------------------------------------------------------------------ profile file
def top_rows(counts: torch.Tensor, keep_rows: int, min_count: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """(row ids, counts) of the `keep_rows` most-read rows read at least `min_count` times,
    by count descending (ties: lower row id first)."""
    c = counts.numpy()
    cand = np.flatnonzero(c >= min_count)
    if cand.shape[0] > keep_rows:
        part = np.argpartition(-c[cand], keep_rows - 1)[:keep_rows]
        cand = cand[part]
    order = np.lexsort((cand, -c[cand]))
    cand = cand[order]
    return cand.astype(np.int64), c[cand].astype(np.int64)


def write_profile(path: str | os.PathLike, cfg: EngramConfig, layers: list[LayerCounts], meta: dict,
                  keep_share: float = 0.05) -> Path:
    """The profile file (profile_format.py) of the hottest `keep_share` of each layer's rows."""
    hottest = {}
    for lc in layers:
        ids, counts = top_rows(lc.counts, max(1, int(keep_share * lc.rows)))
        hottest[lc.layer_id] = ProfileLayer(ids, counts, int(lc.counts.sum(dtype=torch.int64)), lc.rows)
    return write_profile_rows(path, cfg, hottest, meta)


# ------------------------------------------------------------------------ report
def report(layers: list[LayerCounts], steps: int, streams: int) -> tuple[str, dict]:
    """The printed skew table, and the same figures as a dict."""
    lines, summary = [], {}
    for lc in layers:
        n_orders = lc.dup.shape[0]
        total = skew(lc)
        lines.append(f"layer {lc.layer_id}: {total['reads']:,} reads of {total['rows']:,} rows; "
                     f"{total['distinct']:,} distinct rows touched ({total['distinct'] / total['rows']:.1%} of the table)")
        lines.append(f"  {'':8} {'rows':>12} {'distinct':>10}   share of reads served by the hottest "
                     f"0.1% / 1% / 5% of the table's rows | of the distinct rows touched")
        per = {}
        for name, o in [*((f"{o + 2}-gram", o) for o in range(n_orders)), ("all", None)]:
            s = skew(lc, o)
            per[name] = s
            t = " ".join(f"{s[f'table_{x:g}']:6.1%}" for x in SHARES)
            d = " ".join(f"{s[f'distinct_{x:g}']:6.1%}" for x in SHARES)
            lines.append(f"  {name:8} {s['rows']:>12,} {s['distinct'] / max(1, s['rows']):>10.1%}   {t}   |   {d}")
        dup = lc.dup.sum() / max(1, lc.reads_by_order.sum())
        by_order = ", ".join(f"{o + 2}-grams {lc.dup[o] / max(1, lc.reads_by_order[o]):.1%}" for o in range(n_orders))
        lines.append(f"  duplicate ids inside a decode batch of {streams} tokens ({streams} streams, one token each, "
                     f"{steps:,} steps): {dup:.1%} ({by_order})")
        per["decode_duplicates"] = float(dup)
        per["decode_duplicates_by_order"] = [float(lc.dup[o] / max(1, lc.reads_by_order[o])) for o in range(n_orders)]
        summary[str(lc.layer_id)] = per
    return "\n".join(lines), summary


# ------------------------------------------------------------------------ command
def check_inputs(streams, max_tokens, keep_share) -> None:
    """One line for any out-of-range option (the counts would be meaningless or never end)."""
    def whole(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not whole(streams) or not 1 <= streams <= MAX_STREAMS:
        raise EngramError(f"--streams must be a whole number from 1 to {MAX_STREAMS}, got {streams!r}")
    if max_tokens is not None and (not whole(max_tokens) or not 1 <= max_tokens <= MAX_TOKENS):
        raise EngramError(f"--max-tokens must be a whole number from 1 to {MAX_TOKENS} (2^40), got {max_tokens!r}")
    if (isinstance(keep_share, bool) or not isinstance(keep_share, (int, float)) or not math.isfinite(keep_share)
            or not 0 < keep_share <= 1):
        raise EngramError(f"--keep-share must be a number in (0, 1], got {keep_share!r}")


def check_memory(cfg: EngramConfig, layout: EngramLayout, memory_bytes: Optional[int] = None) -> None:
    """The counts take 4 B per table row, all layers at once: refuse a config whose tables
    this machine could not count (a huge vocab once tried to allocate petabytes)."""
    rows = sum(layout.num_embeddings)
    memory = memory_bytes if memory_bytes is not None else os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if 4 * rows > memory:
        raise EngramError(
            f"{cfg.source}: profiling counts 4 B per table row: {rows:,} rows need {4 * rows / 2**30:,.1f} GiB, "
            f"more than this machine's {memory / 2**30:,.1f} GiB of memory"
        )


def run_profile(model_dir, corpus: Sequence[str], out, *, streams: int = DECODE_BATCH, max_tokens: Optional[int] = None,
                keep_share: float = 0.05, file=None, trace_out=None) -> dict:
    t0 = time.perf_counter()
    file = file or sys.stdout
    check_inputs(streams, max_tokens, keep_share)
    check_output(out, "--out")  # before minutes of counting, not after
    if trace_out is not None:
        check_output(trace_out, "--trace")
    cfg = EngramConfig.from_pretrained(model_dir)
    check_memory(cfg, EngramLayout(cfg))
    tokenizer = load_tokenizer(model_dir)
    hasher = NgramHasher.from_tokenizer(cfg, tokenizer)
    files = corpus_files(corpus)
    skipped: list[Path] = []
    tokens = tokenize(tokenizer, read_texts(files, skipped), max_tokens)
    windows: Optional[list] = [] if trace_out is not None else None
    layers, steps = count_reads(hasher, tokens, streams, trace=windows)
    text, summary = report(layers, steps, streams)
    binary = f" ({len(skipped)} binary skipped)" if skipped else ""
    print(f"{len(files) - len(skipped)} text files{binary}, {tokens.shape[0]:,} tokens as {streams} streams of "
          f"{steps:,} tokens (model {model_dir}, config {cfg.fingerprint()})", file=file)
    print(text, file=file)
    meta = {"model": str(model_dir), "corpus": [str(f) for f in files], "tokens": int(tokens.shape[0]),
            "streams": streams, "steps": steps, "skew": summary, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    path = write_profile(out, cfg, layers, meta, keep_share)
    if trace_out is not None:
        from ..core.planning.disk import write_trace

        ids = np.concatenate(windows)  # [steps, streams, L, C]
        t = write_trace(trace_out, cfg.fingerprint(), {L: ids[:, :, i] for i, L in enumerate(cfg.layer_ids)},
                        {"model": str(model_dir), "streams": streams, "steps": steps})
        print(f"wrote {t} ({t.stat().st_size / 2**20:.1f} MiB: every stream's row ids in decode-step order, "
              f"for engram-sglang plan --placement disk --trace)", file=file)
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB: the hottest {keep_share:.0%} of each table's rows "
          f"read at least twice) in {time.perf_counter() - t0:.1f} s", file=file)
    return summary


def cmd_profile(args) -> int:
    run_profile(args.model, args.corpus, args.out, streams=args.streams, max_tokens=args.max_tokens,
                keep_share=args.keep_share, trace_out=args.trace)
    return 0


def add_parser(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    """Add the `profile` subcommand; its handler is `cmd_profile` (the parser's `func`)."""
    p = subparsers.add_parser(
        "profile",
        help="profile Engram row hotness on a text corpus (pre-warms the hot-row cache)",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
    )
    p.add_argument("--model", required=True, metavar="DIR",
                   help="model directory: config.json with the engram_* fields, and its tokenizer")
    p.add_argument("corpus", nargs="+", metavar="CORPUS", help="text files or directories of them")
    p.add_argument("--out", required=True, metavar="FILE", help="profile file to write (.npz)")
    p.add_argument("--streams", type=int, default=DECODE_BATCH,
                   help=f"concurrent request streams, one token each per decode step (default {DECODE_BATCH})")
    p.add_argument("--max-tokens", type=int, default=None, help="stop after this many tokens of the corpus")
    p.add_argument("--keep-share", type=float, default=0.05,
                   help="keep the hottest this share of each table's rows in the file (default 0.05)")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="also write every stream's row ids in decode-step order (.npz, 4 B per id), which "
                        "engram-sglang plan --placement disk --trace replays through the caches")
    p.set_defaults(func=cmd_profile)
    return p
