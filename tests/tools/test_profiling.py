"""`engram-sglang profile`: counts and skew against a brute-force recount of the same text."""

from __future__ import annotations

import argparse
import io
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from engram_sglang import EngramConfig, NgramHasher
from engram_sglang.core.errors import EngramError, TokenizerMismatchError
from engram_sglang.core.hashing import EngramLayout, compressed_token_map
from engram_sglang.tools import profiling
from engram_sglang.tools.demo import run as demo

STDLIB = Path(os.__file__).parent
CORPUS = [STDLIB / "argparse.py", STDLIB / "textwrap.py", STDLIB / "string.py"]  # real text, offline


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """An HF-style model dir: tokenizer.json trained here, config.json with engram_* keys."""
    d = tmp_path_factory.mktemp("model")
    tok = demo.train_tokenizer(demo.demo_corpus(200_000), 1200)
    tok.save_pretrained(d)
    _, size = compressed_token_map(tok)
    cfg = {"engram_layer_ids": [1, 3], "engram_max_ngram_size": 4, "engram_n_heads": 4, "engram_head_dim": 256,
           "engram_vocab_size": 3001, "engram_compressed_vocab_size": size,
           "engram_pad_token_id": tok.pad_token_id, "hidden_size": 64}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def brute_force(model_dir: Path, files, streams: int):
    """Row ids [streams, steps, layers, C] of the files' text cut into `streams`, each hashed whole."""
    cfg = EngramConfig.from_pretrained(model_dir)
    tok = profiling.load_tokenizer(model_dir)
    hasher = NgramHasher.from_tokenizer(cfg, tok)
    tokens = [t for f in files for t in tok(Path(f).read_text(), add_special_tokens=False)["input_ids"]]
    steps = len(tokens) // streams
    ids = torch.stack([hasher.hash_sequence(tokens[s * steps:(s + 1) * steps]) for s in range(streams)])
    return cfg, ids, len(tokens)


def run(model_dir, corpus, out, streams):
    text = io.StringIO()
    summary = profiling.run_profile(model_dir, [str(c) for c in corpus], out, streams=streams, file=text)
    return summary, text.getvalue()


def test_profile_counts_and_skew_match_a_recount(model_dir, tmp_path):
    streams = 16
    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    for f in CORPUS[1:]:
        (corpus_dir / f.name).write_text(f.read_text())
    (corpus_dir / "zz.bin").write_bytes(b"\x00\x01binary")  # skipped
    summary, printed = run(model_dir, [CORPUS[0], corpus_dir], tmp_path / "p.npz", streams)
    cfg, ids, n_tokens = brute_force(model_dir, [CORPUS[0], *sorted(CORPUS[1:])], streams)  # dir: sorted
    layout = EngramLayout(cfg)
    prof = profiling.read_profile(tmp_path / "p.npz", cfg.fingerprint())
    assert prof.meta["tokens"] == n_tokens and prof.meta["steps"] == ids.shape[1]
    H = cfg.n_heads
    for i, L in enumerate(cfg.layer_ids):
        layer = ids[:, :, i, :]  # [streams, steps, C]
        rows, counts = torch.unique(layer, return_counts=True)
        full = np.zeros(layout.rows(L), dtype=np.int64)
        full[rows.numpy()] = counts.numpy()
        # The file: the hottest rows read at least twice, with their exact counts.
        got_ids, got_counts, total = prof.layer(L)
        assert total == layer.numel() == ids.shape[0] * ids.shape[1] * cfg.hash_columns
        assert got_ids.size > 0 and np.array_equal(got_counts, full[got_ids])
        assert np.all(np.diff(got_counts) <= 0) and got_counts.min() >= 2
        assert got_counts[0] == full.max()
        kept = got_ids.size
        assert kept == min(int(0.05 * layout.rows(L)), int((full >= 2).sum()))
        assert got_counts[-1] >= np.sort(full)[::-1][kept - 1]
        # Skew: shares of reads of the hottest rows, by table rows and by distinct rows.
        bounds = layout.column_bounds(i)
        for o, name in enumerate(["2-gram", "3-gram", "4-gram", "all"]):
            part = full if name == "all" else full[bounds[o * H]:bounds[(o + 1) * H]]
            desc = np.sort(part)[::-1]
            distinct = int((part > 0).sum())
            s = summary[str(L)][name]
            assert s["reads"] == part.sum() and s["distinct"] == distinct and s["rows"] == part.size
            for share in profiling.SHARES:
                by_table = desc[: math.ceil(share * part.size)].sum() / part.sum()
                by_distinct = desc[: math.ceil(share * distinct)].sum() / part.sum()
                assert s[f"table_{share:g}"] == pytest.approx(by_table)
                assert s[f"distinct_{share:g}"] == pytest.approx(by_distinct)
                assert f"{by_table:6.1%}" in printed
        # Duplicates inside a decode batch: step t reads token t of every stream.
        dup = [0, 0, 0]
        for t in range(layer.shape[1]):
            for o in range(3):
                step = layer[:, t, o * H:(o + 1) * H].reshape(-1)
                dup[o] += step.numel() - step.unique().numel()
        want = sum(dup) / layer.numel()
        assert summary[str(L)]["decode_duplicates"] == pytest.approx(want)
        assert summary[str(L)]["decode_duplicates_by_order"] == pytest.approx([d / (layer.numel() / 3) for d in dup])
        assert f"{want:.1%}" in printed
    assert printed.startswith("3 text files (1 binary skipped)")


def test_windows_with_history_equal_whole_streams(model_dir):
    """count_reads hashes each stream in windows of steps with history: same rows as whole."""
    cfg = EngramConfig.from_pretrained(model_dir)
    tok = profiling.load_tokenizer(model_dir)
    hasher = NgramHasher.from_tokenizer(cfg, tok)
    tokens = profiling.tokenize(tok, [CORPUS[1].read_text()])
    streams = 5
    layers, steps = profiling.count_reads(hasher, tokens, streams, window=7)
    per = tokens[: steps * streams].reshape(streams, steps)
    whole = torch.stack([hasher.hash_sequence(per[s].tolist()) for s in range(streams)])
    for i, lc in enumerate(layers):
        want = torch.bincount(whole[:, :, i].reshape(-1), minlength=lc.rows)
        assert torch.equal(lc.counts.long(), want)


def test_the_subcommand_parses_and_runs(model_dir, tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="engram-sglang")
    profiling.add_parser(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "q.npz"
    args = parser.parse_args(["profile", "--model", str(model_dir), str(CORPUS[2]), "--out", str(out),
                              "--streams", "8", "--max-tokens", "3000"])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "duplicate ids inside a decode batch of 8 tokens" in text and f"wrote {out}" in text
    prof = profiling.read_profile(out)
    assert prof.meta["tokens"] == 3000 and prof.layer_ids == [1, 3]


def test_bad_inputs_say_what_is_wrong(model_dir, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (bad / f).write_text((model_dir / f).read_text())
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["engram_compressed_vocab_size"] += 1
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerMismatchError, match="normalizes to"):
        run(bad, CORPUS[:1], tmp_path / "x.npz", 8)
    (bad / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(EngramError, match="missing Engram field"):
        run(bad, CORPUS[:1], tmp_path / "x.npz", 8)
    with pytest.raises(EngramError, match="no such file"):
        run(model_dir, [tmp_path / "nope.txt"], tmp_path / "x.npz", 8)
    with pytest.raises(EngramError, match="fewer than one per stream"):
        profiling.run_profile(model_dir, [str(CORPUS[0])], tmp_path / "x.npz", streams=1000, max_tokens=999,
                              file=io.StringIO())
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(EngramError, match="not an engram profile"):
        profiling.read_profile(tmp_path / "junk.npz")


@pytest.mark.parametrize("kwargs, want", [
    (dict(streams=0), "--streams must be a whole number from 1 to 65536, got 0"),
    (dict(streams=-3), "--streams must be a whole number from 1 to 65536, got -3"),
    (dict(streams=10**7), "--streams must be a whole number from 1 to 65536, got 10000000"),
    (dict(max_tokens=-5), r"--max-tokens must be a whole number from 1 to 1099511627776 \(2\^40\), got -5"),
    (dict(keep_share=float("nan")), r"--keep-share must be a number in \(0, 1\], got nan"),
    (dict(keep_share=float("inf")), "--keep-share must be a number in .*, got inf"),
    (dict(keep_share=-0.1), "--keep-share must be a number in .*, got -0.1"),
    (dict(keep_share=2.0), "--keep-share must be a number in .*, got 2.0"),
])
def test_out_of_range_options_are_one_line(model_dir, tmp_path, kwargs, want):
    with pytest.raises(EngramError, match=want):
        profiling.run_profile(model_dir, [str(CORPUS[2])], tmp_path / "x.npz", file=io.StringIO(), **kwargs)
    assert not (tmp_path / "x.npz").exists()


def test_tables_too_big_to_count_are_refused_up_front(model_dir, tmp_path):
    """A huge vocab (legal for a config) gives tables of trillions of rows: refused with one
    line before any allocation, within seconds."""
    import time

    bad = tmp_path / "huge"
    bad.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (bad / f).write_text((model_dir / f).read_text())
    cfg = json.loads((model_dir / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "engram_vocab_size": 2**32, "engram_n_heads": 64}))
    t0 = time.perf_counter()
    with pytest.raises(EngramError, match=r"config.json: profiling counts 4 B per table row: [\d,]+ rows need "
                                          r"[\d,.]+ GiB, more than this machine's"):
        run(bad, CORPUS[:1], tmp_path / "x.npz", 8)
    assert time.perf_counter() - t0 < 10
    small = EngramConfig.from_pretrained(model_dir)
    profiling.check_memory(small, EngramLayout(small))  # the real model fits
    with pytest.raises(EngramError, match="more than this machine's 0.0 GiB"):
        profiling.check_memory(small, EngramLayout(small), memory_bytes=1000)


def _npz(path, **arrays):
    np.savez_compressed(path, **arrays)
    return path


def test_broken_profile_files_are_one_line(model_dir, tmp_path):
    """Every way a profile file can be broken gives one line (read_profile or .layer())."""
    import zipfile

    good = tmp_path / "good.npz"
    profiling.run_profile(model_dir, [str(CORPUS[2])], good, streams=8, max_tokens=3000, file=io.StringIO())
    src = dict(np.load(good))
    meta = json.loads(bytes(src["meta"]).decode())

    def meta_of(obj):
        return np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)

    opening = {
        "not a zip": (tmp_path / "a.npz", lambda p: p.write_bytes(b"PK\x03\x04garbage")),
        "truncated": (tmp_path / "b.npz", lambda p: p.write_bytes(good.read_bytes()[:200])),
        "one array": (tmp_path / "c.npy", lambda p: np.save(p, np.arange(3))),
        "meta a list": (tmp_path / "d.npz", lambda p: _npz(p, **{**src, "meta": meta_of([1, 2])})),
        "meta not JSON": (tmp_path / "e.npz", lambda p: _npz(p, **{**src, "meta": np.frombuffer(b"\xff{", np.uint8)})),
        "no meta": (tmp_path / "f.npz", lambda p: _npz(p, **{k: v for k, v in src.items() if k != "meta"})),
        "a directory": (tmp_path / "g.npz", lambda p: p.mkdir()),
        "a FIFO": (tmp_path / "h.npz", lambda p: os.mkfifo(p)),
    }
    for why, (path, make) in opening.items():
        make(path)
        with pytest.raises(EngramError) as e:
            profiling.read_profile(path)
        assert str(path) in str(e.value) and "\n" not in str(e.value), why
    layer = {
        "ids 2-D": {"ids_1": src["ids_1"].reshape(1, -1)},
        "ids float": {"ids_1": src["ids_1"].astype(np.float32)},
        "counts shorter": {"counts_1": src["counts_1"][:-1]},
        "reads an array": {"reads_1": np.arange(3)},
        "no counts": {"counts_1": None},
        "negative id": {"ids_1": -1 - src["ids_1"]},
    }
    for why, change in layer.items():
        arrays = {k: v for k, v in {**src, **change}.items() if v is not None}
        path = _npz(tmp_path / f"{why.replace(' ', '_')}.npz", **arrays)
        prof = profiling.read_profile(path)
        with pytest.raises(EngramError) as e:
            prof.layer(1)
        assert str(path) in str(e.value) and "\n" not in str(e.value), why
        assert np.array_equal(prof.layer(3)[0], src["ids_3"].astype(np.int64))  # the other layer still reads
    # A member whose compressed data is corrupt.
    path = tmp_path / "corrupt.npz"
    with zipfile.ZipFile(good) as zin, zipfile.ZipFile(path, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename == "ids_1.npy":
                data = data[:128] + bytes(len(data) - 128)  # header intact, data zeroed... then truncated below
                data = data[: len(data) // 2]
            zout.writestr(info, data, compress_type=zipfile.ZIP_STORED)
    with pytest.raises(EngramError, match="layer 1: unreadable"):
        profiling.read_profile(path).layer(1)
    assert meta["format"] == profiling.FORMAT


def test_profile_trace_is_each_streams_ids_in_decode_order(model_dir, tmp_path, capsys):
    """profile --trace: ids_L [steps, streams, C] equal to each stream hashed whole, read back
    by the planner under the model's fingerprint, and `plan --placement disk --trace` replays it."""
    from engram_sglang.core.planning.disk import read_trace
    from engram_sglang.tools.planner import plan

    parser = argparse.ArgumentParser(prog="engram-sglang")
    profiling.add_parser(parser.add_subparsers(dest="command", required=True))
    out, trace = tmp_path / "p.npz", tmp_path / "t.npz"
    args = parser.parse_args(["profile", "--model", str(model_dir), str(CORPUS[2]), "--out", str(out),
                              "--streams", "6", "--max-tokens", "3000", "--trace", str(trace)])
    assert args.func(args) == 0
    assert f"wrote {trace}" in capsys.readouterr().out
    cfg = EngramConfig.from_pretrained(model_dir)
    got, meta = read_trace(trace, cfg.fingerprint())
    tokens = 3000 // 6
    tok = profiling.load_tokenizer(model_dir)
    ids = profiling.tokenize(tok, [CORPUS[2].read_text()], 3000)
    hasher = NgramHasher.from_tokenizer(cfg, tok)
    whole = torch.stack([hasher.hash_sequence(ids[s * tokens:(s + 1) * tokens].tolist()) for s in range(6)])
    for i, L in enumerate(cfg.layer_ids):
        assert np.array_equal(got[L], whole[:, :, i].permute(1, 0, 2).numpy())
    assert meta["streams"] == 6 and meta["steps"] == tokens
    p = plan(model=str(model_dir), gpu="H100", tp=1, placement="disk", disk_iops=10_000, trace=str(trace), batch=6,
             dram_cache_gib=0.01)
    assert p["disk"]["step"]["curve"] == "trace replay" and p["disk"]["step"]["per_layer"]["1"]["steps"] == tokens // 2
