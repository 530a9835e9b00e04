"""sglang.srt.server_args: the `--engram-*` flags on SGLang's command line (through SGLang's
HookRegistry, registered when the plugin loads), each exported to its `ENGRAM_*` variable for
the processes SGLang starts (serving/settings.py), and SGLang flags that Engram needs added."""

from __future__ import annotations

import sys

from .targets import Target

MODULE = "sglang.srt.server_args"


def prepare_server_args(original, argv, *args, **kwargs):
    """Around `prepare_server_args`: export the flags, refuse bad ones in one line (exit 2),
    and add the SGLang flags a placement needs (CUDA graphs off, with a notice)."""
    from ..core.errors import EngramError
    from ..serving.graphs import graph_args
    from ..serving.settings import ServeSettings, export_flags

    try:
        export_flags(list(argv))
        settings = ServeSettings.from_env()
        modes = (f"--engram-mode {settings.mode}" if settings.mode != "on"
                 else "--engram-ablation on" if settings.ablation else None)
        extra, why = graph_args(settings.placement, list(argv), trace=settings.trace, modes=modes,
                                disk_graphs=settings.disk_graphs)
    except EngramError as e:
        print(f"engram-sglang: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if extra:
        # Not "engram-sglang: ", which marks the line that says why start-up failed.
        print(f"engram-sglang notice: {why}", file=sys.stderr, flush=True)
        argv = list(argv) + extra
    return original(argv, *args, **kwargs)


def add_cli_args(result, parser, *args, **kwargs):
    """After `ServerArgs.add_cli_args`: the `--engram-*` flags (shown by --help)."""
    from ..serving.settings import add_arguments

    if "--engram-placement" not in getattr(parser, "_option_string_actions", {}):
        add_arguments(parser)
    return result


TARGETS = (
    Target(MODULE, "prepare_server_args", "hook-around", prepare_server_args, says="hooks (--engram-* flags)"),
    Target(MODULE, "ServerArgs.add_cli_args", "hook-after", add_cli_args, says="hooks (--engram-* flags)"),
)
