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
        refuse_megakernel(settings, list(argv))
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


MEGAKERNEL = "--enable-nvidia-megakernel"


def refuse_megakernel(settings, argv) -> None:
    """Upstream's NVIDIA megakernel reads `engram.embed.host_table` itself, which our stores
    replace (None): where our tables serve (a table directory resolves), refuse it in one line."""
    from ..core.errors import EngramConfigError
    from ..serving.graphs import _flag_value
    from ..serving.startup import resolve_table_dir

    on = False
    for a in argv:  # a store_true flag (`=VALUE` accepted as a boolean)
        if a == MEGAKERNEL or a.startswith(MEGAKERNEL + "="):
            on = a.partition("=")[2].lower() not in ("false", "0", "no", "off")
    if not on:
        return
    table_dir = resolve_table_dir(settings, _flag_value(argv, "--model-path"), required=False)
    if table_dir is not None:
        raise EngramConfigError(f"{MEGAKERNEL} reads upstream's Engram host table itself, which engram-sglang's "
                                f"stores (tables {table_dir}) replace: drop {MEGAKERNEL} to serve with the plugin")


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
