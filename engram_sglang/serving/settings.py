"""Serving settings: `--engram-*` SGLang flags, `ENGRAM_*` environment variables as fallback.

SGLang keeps only its own ServerArgs fields, and its scheduler runs in other processes, so
the plugin turns each `--engram-*` flag into its `ENGRAM_*` variable in the launching
process (children inherit the environment); the model reads `ServeSettings.from_env()`
where it is built. Every knob, its variable, its default and the values it takes is in `KNOBS`
(and the README): the flags, the variables' parsing and `ServeSettings`' fields are made from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import os
from typing import Any, Mapping, Optional

from ..core.config import DEFAULT_TABLE_DIR
from ..core.errors import EngramConfigError
from ..core.fileio import READ_RETRIES
from ..core.placement_table import PLACEMENT_TABLE, PLACEMENTS
from ..core.placement_table import placement as placement_spec

logger = logging.getLogger(__name__)

MAX_DISK_THREADS = 256  # stores.rowio.MAX_THREADS (not imported: this module loads without torch)
NUMA_MODES, MAX_NUMA_NODES = ("auto", "interleave", "off"), 1024  # stores.numa.MODES, MAX_NODES (it loads torch)

DEBUG_KNOBS = ("corrupt-history", "skip-wait", "skip-conv-transfer")
_TRUE, _FALSE = {"1", "true", "on", "yes"}, {"0", "false", "off", "no", ""}


@dataclasses.dataclass(frozen=True)
class Knob:
    flag: str  # without the leading "--engram-"
    kind: str  # "str", "int", "bool", "auto-bool" (on, off or auto), "require-bool" (on, off or require),
    # "choice", "list", "numa"
    default: Any
    help: str
    choices: tuple[str, ...] = ()  # the words a "choice" or "numa" knob takes, or a "list" knob's items
    low: int = 0  # the smallest "int" (or "numa" node number) taken
    high: Optional[int] = None  # the largest, None for no ceiling
    high_why: str = ""  # what the ceiling stands for, in its error message

    @property
    def env(self) -> str:
        return "ENGRAM_" + self.flag.upper().replace("-", "_")

    @property
    def field(self) -> str:
        return self.flag.replace("-", "_")

    @property
    def field_type(self) -> Any:
        """The type of its ServeSettings field: the kind's, Optional where the default is None."""
        t = _KIND_TYPES[self.kind]
        return Optional[t] if self.default is None else t


# An auto-bool field holds "auto" until the runtime resolves it (serving/whole_rows_auto.py); a
# require-bool field holds "require" (truthy: "on", and no fallback where on would fall back).
_KIND_TYPES = {"str": str, "int": int, "bool": bool, "auto-bool": bool | str, "require-bool": bool | str,
               "choice": str, "list": tuple[str, ...], "numa": str}
_BOOL_PLUS = {"auto-bool": "auto", "require-bool": "require"}  # the word a bool-plus kind takes besides on/off


KNOBS: tuple[Knob, ...] = (
    Knob("table-dir", "str", None, f"packed table directory (default: MODEL_PATH/{DEFAULT_TABLE_DIR})"),
    Knob("skip-provenance", "bool", False, "start even when the checkpoint the tables' manifest records differs "
         "from the model directory's (checked at start-up; `engram-sglang tables verify --record` records it)"),
    Knob("placement", "choice", "device", "where the tables live: device memory, host memory, or disk",
         PLACEMENTS),
    Knob("backend", "str", "auto", "gather backend (auto lets the device probe choose; torch, triton, cpu, cuda, hip)"),
    Knob("host-shared", "require-bool", False, "host placement: on, one copy per node in /dev/shm instead of one per "
         "rank, falling back to a private copy (with a warning) where the shm dir cannot hold it; require, refuse to "
         "start instead; off, one copy per rank"),
    Knob("shm-dir", "str", "/dev/shm", "host placement: where the shared copy lives"),
    Knob("host-whole-rows", "auto-bool", "auto", "host placement with --engram-host-shared on: on, each tensor-parallel "
         "rank reads the whole rows of its tokens from the node's copy, no all-reduce; off, a row shard per rank and an "
         "all-reduce; auto, what `engram-sglang plan` picks for the TP size and the GPU (whole rows at TP 1, without a "
         "GPU, or on a GPU configs/gpus.json lacks; logged at start-up)"),
    Knob("host-keep", "bool", False, "host placement: keep the node's shared copy when the last server leaves "
         "(else it removes it); see `engram-sglang shm ls`"),
    Knob("host-numa", "numa", "auto", "host placement: NUMA node of the table memory: auto (each rank's copy on its "
         "GPU's node, one shared copy per node; interleaved where a node's free memory cannot hold it), interleave, "
         "off, or a node number", NUMA_MODES, high=MAX_NUMA_NODES - 1),
    Knob("huge-pages", "bool", True, "host placement: back the table with transparent huge pages"),
    Knob("disk-threads", "int", 64, "disk placement: row reads in flight", low=1, high=MAX_DISK_THREADS,
         high_why="reads in flight"),
    Knob("disk-direct", "bool", False, "disk placement: O_DIRECT reads instead of the page cache"),
    Knob("disk-retries", "int", READ_RETRIES, "disk placement: retries of a failed read before the request fails"),
    Knob("disk-native-step", "bool", True, "disk placement: each layer's step in one native call (dedupe, DRAM-cache "
         "lookup, reads, admission; on the CPU the decode); off: the numpy path, the same-run baseline"),
    Knob("disk-dram-cache-mib", "int", 0, "disk placement: MiB of host memory (all Engram layers of a rank) for a "
         "row cache in front of the table files; 0 for none (pair it with --engram-disk-direct on)"),
    Knob("cache-mib", "int", 0, "host or disk placement: MiB of device memory (all Engram layers of a rank) for a "
         "hot-row cache in front of the table; 0 for none"),
    Knob("cache-profile", "str", None, "pre-warm the hot-row cache from this `engram-sglang profile` file"),
    Knob("prefetch", "bool", True, "gather every Engram layer's rows at the start of the step (off: gather "
         "inside each Engram layer)"),
    Knob("disk-graphs", "bool", False, "disk placement: keep decode CUDA graphs, each step's rows staged into fixed "
         "device buffers before the replay (needs SGLang's --disable-overlap-schedule; see docs/architecture.md)"),
    Knob("mode", "choice", "on", "which tokens use Engram: on, off, prefill (prompt positions), decode (generated "
         "positions); see docs/engram.md", ("on", "off", "prefill", "decode")),
    Knob("ablation", "bool", False, "take a per-request Engram mode in sampling_params.custom_params[\"engram\"] "
         "(else such a request gets HTTP 400)"),
    Knob("trace", "str", None, "append one JSON line per step (hash ids and row checksums per token) to this file"),
    Knob("stats-file", "str", None, "keep table statistics (JSON) up to date in this file, one per rank: `{rank}` in "
         "the path becomes tpN.dpM (tpN.dpM.ppK with pipeline stages), else with TP, DP or PP > 1 it goes before the "
         "extension"),
    Knob("debug", "list", (), "negative controls for tests only: corrupt-history, skip-wait, skip-conv-transfer "
         "(PD decode)", DEBUG_KNOBS),
)

# The ENGRAM_* variables that are not knobs: read from the environment by something else, so a
# set one is not a typo. tests/serving/test_env_names.py walks the repository: an ENGRAM_ name on
# none of KNOBS, this and OTHER_NAMES fails it, so a new variable is declared here.
NON_KNOB_VARIABLES: tuple[str, ...] = (
    # fault injection: the LD_PRELOAD library kernels/io/engram_faults.c (tests, bench/soak.py)
    "ENGRAM_FAULTS_MATCH", "ENGRAM_FAULTS_ARM", "ENGRAM_FAULTS_SEED", "ENGRAM_FAULTS_STATS_DIR",
    "ENGRAM_FAULTS_WRITE_MATCH", "ENGRAM_FAULTS_STALL_PROB", "ENGRAM_FAULTS_STALL_EVERY", "ENGRAM_FAULTS_STALL_MS",
    "ENGRAM_FAULTS_SHORT_PROB", "ENGRAM_FAULTS_SHORT_EVERY",
    *(f"ENGRAM_FAULTS_{kind}_{what}" for kind in ("EIO", "WRITE") for what in ("PROB", "EVERY", "BURST", "BURST_MS",
                                                                                 "GAP_MS")),
    # native libraries: where the built ones are (core/nativelibs.py), the host builds' flags (make
    # variables of kernels/host-flags.mk), the host threads and the disk I/O engine they use (getenv)
    "ENGRAM_KERNELS_DIR", "ENGRAM_CPU_CXXFLAGS", "ENGRAM_ROWIO_CXXFLAGS", "ENGRAM_CPU_THREADS", "ENGRAM_IO_ENGINE",
    # the configs/ folder (core/config.py)
    "ENGRAM_CONFIGS_DIR",
    # the Docker images: health check (docker/healthcheck.py), /dev/shm size (docker/gpu-run.sh),
    # the make wrapper (docker/engram-make.sh)
    "ENGRAM_HEALTH_URL", "ENGRAM_HEALTH_TIMEOUT", "ENGRAM_SHM_SIZE", "ENGRAM_ROOT", "ENGRAM_SETUP_STAMP",
    # tests and benchmarks only: lint required (make lint), an upstream wheel for bench/gather.py,
    # a knob tests/serving/test_model_settings.py adds to its own settings class
    "ENGRAM_LINT_REQUIRED", "ENGRAM_SGLANG_WHEEL", "ENGRAM_PROBE_DEPTH",
)

# ENGRAM_ names in the repository that nothing reads from the environment: set there, they get
# the warning like any unknown name.
OTHER_NAMES: tuple[str, ...] = (
    # C/C++/CUDA macros and enum values of kernels/
    "ENGRAM_AIO_UNAVAILABLE", "ENGRAM_AVX512_DECODE_TARGET", "ENGRAM_BAD_ARGUMENT", "ENGRAM_CPU_ABI_VERSION",
    "ENGRAM_DEVICE_COMPILER", "ENGRAM_GPU_ABI_VERSION", "ENGRAM_GPU_API", "ENGRAM_GPU_CAT", "ENGRAM_GPU_CAT2",
    "ENGRAM_HAVE_AVX512_DECODE", "ENGRAM_HD", "ENGRAM_IO_ISA_CLONES", "ENGRAM_ISA_CLONES", "ENGRAM_MISALIGNED",
    "ENGRAM_OK", "ENGRAM_READ_AIO", "ENGRAM_READ_MAPPED", "ENGRAM_READ_NONE", "ENGRAM_READ_PREAD",
    "ENGRAM_ROWIO_MAX_THREADS", "ENGRAM_STEP_AIO_UNAVAILABLE", "ENGRAM_STEP_BAD_ARGUMENT", "ENGRAM_STEP_OK",
    "ENGRAM_STEP_UNREAD", "ENGRAM_TARGETS", "ENGRAM_UNROLL", "ENGRAM_VENDOR",
    # Python constants (tools/demo/model.py)
    "ENGRAM_HEADS", "ENGRAM_LAYERS", "ENGRAM_VOCAB",
    # retired names the README's list of renames gives
    "ENGRAM_IO_CXXFLAGS",
    # the misspelt knob docs/operations.md and the tests give as the example of the warning
    "ENGRAM_PLACMENT",
)

_warned: set[str] = set()  # the unknown names this process has warned about


def unknown_variables(env: Mapping[str, str], knobs: tuple[Knob, ...] = KNOBS) -> dict[str, Optional[str]]:
    """The ENGRAM_* names in `env` that are neither a knob nor a NON_KNOB_VARIABLES entry, each
    with the closest known name (None where none is close)."""
    known = sorted({k.env for k in (*KNOBS, *knobs)} | set(NON_KNOB_VARIABLES))
    return {name: next(iter(difflib.get_close_matches(name, known, n=1)), None)
            for name in sorted(env) if name.startswith("ENGRAM_") and name not in known}


def warn_unknown_variables(env: Mapping[str, str], knobs: tuple[Knob, ...] = KNOBS) -> None:
    """One warning naming the unknown ENGRAM_* variables (a misspelt knob is otherwise ignored
    silently: ENGRAM_PLACMENT=host would serve from device memory), once per name and process.
    Never a refusal: the variable may be another tool's."""
    unknown = {n: close for n, close in unknown_variables(env, knobs).items() if n not in _warned}
    if not unknown:
        return
    _warned.update(unknown)
    names = ", ".join(f"{n} (did you mean {close}?)" if close else n for n, close in unknown.items())
    logger.warning("ignoring unknown environment variable(s) %s: engram-sglang reads no such variable "
                   "(`python -m engram_sglang.serving.settings` lists the knobs)", names)


def _fields_from(knobs: tuple[Knob, ...]):
    """Class decorator: a frozen dataclass with one field per knob, named, typed and defaulted by
    the knob, so that a knob is added in the table alone."""
    def build(cls):
        cls.__annotations__ = {k.field: k.field_type for k in knobs}
        for k in knobs:
            setattr(cls, k.field, k.default)
        cls._knobs = knobs
        return dataclasses.dataclass(frozen=True)(cls)
    return build


@_fields_from(KNOBS)
class ServeSettings:
    """One field per knob of KNOBS (table_dir, placement, ..., debug), its default the knob's."""

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "ServeSettings":
        """Read every ENGRAM_* variable; a bad value raises EngramConfigError (one line), an
        unknown one is warned about (warn_unknown_variables)."""
        env = os.environ if env is None else env
        warn_unknown_variables(env, cls._knobs)
        values = {}
        for knob in cls._knobs:
            raw = env.get(knob.env)
            if raw is not None:
                values[knob.field] = _parse(knob, raw)
        return cls(**values)

    def store_options(self) -> dict:
        """open_store's options for this placement, as the placement table (placement_table.py) names them."""
        spec = placement_spec(self.placement)
        for p in PLACEMENT_TABLE.values():  # a knob only another placement reads would be silently ignored
            for o in p.options:
                if o.only_when_set and o.name not in spec.option_names and getattr(self, _field(o.knob)):
                    knob = next(k for k in KNOBS if k.flag == o.knob)
                    raise EngramConfigError(f"{knob.env} (--engram-{knob.flag}) needs placement {p.name}, "
                                            f"got {self.placement}")
        if self.cache_mib and not spec.cache_in_front:
            takes = " or ".join(p.name for p in PLACEMENT_TABLE.values() if p.cache_in_front)
            raise EngramConfigError(f"ENGRAM_CACHE_MIB (--engram-cache-mib) needs placement {takes}: "
                                    f"placement {self.placement} already holds the table in device memory")
        options = {}
        for o in spec.options:
            value = getattr(self, _field(o.knob))
            if o.only_when_set and not value:
                continue
            options[o.name] = value * o.scale if o.scale != 1 else value
        if self.cache_mib:
            options.update(cache_bytes=self.cache_mib << 20, cache_profile=self.cache_profile)
        return options


def _field(flag: str) -> str:
    return flag.replace("-", "_")


def _parse(knob: Knob, raw: str) -> Any:
    where = f"{knob.env} (--engram-{knob.flag})"
    value = raw.strip()
    if knob.kind == "str":
        return value or None
    if knob.kind == "int":
        try:
            n = int(value)
        except ValueError:
            raise EngramConfigError(f"{where} must be an integer, got {raw!r}") from None
        if n < knob.low:
            raise EngramConfigError(f"{where} must be >= {knob.low}, got {n}")
        if knob.high is not None and n > knob.high:
            why = f" ({knob.high_why})" if knob.high_why else ""
            raise EngramConfigError(f"{where} must be at most {knob.high}{why}, got {n}")
        return n
    if knob.kind in _BOOL_PLUS and value.lower() == _BOOL_PLUS[knob.kind]:
        return _BOOL_PLUS[knob.kind]
    if knob.kind == "bool" or knob.kind in _BOOL_PLUS:
        low = value.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        also = f", or {_BOOL_PLUS[knob.kind]}" if knob.kind in _BOOL_PLUS else ""
        raise EngramConfigError(f"{where} must be on/off (1/0, true/false){also}, got {raw!r}")
    if knob.kind == "numa":  # a mode word or a node number
        low = value.lower()
        if low in knob.choices or (low.isdigit() and knob.low <= int(low) <= knob.high):
            return low
        raise EngramConfigError(f"{where} must be {', '.join(knob.choices)} or a NUMA node number "
                                f"({knob.low}..{knob.high}), got {raw!r}")
    if knob.kind == "choice":
        if value not in knob.choices:
            raise EngramConfigError(f"{where} must be one of {', '.join(knob.choices)}, got {raw!r}")
        return value
    items = tuple(x.strip() for x in value.split(",") if x.strip())
    bad = [x for x in items if x not in knob.choices]
    if bad:
        raise EngramConfigError(f"{where}: unknown value(s) {', '.join(bad)}; known: {', '.join(knob.choices)}")
    return items


# ------------------------------------------------------------------ command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `--engram-*` flags, as a group of an (SGLang) argument parser."""
    group = parser.add_argument_group("engram-sglang", "Engram tables (each flag also reads ENGRAM_* from the environment)")
    for knob in KNOBS:
        kwargs: dict = {"dest": "engram_" + knob.field, "default": None,
                        "help": f"{knob.help} [env {knob.env}; default {_shown(knob.default)}]"}
        if knob.kind == "bool" or knob.kind in _BOOL_PLUS:
            words = ("on", "off") + ((_BOOL_PLUS[knob.kind],) if knob.kind in _BOOL_PLUS else ())
            kwargs.update(nargs="?", const="1", metavar="|".join(words))
        elif knob.kind == "choice":
            kwargs.update(choices=knob.choices)
        group.add_argument(f"--engram-{knob.flag}", **kwargs)


def export_flags(argv: list[str]) -> dict[str, str]:
    """Parse the `--engram-*` flags out of argv, check them, and put each into its ENGRAM_*
    variable for every process SGLang starts. Returns what was set. Raises
    EngramConfigError on a bad value."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_arguments(parser)
    known, _ = parser.parse_known_args(argv)
    exported = {}
    for knob in KNOBS:
        value = getattr(known, "engram_" + knob.field)
        if value is not None:
            exported[knob.env] = str(value)
    ServeSettings.from_env({**os.environ, **exported})  # refuse bad values before anything starts
    os.environ.update(exported)
    return exported


def knobs_markdown() -> str:
    """The README's table of serving knobs (flag, variable, default, meaning)."""
    lines = ["| flag | environment | default | what |", "|---|---|---|---|"]
    for k in KNOBS:
        lines.append(f"| `--engram-{k.flag}` | `{k.env}` | {_shown(k.default)} | {k.help} |")
    return "\n".join(lines)


def _shown(default: Any) -> str:
    if default is True or default is False:
        return "on" if default else "off"
    if default in (None, "", ()):
        return "none"
    return ",".join(default) if isinstance(default, tuple) else str(default)


if __name__ == "__main__":
    print(knobs_markdown())
