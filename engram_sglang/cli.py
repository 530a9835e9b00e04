"""`engram-sglang`: the operators' tools (tables convert/verify/inspect, demo, ...).

Every command turns an EngramError into one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from .errors import EngramError


def _cmd_convert(args) -> int:
    from .config import EngramConfig
    from .tablefile import convert_checkpoint, inspect_tables

    cfg = EngramConfig.resolve(args.config) if args.config else None
    out = convert_checkpoint(args.checkpoint, args.out_dir, cfg)
    print(inspect_tables(out))
    return 0


def _cmd_verify(args) -> int:
    from .config import EngramConfig
    from .tablefile import verify_tables

    cfg = EngramConfig.resolve(args.config) if args.config else None
    done = verify_tables(args.table_dir, cfg)
    print(f"{args.table_dir}: OK ({', '.join(f'layer {L}: {n:,} rows' for L, n in sorted(done.items()))})")
    return 0


def _cmd_inspect(args) -> int:
    from .tablefile import inspect_tables

    print(inspect_tables(args.table_dir))
    return 0


def _cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(args.workdir, placement=args.placement)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engram-sglang", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    tables = sub.add_parser("tables", help="packed table files").add_subparsers(dest="tables_command", required=True)
    p = tables.add_parser("convert", help="pack a safetensors checkpoint's Engram tables into a table directory")
    p.add_argument("checkpoint", help="checkpoint directory (safetensors shards + config.json)")
    p.add_argument("out_dir", help="table directory to write")
    p.add_argument("--config", help="preset name or config.json to use instead of CHECKPOINT/config.json")
    p.set_defaults(func=_cmd_convert)
    p = tables.add_parser("verify", help="check sizes, config and every chunk checksum of a table directory")
    p.add_argument("table_dir")
    p.add_argument("--config", help="also require the tables to be built for this preset / config.json / model dir")
    p.set_defaults(func=_cmd_verify)
    p = tables.add_parser("inspect", help="summarize a table directory")
    p.add_argument("table_dir")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("demo", help="the built-in demo (what `make demo` runs)")
    p.add_argument("--workdir", default="build/demo", help="where the demo writes its files (default: build/demo)")
    p.add_argument("--placement", default="disk", choices=("device", "host", "disk"),
                   help="where the served demo model's tables live (default: disk)")
    p.set_defaults(func=_cmd_demo)

    from .demo_model import add_parser as add_demo_model_parser

    add_demo_model_parser(sub)

    from . import planner

    planner.add_parser(sub)

    from . import profiling

    profiling.add_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except EngramError as e:
        print(f"engram-sglang: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
