"""What the fuzz harnesses share: the rule every parser keeps, edits driven by the fuzzer's
bytes, the files an input becomes, and the libFuzzer entry point.

The rule (README: "Errors on bad input are one line naming the file"): any input gives a
result, or an EngramError whose message is one line naming the file at fault (the CLI turns
exactly that into one line and exit status 2). Anything else is a finding: another
exception (a traceback in the CLI), a message over several lines or naming no input, a
hang (libFuzzer's -timeout), an allocation blow-up (-rss_limit_mb), or a result that breaks
an invariant the harness states.

Each harness turns one input into files with a FuzzedDataProvider: a valid baseline, then
edits chosen by the bytes (JSON values swapped for hostile ones, bytes overwritten or cut,
files replaced by directories, FIFOs, symlinks). Structured edits reach the checks behind
the JSON parser, which byte flips of a valid file rarely get past; the same bytes always
make the same files, so a crash file replays (`python -m fuzz.fuzz_X CRASH_FILE`).
"""

from __future__ import annotations

import atexit
import copy
import hashlib
import json
import math
import os
import shlex
import shutil
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import atheris


def instrumented():
    """Import the project's modules inside this to give the fuzzer their coverage (the
    package imports its modules lazily: name each one). Only the project's own: torch,
    numpy and the JSON scanner are C code the fuzzer cannot steer, and instrumenting them
    slows every run."""
    return atheris.instrument_imports(include=["engram_sglang"])


with instrumented():
    from engram_sglang.core.errors import EngramError


class RuleBroken(AssertionError):
    """An error that keeps the letter of the rule but not its point (several lines, no file)."""


def keep_rule(call: Callable[[], Any], names: Iterable[str]) -> tuple[Any, Optional[EngramError]]:
    """Run `call`: (result, None), or (None, error) for an EngramError whose message is one
    line naming one of `names` (paths of the files the input made). Anything else raises."""
    try:
        return call(), None
    except EngramError as e:
        msg = str(e)
        if not msg.strip() or "\n" in msg or "\r" in msg:
            raise RuleBroken(f"{type(e).__name__} message is not one line: {msg!r}") from e
        names = [str(n) for n in names]
        if names and not any(n in msg for n in names):
            raise RuleBroken(f"{type(e).__name__} names none of {names}: {msg!r}") from e
        return None, e


# ----------------------------------------------------------------------------- JSON edits
# Stand-ins the serializer expands: a nesting too deep for the parser's recursion, and an
# integer longer than Python's int-from-text limit (4300 digits): both raise from json.loads
# with something other than JSONDecodeError.
DEEP, DIGITS = "\x00deep\x00", "\x00digits\x00"

_NUMBERS = (0, -1, 1, 2, 3, 255, 256, 264, 4096, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64,
            10**30, -(2**63), 0.0, -0.0, 0.5, 890.9, 1e308, -1e308, math.inf, -math.inf, math.nan, True, False, DIGITS)
_STRINGS = ("", "0", "890", "1e3", "x", "\x00", "a\x00b", "\ud800", "\udc80x", "x\ny", "../x", "..", ".", "/",
            "/dev/zero", "/dev/null", "a/b", "manifest.json")
_SHAPES = (None, [], {}, [[]], [1, 2], [0, 0], [-1], {"": 1}, DEEP)
HOSTILE: tuple[Any, ...] = _NUMBERS + _STRINGS + _SHAPES


def _slots(obj: Any, path: tuple = ()) -> Iterable[tuple]:
    """Every place a value sits in a JSON tree, as key/index paths (the root is ())."""
    yield path
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _slots(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _slots(v, path + (i,))


def _get(obj: Any, path: tuple) -> Any:
    for k in path:
        obj = obj[k]
    return obj


def hostile_value(fdp: atheris.FuzzedDataProvider, old: Any, extra: tuple = ()) -> Any:
    """A value to put where `old` was: from the hostile palette, the harness's own strings
    (`extra`), near `old` (off by one, as text, as a float, wrapped), or drawn from the bytes.
    A copy: a later edit must not change the palette or make the tree contain itself."""
    return copy.deepcopy(_hostile_value(fdp, old, extra))


def _hostile_value(fdp: atheris.FuzzedDataProvider, old: Any, extra: tuple) -> Any:
    kind = fdp.ConsumeIntInRange(0, 6)
    if kind == 0:
        return fdp.PickValueInList(list(HOSTILE))
    if kind == 6:  # most often a value of the same type: it gets past the type checks
        like = _STRINGS if isinstance(old, str) else _SHAPES if isinstance(old, (list, dict)) else _NUMBERS
        return fdp.PickValueInList(list(like))
    if kind == 1 and extra:
        return fdp.PickValueInList(list(extra))
    if kind == 2 and isinstance(old, (int, float)) and not isinstance(old, bool):
        return fdp.PickValueInList([old + 1, old - 1, -old, old * 2, str(old), float(old) + 0.5, [old], {"v": old}])
    if kind == 2 and isinstance(old, (str, list)) and old:
        return fdp.PickValueInList([old[: len(old) // 2], old * 2, [old]])
    if kind == 2 and isinstance(old, dict) and old:
        return fdp.PickValueInList([dict(list(old.items())[: len(old) // 2]), [old], {**old, "x": old}])
    if kind == 3:
        return fdp.ConsumeInt(fdp.ConsumeIntInRange(1, 9))
    if kind == 4:
        return fdp.ConsumeFloat()
    return fdp.ConsumeUnicode(fdp.ConsumeIntInRange(0, 12))


def edit_json(obj: Any, fdp: atheris.FuzzedDataProvider, extra: tuple = (), max_edits: int = 3) -> Any:
    """Replace, delete, add or duplicate values at places the bytes pick."""
    for _ in range(fdp.ConsumeIntInRange(0, max_edits)):
        slots = list(_slots(obj))
        path = slots[fdp.ConsumeIntInRange(0, len(slots) - 1)]
        op = fdp.ConsumeIntInRange(0, 3)
        if not path:
            obj = hostile_value(fdp, obj, extra)
            continue
        parent, key = _get(obj, path[:-1]), path[-1]
        if op == 0:
            parent[key] = hostile_value(fdp, parent[key], extra)
        elif op == 1:
            del parent[key]
        elif op == 2:
            target = parent[key]
            if isinstance(target, dict):
                name = fdp.PickValueInList([*(e for e in extra if isinstance(e, str)), "x", ""])
                target[name] = hostile_value(fdp, None, extra)
            elif isinstance(target, list):
                target.append(hostile_value(fdp, target[-1] if target else None, extra))
            else:
                parent[key] = [target, hostile_value(fdp, target, extra)]
        elif isinstance(parent, list):
            parent.insert(key, parent[key])
        else:
            parent[key] = [parent[key]] * fdp.ConsumeIntInRange(0, 3)
    return obj


def dump_json(obj: Any) -> bytes:
    """JSON as Python writes it (NaN and Infinity included), with the stand-ins expanded."""
    text = json.dumps(obj, allow_nan=True)
    text = text.replace(json.dumps(DEEP), "[" * 100_000 + "]" * 100_000)
    text = text.replace(json.dumps(DIGITS), "9" * 5000)
    return text.encode()


# ----------------------------------------------------------------------------- byte edits
def edit_bytes(data: bytes, fdp: atheris.FuzzedDataProvider, max_edits: int = 3) -> bytes:
    """Overwrite, cut, insert, extend or flip bytes at offsets the fuzz bytes pick."""
    b = bytearray(data)
    for _ in range(fdp.ConsumeIntInRange(0, max_edits)):
        op = fdp.ConsumeIntInRange(0, 4)
        at = fdp.ConsumeIntInRange(0, len(b))
        if op == 0:
            chunk = fdp.ConsumeBytes(fdp.ConsumeIntInRange(1, 8))
            b[at : at + len(chunk)] = chunk
        elif op == 1:
            del b[at:]
        elif op == 2:
            b[at:at] = fdp.ConsumeBytes(fdp.ConsumeIntInRange(1, 8))
        elif op == 3:
            b.extend(bytes(fdp.ConsumeIntInRange(1, 600)))
        elif b:
            i = min(at, len(b) - 1)
            b[i] ^= 1 << fdp.ConsumeIntInRange(0, 7)
    return bytes(b)


# ----------------------------------------------------------------------------- files
# What a path can be instead of the regular file it should be.
KINDS = ("file", "missing", "dir", "fifo", "symlink-out", "dangling", "devnull")


def place(path: Path, data: bytes, kind: str, outside: Path) -> None:
    """Make `path` hold `data` as a regular file, or be one of the other KINDS. A FIFO has no
    writer: a parser that opens it for reading blocks (libFuzzer's -timeout reports it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "file":
        path.write_bytes(data)
    elif kind == "dir":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink-out":
        # A valid copy that lives outside the directory being read.
        target = outside / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        path.symlink_to(target)
    elif kind == "dangling":
        path.symlink_to(outside / "nowhere" / path.name)
    elif kind == "devnull":
        path.symlink_to("/dev/null")


# FUZZ_SKIP_KINDS=fifo,dir: make those kinds regular files, to explore past a known hang.
_SKIP_KINDS = set(filter(None, os.environ.get("FUZZ_SKIP_KINDS", "").split(",")))


def pick_kind(fdp: atheris.FuzzedDataProvider) -> str:
    """Mostly a regular file: the content edits need one to matter."""
    kind = "file" if fdp.ConsumeIntInRange(0, 7) else fdp.PickValueInList(list(KINDS[1:]))
    return "file" if kind in _SKIP_KINDS else kind


class Scratch:
    """One work directory per process, emptied before every input: under $FUZZ_SCRATCH, else
    tmpfs when there is one (converts fsync). libFuzzer ends the process without Python's
    clean-up (fuzz/runner.py removes the $FUZZ_SCRATCH it made), so a direct run removes the
    directories of processes that are gone when it starts."""

    def __init__(self, name: str):
        base = Path(os.environ.get("FUZZ_SCRATCH") or ("/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()))
        base.mkdir(parents=True, exist_ok=True)
        for old in base.glob("engram-fuzz-*"):
            pid = old.name.split("-")[-2]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                shutil.rmtree(old, ignore_errors=True)
        self.root = Path(tempfile.mkdtemp(prefix=f"engram-fuzz-{name}-{os.getpid()}-", dir=base))
        atexit.register(shutil.rmtree, self.root, ignore_errors=True)

    def fresh(self) -> Path:
        """The emptied work directory (a symlink or FIFO an input made is removed, not followed)."""
        for child in self.root.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
        return self.root


def _collecting(test_one_input: Callable[[bytes], None], out_dir: Path) -> Callable[[bytes], None]:
    """Triage mode: keep fuzzing past a finding, saving the first input of each kind (the
    exception type and the project line that raised it) into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()

    def run(data: bytes) -> None:
        try:
            test_one_input(data)
        except Exception as e:  # noqa: BLE001  (every kind is a finding to keep)
            frames = traceback.extract_tb(e.__traceback__)
            own = [f for f in frames if "/engram_sglang/" in f.filename] or frames
            where = f"{Path(own[-1].filename).stem}.{own[-1].lineno}"
            kind = f"{type(e).__name__}-{where}"
            if isinstance(e, RuleBroken):
                kind += "-" + hashlib.sha1(str(e)[:40].encode()).hexdigest()[:6]
            if kind not in seen:
                seen.add(kind)
                (out_dir / kind).write_bytes(data)
                print(f"FINDING {kind}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr, flush=True)

    return run


def fuzz_main(test_one_input: Callable[[bytes], None]) -> None:
    """libFuzzer's command line: `python -m fuzz.fuzz_X [-runs=N -seed=S ...] [CORPUS_DIR|FILE ...]`.
    With FUZZ_COLLECT=DIR, findings are saved there and the run goes on (a hang still ends it)."""
    if os.environ.get("FUZZ_SELF_TEST"):  # the negative control of tests/tools/test_fuzz.py: a finding fails the run
        def test_one_input(data: bytes) -> None:
            raise RuleBroken("FUZZ_SELF_TEST: every input is a finding")
    collect = os.environ.get("FUZZ_COLLECT")
    if collect:
        test_one_input = _collecting(test_one_input, Path(collect))
    # libFuzzer's -merge and -fork run argv[0] again through the shell: make it this interpreter
    # and script, so the harness need not be executable nor python3 be the venv's.
    argv = [f"{shlex.quote(sys.executable)} {shlex.quote(os.path.abspath(sys.argv[0]))}", *sys.argv[1:]]
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()
