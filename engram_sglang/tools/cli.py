"""`engram-sglang`: the operators' tools (tables convert/verify/inspect, demo, ...).

Every command turns an EngramError into one line on stderr and exit status 2, and so a
standard output it cannot write (`>/dev/full`: "cannot write to standard output"). A closed
pipe (`engram-sglang ... | head -1`) ends it quietly with exit status 141, 128 + SIGPIPE, what
a shell reports for a coreutils tool the pipe cut off (`set -o pipefail` sees both alike).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from ..core.errors import EngramError

EXIT_BROKEN_PIPE = 128 + 13  # 128 + SIGPIPE, as the shell reports `seq 1000000 | head -1`'s seq


def _cmd_convert(args) -> int:
    from ..core.config import EngramConfig
    from ..core.tablefile import convert_checkpoint, inspect_tables

    cfg = EngramConfig.resolve(args.config) if args.config else None
    _log_to_stderr("engram_sglang.core.tablefile")  # progress off a terminal, leftovers removed
    out = convert_checkpoint(args.checkpoint, args.out_dir, cfg, threads=args.threads)
    print(inspect_tables(out))
    return 0


def _log_to_stderr(name: str) -> None:
    """INFO lines of logger `name` on stderr, one per line (nothing configures logging here)."""
    import logging

    log = logging.getLogger(name)
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("engram-sglang: %(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)


def _cmd_verify(args) -> int:
    from pathlib import Path

    from ..core.config import DEFAULT_TABLE_DIR, EngramConfig
    from ..core.tablefile import read_manifest, verify_tables

    if args.record and not args.model:
        raise EngramError("tables verify --record: give --model DIR, the checkpoint directory to record")
    if args.table_dir is None and not args.model:
        raise EngramError("tables verify: give a table directory, or --model DIR (for DIR's own tables)")
    table_dir = Path(args.table_dir) if args.table_dir is not None else Path(args.model) / DEFAULT_TABLE_DIR
    spec = args.config or args.model
    cfg = EngramConfig.resolve(spec) if spec else None
    layers = read_manifest(table_dir)[0]["layers"]  # as verified: --record refuses a directory swapped meanwhile
    done = verify_tables(table_dir, cfg)
    print(f"{table_dir}: OK ({', '.join(f'layer {L}: {n:,} rows' for L, n in sorted(done.items()))})")
    if args.model:
        _provenance(table_dir, Path(args.model), layers, record=args.record)
    return 0


def _provenance(table_dir, model, layers, *, record: bool) -> None:
    """The checkpoint the manifest records against `model`'s; with `record`, written into it."""
    from ..core.tablefile import checkpoint_provenance, read_manifest, record_provenance
    from ..core.tablefile.provenance import describe

    found = checkpoint_provenance(model)
    if record:
        old = record_provenance(table_dir, found, expect_layers=layers)
        was = "" if old is None or old["checkpoint_sha256"] == found["checkpoint_sha256"] else f" (was {describe(old)})"
        print(f"{table_dir}: recorded checkpoint {describe(found)} of {model}{was}")
        return
    recorded = read_manifest(table_dir)[0].get("provenance")
    if recorded is None:
        print(f"{table_dir}: records no checkpoint; record {model}'s with --record")
    elif recorded["checkpoint_sha256"] != found["checkpoint_sha256"]:
        raise EngramError(f"{table_dir}: converted from checkpoint sha256 {recorded['checkpoint_sha256']}, {model} "
                          f"has sha256 {found['checkpoint_sha256']}: convert the tables from {model} again "
                          f"(or --record to vouch that they belong to it)")
    else:
        print(f"{table_dir}: checkpoint matches {model} ({describe(found)})")


def _cmd_inspect(args) -> int:
    from ..core.tablefile import inspect_tables

    print(inspect_tables(args.table_dir))
    return 0


def _shm_dir(args):
    from pathlib import Path

    d = Path(args.shm_dir)
    if not d.is_dir():
        raise EngramError(f"{d}: no such directory (give the --shm-dir the servers use, ENGRAM_SHM_DIR)")
    return d


def _cmd_shm_ls(args) -> int:
    from ..core.stores.shmadmin import list_copies

    d = _shm_dir(args)
    entries = list_copies(d)
    if not entries:
        print(f"{d}: no engram-sglang shared copies")
        return 0
    print(f"{'name':<56} {'GiB':>9} {'layer':>5} {'numa':<10} {'identity':<16}  holders")
    for e in entries:
        if "sidecar" in e:
            who = (f"{e['sidecar']} sidecar, no copy: " + (f"held by pids {', '.join(map(str, e['holders']))}"
                                                            if e["holders"] else "nobody holds it (shm rm or prune)"))
        elif "filler" in e:
            who = f"leftover of a fill (process {e['filler']} {'alive' if e['filler_alive'] else 'gone'})"
        elif e["holders"] is None:
            who = "unknown (/proc/locks unreadable)"
        else:
            who = f"{len(e['holders'])} alive" + (f" (pids {', '.join(map(str, e['holders']))})" if e["holders"] else "")
        print(f"{e['name']:<56} {e['bytes'] / 2**30:9.3f} {e['layer']:>5} {e['numa']:<10} {e['identity']:<16}  {who}")
    return 0


def _cmd_shm_rm(args) -> int:
    from ..core.stores.shmadmin import remove_copy

    d = _shm_dir(args)
    for name in args.names:
        freed = remove_copy(d, name, force=args.force)
        print(f"removed {d / name} ({freed / 2**30:.3f} GiB)")
    return 0


def _cmd_shm_prune(args) -> int:
    from pathlib import Path

    from ..core.stores.shmadmin import prune, table_identities

    d = _shm_dir(args)
    current = table_identities(Path(args.table_dir)) if args.table_dir else None
    removed = prune(d, older_than=args.older_than, current=current, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for path, nbytes, why in removed:
        print(f"{verb} {path} ({nbytes / 2**30:.3f} GiB): {why}")
    total = sum(n for _, n, _ in removed) / 2**30
    print(f"{d}: {'would prune' if args.dry_run else 'pruned'} {len(removed)} file(s), {total:.3f} GiB")
    return 0


def _duration(text: str) -> float:
    """Seconds from 90, 90s, 30m, 12h or 7d."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    num, unit = (text[:-1], units[text[-1]]) if text[-1:] in units else (text, 1)
    try:
        value = float(num) * unit
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"a duration is a number with s, m, h or d (90s, 30m, 12h, 7d), got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"a whole number >= 1, got {text!r}")
    return value


def _cmd_demo(args) -> int:
    from .demo.run import run_demo

    return run_demo(args.workdir, placements=args.placements)


def _demo_placements(text: str) -> tuple[str, ...]:
    from ..core.placement_table import PLACEMENTS

    names = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [x for x in names if x not in PLACEMENTS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"placements are {', '.join(PLACEMENTS)} (comma-separated), got {text!r}")
    return names


# Commands whose modules import torch (directly or through the core's hashing): registered by
# name and help line only, their module imported when the command is the one run, so that
# `engram-sglang --help`, `tables ...` and usage errors start without torch (~2 s).
# name -> (module of its add_parser, the help line that add_parser gives; a test compares them)
LAZY_COMMANDS = {
    "demo-model": (".demo.model", "build the small Qwen3 + Engram demo model locally (no downloads)"),
    "plan": (".planner", "plan capacity: table bytes, HBM freed, KV gained, smallest TP, host DRAM, /dev/shm"),
    "profile": (".profiling", "profile Engram row hotness on a text corpus (pre-warms the hot-row cache)"),
    "ablate": (".analysis.ablate",
               "teacher-forced bits/token with Engram on, off and on the answer span only (a real server)"),
    "scan": (".analysis.scan",
             "per Engram layer and n-gram order: highest-gate n-grams, most-read rows, their rank correlation"),
}


class _LazyCommandParser(argparse.ArgumentParser):
    """A command's parser that its module's add_parser builds on first use (parsing or help);
    with no `module`, a plain parser (every parser of build_parser is of this class)."""

    def __init__(self, *args, module: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        self._module, self._real = module, None

    def load(self) -> argparse.ArgumentParser:
        if self._real is None:
            import importlib

            parent, _, name = self.prog.rpartition(" ")
            holder = argparse.ArgumentParser(prog=parent).add_subparsers(prog=parent)
            importlib.import_module(self._module, __package__).add_parser(holder)
            self._real = holder.choices[name]
        return self._real

    def parse_known_args(self, args=None, namespace=None):
        if not self._module:  # an eager command (tables, shm, demo): a plain parser
            return super().parse_known_args(args, namespace)
        return self.load().parse_known_args(args, namespace)

    def format_help(self):
        return self.load().format_help() if self._module else super().format_help()

    def format_usage(self):
        return self.load().format_usage() if self._module else super().format_usage()


def build_parser() -> argparse.ArgumentParser:
    from ..core.config import DEFAULT_TABLE_DIR  # (no torch)

    parser = argparse.ArgumentParser(prog="engram-sglang", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_LazyCommandParser)

    tables = sub.add_parser("tables", help="packed table files").add_subparsers(dest="tables_command", required=True)
    p = tables.add_parser("convert", help="pack a safetensors checkpoint's Engram tables into a table directory")
    p.add_argument("checkpoint", help="checkpoint directory (safetensors shards + config.json)")
    p.add_argument("out_dir", help="table directory to write")
    p.add_argument("--config", help="preset name or config.json to use instead of CHECKPOINT/config.json")
    p.add_argument("--threads", type=_positive_int, default=None, help="chunks read, packed and written at once "
                   "(default: the CPUs this process may use, 2 to 8)")
    p.set_defaults(func=_cmd_convert)
    p = tables.add_parser("verify", help="check sizes, config and every chunk checksum of a table directory")
    p.add_argument("table_dir", nargs="?", help=f"table directory (default with --model: MODEL/{DEFAULT_TABLE_DIR})")
    p.add_argument("--config", help="also require the tables to be built for this preset / config.json / model dir")
    p.add_argument("--model", metavar="DIR", help="the model directory they serve: require its config (unless "
                   "--config) and the checkpoint the manifest records")
    p.add_argument("--record", action="store_true", help="with --model: record DIR's checkpoint in the manifest "
                   "(tables converted before it was recorded), after the checks; nothing else is rewritten")
    p.set_defaults(func=_cmd_verify)
    p = tables.add_parser("inspect", help="summarize a table directory")
    p.add_argument("table_dir")
    p.set_defaults(func=_cmd_inspect)

    shm = sub.add_parser("shm", help="the node's shared host copies of tables (/dev/shm)").add_subparsers(
        dest="shm_command", required=True)
    shm_dir = os.environ.get("ENGRAM_SHM_DIR") or "/dev/shm"
    p = shm.add_parser("ls", help="list shared copies: size, layer, content identity, servers holding them")
    p.add_argument("--shm-dir", default=shm_dir, help=f"where the copies live (default: ENGRAM_SHM_DIR or /dev/shm: {shm_dir})")
    p.set_defaults(func=_cmd_shm_ls)
    p = shm.add_parser("rm", help="remove shared copies (refused for one a running server holds, unless --force)")
    p.add_argument("names", nargs="+", metavar="NAME", help="a name `shm ls` lists")
    p.add_argument("--shm-dir", default=shm_dir, help=f"where the copies live (default: {shm_dir})")
    p.add_argument("--force", action="store_true", help="remove it even while servers hold it (they keep their "
                   "mapping; the memory is freed when the last exits)")
    p.set_defaults(func=_cmd_shm_rm)
    p = shm.add_parser("prune", help="remove what no process uses: unheld copies, fills of dead processes, "
                       "sidecars without a copy")
    p.add_argument("--shm-dir", default=shm_dir, help=f"where the copies live (default: {shm_dir})")
    p.add_argument("--older-than", type=_duration, metavar="DURATION",
                   help="only copies filled longer ago than this (90s, 30m, 12h, 7d)")
    p.add_argument("--table-dir", metavar="DIR", help="only copies of this table directory's layers that hold "
                   "another version of their rows (with --older-than: either)")
    p.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    p.set_defaults(func=_cmd_shm_prune)

    p = sub.add_parser("demo", help="the built-in demo (what `make demo` runs)")
    p.add_argument("--workdir", default="build/demo", help="where the demo writes its files (default: build/demo)")
    p.add_argument("--placements", default="disk,host,device", type=_demo_placements,
                   help="comma-separated placements to serve the demo model's tables from, one server each, "
                        "the first one compared with Engram off (default: disk,host,device)")
    p.set_defaults(func=_cmd_demo)

    for name, (module, help_text) in LAZY_COMMANDS.items():
        sub.add_parser(name, help=help_text, module=module)
    return parser


class _StdoutError(Exception):
    """Writing standard output failed (`.error`, the OSError): not an OSError itself, so that
    neither a command's own `except OSError` nor argparse's (--help) swallows it, and a
    command's own OSErrors (a table file on a full disk, a server's socket) are not taken for it."""

    def __init__(self, error: OSError):
        super().__init__(str(error))
        self.error = error


class _GuardedStdout:
    """sys.stdout while a command runs: the same stream, whose write errors are _StdoutError."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError as e:
            raise _StdoutError(e) from e

    def flush(self):
        try:
            self._stream.flush()
        except OSError as e:
            raise _StdoutError(e) from e

    def __getattr__(self, name):  # fileno, isatty, encoding, buffer, ...
        return getattr(self._stream, name)


def _run(argv: Optional[Sequence[str]]) -> int:
    try:
        args = build_parser().parse_args(argv)
        code = args.func(args)
    except EngramError as e:
        print(f"engram-sglang: error: {e}", file=sys.stderr)
        code = 2
    except SystemExit:  # argparse's --help and usage errors exit after writing
        sys.stdout.flush()
        raise
    # A buffered write's error surfaces here, not at the interpreter's exit ("Exception ignored").
    sys.stdout.flush()
    return code


def _discard_stdout() -> None:
    """Point standard output at /dev/null, so that what is still buffered goes nowhere at the
    interpreter's exit instead of failing again there (a second message, exit status 120)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # an in-memory stream: no descriptor to repoint
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def _stdout_failed(error: OSError) -> int:
    _discard_stdout()
    if isinstance(error, BrokenPipeError):  # the reader left (`| head -1`): nothing to tell it
        return EXIT_BROKEN_PIPE
    print(f"engram-sglang: error: cannot write to standard output: {error.strerror or error}", file=sys.stderr)
    return 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    stdout = sys.stdout
    sys.stdout = _GuardedStdout(stdout)
    try:
        return _run(argv)
    except _StdoutError as e:
        return _stdout_failed(e.error)
    finally:
        sys.stdout = stdout


if __name__ == "__main__":
    sys.exit(main())
