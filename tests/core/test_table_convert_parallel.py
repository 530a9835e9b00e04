"""Converting on a thread pool, on real files: the same bytes and checksums as one thread, progress
lines off a terminal, the free-space check, and dead writers' directories removed."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from engram_sglang import EngramLayout
from engram_sglang.core.errors import TableFormatError
from engram_sglang.core.tablefile import (
    CHUNK_ROWS,
    MANIFEST,
    convert_checkpoint,
    leftovers,
    open_tables,
    progress,
    verify_tables,
    write_tables,
)
from engram_sglang.core.tablefile.provenance import checkpoint_provenance
from engram_sglang.core.tablefile.write import _sibling_stem
from engram_sglang.tools.cli import main
from tests.core.test_tablefile import CFG, make_checkpoint, random_tables
from tests.support.tables import small_config

ROOT = Path(__file__).resolve().parents[2]


def pieces(rows: np.ndarray, n: int):
    return (rows[lo : lo + n] for lo in range(0, rows.shape[0], n))


def contents(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


# 1000 rows: chunks that are not page-aligned (buffered writes); 512 rows x 264 B = 33 pages: O_DIRECT
# where the filesystem takes it, the last chunk padded and cut; CHUNK_ROWS: one chunk per layer.
@pytest.mark.parametrize("checksum_rows", [1000, 512, CHUNK_ROWS])
def test_parallel_convert_writes_the_bytes_one_thread_writes(tmp_path, rng, checksum_rows):
    tables = random_tables(rng)
    ckpt = make_checkpoint(tmp_path / "ckpt", tables)
    one = convert_checkpoint(ckpt, tmp_path / "one", threads=1, chunk_rows=999, checksum_rows=checksum_rows,
                             progress=False)
    many = convert_checkpoint(ckpt, tmp_path / "many", threads=3, chunk_rows=333, checksum_rows=checksum_rows,
                              progress=False)
    assert contents(one) == contents(many)
    manifest = json.loads((many / MANIFEST).read_text())
    assert manifest["chunk_rows"] == checksum_rows
    assert [len(x["checksums"]) for x in manifest["layers"]] == [-(-r.shape[0] // checksum_rows) for r in tables.values()]
    # The same as the rows handed to write_tables whole, and as a stream of odd-sized chunks, buffered.
    prov = checkpoint_provenance(ckpt)
    whole = write_tables(tmp_path / "whole", CFG, tables, chunk_rows=checksum_rows, threads=4, provenance=prov,
                         progress=False)
    stream = write_tables(tmp_path / "stream", CFG, {L: pieces(r, 777) for L, r in tables.items()},
                          chunk_rows=checksum_rows, threads=2, direct=False, provenance=prov, progress=False)
    assert contents(whole) == contents(one) == contents(stream)
    assert all(np.array_equal(open_tables(many, CFG)[L], r) for L, r in tables.items())
    verify_tables(many, CFG, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "many", "one", "stream", "whole"]


class FailingFill:
    """A row source (layerfile.RowFill) whose chunk at row `bad` fails, as a read of a disk may."""

    def __init__(self, rows: np.ndarray, bad: int):
        self.a, self.rows, self.bad = rows, rows.shape[0], bad

    def fill(self, lo, out):
        if lo == self.bad:
            raise TableFormatError("rows 2048.. unreadable")
        out[:] = self.a[lo : lo + out.shape[0]]


def test_a_chunk_failing_on_a_worker_fails_the_write_and_leaves_the_old_tables(tmp_path, rng):
    old = write_tables(tmp_path / "t", CFG, random_tables(rng), progress=False)
    before = contents(old)
    tables = random_tables(rng)
    with pytest.raises(TableFormatError, match=r"^rows 2048.. unreadable$"):
        write_tables(old, CFG, {1: tables[1], 3: FailingFill(tables[3], 2048)}, chunk_rows=512, threads=3,
                     progress=False)
    assert contents(old) == before and sorted(p.name for p in tmp_path.iterdir()) == ["t"]
    # A shard cut short: the checks before writing say so in one line.
    ckpt = make_checkpoint(tmp_path / "ckpt", tables)
    shard = ckpt / "model-00002-of-00002.safetensors"  # layer 3's scale
    os.truncate(shard, shard.stat().st_size - 5000)
    with pytest.raises(TableFormatError, match=r"00002-of-00002.safetensors: not a readable safetensors file"):
        convert_checkpoint(ckpt, old, threads=3, checksum_rows=512, progress=False)
    assert contents(old) == before and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "t"]


def test_progress_lines_off_a_terminal(tmp_path, rng, capsys, monkeypatch):
    """capsys's stderr is no terminal, as a Job's log is not: lines with the rate and the ETA
    (for any write: a small one is quiet, below)."""
    ckpt = make_checkpoint(tmp_path / "ckpt", random_tables(rng))
    assert main(["tables", "convert", str(ckpt), str(tmp_path / "quiet")]) == 0
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(progress, "QUIET_S", 0.0)
    assert main(["tables", "convert", str(ckpt), str(tmp_path / "out"), "--threads", "2"]) == 0
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "ETA" in ln]
    assert lines and all(re.search(r"GiB \(\d+%\), [\d,]+ MB/s, ETA \d+m\d\ds$", ln) for ln in lines), err
    assert "\r" not in err and re.search(r"GiB written in \d+m\d\ds, [\d,]+ MB/s", err), err


def test_threads_must_be_a_count(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["tables", "convert", str(tmp_path), str(tmp_path / "out"), "--threads", "0"])
    assert "a whole number >= 1, got '0'" in capsys.readouterr().err


def test_no_room_is_one_line_before_anything_is_written(tmp_path):
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    big = small_config(500, vocab_size=int(free / ROW_BYTES_PER_VOCAB) + 1000)  # both layers: twice the room
    need = sum(EngramLayout(big).num_embeddings) * 264
    assert need > free
    with pytest.raises(TableFormatError) as e:
        write_tables(tmp_path / "t", big, {L: iter(()) for L in big.layer_ids}, progress=False)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{tmp_path / 't'}: needs ") and f"({tmp_path}) has " in msg, msg
    assert re.search(r"needs (\d+\.\d) GiB, .* has (\d+\.\d) GiB free", msg), msg
    assert list(tmp_path.iterdir()) == []  # no hidden directory begun


ROW_BYTES_PER_VOCAB = 264 * EngramLayout(CFG).rows(1) / 1000  # small_config's rows per layer grow with vocab_size


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


KILLED_WRITER = """
import sys, time
from pathlib import Path
import numpy as np
from tests.core.test_tablefile import CFG, random_tables
from engram_sglang.core.tablefile import write_tables
import torch
tables = random_tables(torch.Generator().manual_seed(0))
def slow(rows):
    yield rows[:3000]
    Path(sys.argv[2]).touch()
    time.sleep(120)
    yield rows[3000:]
write_tables(sys.argv[1], CFG, {L: slow(r) for L, r in tables.items()}, chunk_rows=1000, progress=False)
"""


def test_a_killed_writers_directory_is_removed_by_the_next_write(tmp_path, rng, caplog):
    out, ready = tmp_path / "tables", tmp_path / "ready"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(out), str(ready)], cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the writer did not start writing"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)  # what a Job's deadline sends
        proc.wait(30)
    finally:
        proc.kill()
    left = [p for p in tmp_path.iterdir() if p.name.startswith(_sibling_stem(out) + f"writing-{proc.pid}-")]
    assert len(left) == 1 and (left[0] / "layer-1.rows.tmp").stat().st_size > 0, list(tmp_path.iterdir())
    # Beside it: a directory whose (dead) PID is held by a live writer's lock (another PID namespace),
    # and one of this live process made just now (between its mkdtemp and its lock): both kept.
    locked = tmp_path / f"{_sibling_stem(out)}writing-{_dead_pid()}-abc"
    mine = tmp_path / f"{_sibling_stem(out)}writing-{os.getpid()}-def"
    locked.mkdir(), mine.mkdir()
    other = tmp_path / f"{_sibling_stem(tmp_path / 'other')}writing-{_dead_pid()}-ghi"  # another target's
    other.mkdir()
    held = leftovers.hold(locked)
    tables = random_tables(rng)
    try:
        with caplog.at_level(logging.INFO, logger="engram_sglang.core.tablefile"):
            write_tables(out, CFG, tables, progress=False)
    finally:
        os.close(held)
    removed = [r for r in caplog.records if "removed, the partial tables of a write" in r.getMessage()]
    assert [r.getMessage().split(":")[0] for r in removed] == [str(left[0])], caplog.text
    assert f"process {proc.pid}, " in removed[0].getMessage() and removed[0].levelno == logging.INFO
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([locked.name, mine.name, other.name, "ready", "tables"])
    # Its lock released, the dead PID's directory goes with the next write; this process's stays.
    assert leftovers.reclaim(tmp_path, _sibling_stem(out)) == [locked]
    assert mine.exists() and other.exists()
    assert all(np.array_equal(open_tables(out, CFG)[L], r) for L, r in tables.items())
