"""CUDA graphs and Engram placements.

A placement the placement table (placement_table.py) marks not capturable (its ids visit
the host, which reads the rows: the disk tier) cannot run inside a captured CUDA graph: a replay would
re-run the device kernels but never the host reads. SGLang captures graphs for decode
(and, in 0.5.23, for prefill) by default on a GPU, so:

* `launch_server` (the plugin's hook on `prepare_server_args`): for such a placement the
  plugin adds `--cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled`
  and says so in one line; a user who asked for a graph backend explicitly is refused with
  one line instead (exit status 2), as a flag we would silently override is a surprise;
* every other entry point (`sglang.Engine(...)`, a `--config` file): the scheduler refuses
  to start, in one line, when graphs are still on for such a placement on a GPU
  (`check_capturable`, called where the stores are opened).

The per-step trace (`--engram-trace`, for tests) copies ids and rows to the host every
step, so it gets the same treatment. Device and host placements (HBM, or pinned host
memory read in-kernel over UVA) do no host work per step and are left to SGLang's graph
settings.
"""

from __future__ import annotations

import json
from typing import Iterable, Optional, Sequence

from ..core.errors import EngramConfigError, EngramError
from ..core.placement_table import placement as placement_spec

PHASES = ("decode", "prefill")
DISABLED = "disabled"
PHASE_FLAGS = {phase: f"--cuda-graph-backend-{phase}" for phase in PHASES}
LEGACY_OFF = "--disable-cuda-graph"
PHASE_OFF = {"decode": "--disable-decode-cuda-graph", "prefill": "--disable-prefill-cuda-graph"}
OVERLAP_OFF = "--disable-overlap-schedule"


def placement_needs_host_ids(placement: str) -> bool:
    """Whether the stores of this placement send row ids to the host (the placement table)."""
    return placement_spec(placement).ids_visit_host


def _flag_value(argv: Sequence[str], flag: str) -> Optional[str]:
    """The value of the last `flag VALUE` / `flag=VALUE` in argv (None when absent)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
    return value


def graph_args(placement: str, argv: Sequence[str], trace: Optional[str] = None,
               modes: Optional[str] = None, disk_graphs: bool = False) -> tuple[list[str], Optional[str]]:
    """SGLang flags to add for this placement (and trace setting, and Engram modes: `modes`
    names the flag that turns them on) and the line that says why (None: nothing to add).
    Raises EngramConfigError (one line) when argv asks for a CUDA graph explicitly while the
    step cannot run in one. `disk_graphs` (--engram-disk-graphs): a host-reading placement
    keeps decode graphs (rows staged before each replay, serving/staged_rows.py) when the
    overlap scheduler is off; prefill graphs stay off."""
    off = PHASES
    if disk_graphs:
        if placement_spec(placement).capturable:
            raise EngramConfigError(f"--engram-disk-graphs on is for a placement that reads on the host (disk); "
                                    f"--engram-placement {placement} keeps CUDA graphs without it: drop it")
        if OVERLAP_OFF not in argv:
            raise EngramConfigError(f"--engram-disk-graphs on needs {OVERLAP_OFF}: the overlap scheduler launches a "
                                    f"decode step before its tokens reach the host, which reads the step's rows "
                                    f"before the graph replays")
    if not placement_spec(placement).capturable and disk_graphs and not (trace or modes):
        why = (f"--engram-placement {placement} reads a prefill's row ids on the host inside the step, which a "
               f"captured CUDA graph cannot replay (decode graphs kept: --engram-disk-graphs on)")
        off = ("prefill",)
    elif not placement_spec(placement).capturable:
        why = (f"--engram-placement {placement} reads each step's row ids on the host, which a captured CUDA graph "
               f"cannot replay")
    elif trace:
        why = "--engram-trace writes each step's ids and rows from the host, which a captured CUDA graph cannot replay"
    elif modes:
        why = (f"{modes} switches Engram per token from the host each step (serving/modes.py), which a captured "
               f"CUDA graph cannot replay")
    else:
        return [], None
    explicit = {phase: _flag_value(argv, flag) for phase, flag in PHASE_FLAGS.items()}
    raw = _flag_value(argv, "--cuda-graph-config")
    if raw is not None:
        try:
            config = json.loads(raw)
        except ValueError:
            config = None
        if isinstance(config, dict):
            for phase in PHASES:
                backend = (config.get(phase) or {}).get("backend") if isinstance(config.get(phase), dict) else None
                if backend is not None:
                    explicit[phase] = backend
    asked = [f"{PHASE_FLAGS[p]} {b}" for p, b in explicit.items() if p in off and b is not None and b != DISABLED]
    if asked:
        raise EngramConfigError(f"{why}: drop {' and '.join(asked)} ({'prefill ' if off != PHASES else ''}CUDA graphs "
                                f"must stay off)")
    if LEGACY_OFF in argv:
        return [], None
    add = []
    for phase in off:
        if explicit[phase] is None and PHASE_OFF[phase] not in argv:
            add += [PHASE_FLAGS[phase], DISABLED]
    if not add:
        return [], None
    which = "prefill CUDA graphs" if off != PHASES else "CUDA graphs"
    return add, f"{why}: {which} off (added {' '.join(add)})"


def graph_phases_on() -> list[str]:
    """The phases SGLang will capture CUDA graphs for in this process ([] outside SGLang)."""
    try:
        from sglang.srt.runtime_context import get_exec

        config = get_exec().graph.cuda_graph_config
    except Exception:  # not inside a configured SGLang process (unit tests, tools)
        return []
    if config is None:
        return []
    on = []
    for phase in PHASES:
        backend = getattr(getattr(config, phase, None), "backend", DISABLED)
        if backend not in (None, DISABLED):
            on.append(phase)
    return on


def overlap_scheduling_on() -> bool:
    """Whether SGLang's overlap scheduler runs in this process (True outside SGLang: unknown)."""
    try:
        from sglang.srt.runtime_context import get_schedule

        return not get_schedule().disable_overlap_schedule
    except Exception:  # not inside a configured SGLang process
        return True


def check_capturable(stores: Iterable, device, phases: Optional[Sequence[str]] = None,
                     trace: Optional[str] = None, staged: bool = False, overlap: Optional[bool] = None,
                     modes: bool = False) -> None:
    """Refuse (EngramError, one line) stores that need host ids, a step trace, or Engram
    modes (`modes`: a token may run with Engram off, which a replay would not apply), when
    SGLang will capture CUDA graphs on this device. `staged` (the runtime stages those
    stores' decode rows before each replay: --engram-disk-graphs) allows decode graphs
    while the overlap scheduler is off (`overlap`: None asks SGLang)."""
    import torch

    if torch.device(device).type != "cuda":
        return
    host = sorted({s.placement for s in stores if s.needs_host_ids})
    if host and staged and not trace and not modes:
        phases = graph_phases_on() if phases is None else list(phases)
        overlap = overlap_scheduling_on() if overlap is None else overlap
        if "decode" in phases and overlap:
            raise EngramError(f"placement {', '.join(host)} with --engram-disk-graphs on stages each decode step's "
                              f"rows before the replay, which needs the step's tokens on the host first: start "
                              f"SGLang with {OVERLAP_OFF}")
        if "prefill" in phases:
            raise EngramError(f"placement {', '.join(host)} reads a prefill's row ids on the host inside the step, "
                              f"which a captured CUDA graph cannot replay, but CUDA graphs are on for prefill: start "
                              f"SGLang with --cuda-graph-backend-prefill disabled")
        return
    if host:
        why = f"placement {', '.join(host)} reads each step's row ids on the host"
    elif trace:
        why = "--engram-trace writes each step's ids and rows from the host"
    elif modes:
        why = "Engram modes (--engram-mode, --engram-ablation) switch Engram off per token on the host"
    else:
        return
    phases = graph_phases_on() if phases is None else list(phases)
    if phases:
        raise EngramError(f"{why}, which a captured CUDA graph cannot replay, but CUDA graphs are on for "
                          f"{' and '.join(phases)}: start SGLang with --cuda-graph-backend-decode disabled "
                          f"--cuda-graph-backend-prefill disabled")
