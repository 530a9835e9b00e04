"""Capacity planner: what Engram tables cost in HBM, host DRAM and /dev/shm, and what moving
them off HBM buys, for a model on a GPU SKU at a tensor-parallel size.

`engram-sglang plan --model CONFIG_OR_PRESET --gpu SKU [--tp N] [--placement P] [--json]`

Sources of every figure:
* table bytes: the model's Engram config (rows per layer from the prime layout, packed rows of
  `head_dim` fp8 bytes + one e8m0 scale byte per 32 values: 264 B for DeepSeek-V4.1);
* GPU SKUs: `configs/gpus.json` (driver-reported HBM, host link, vendor, arch);
* model serving facts the config does not carry (non-Engram weight bytes, KV bytes per token,
  attention heads, context length): `configs/models/<model_type>.json`, each with its source;
  a config.json with standard attention fields gives KV bytes and heads by itself;
* runtime reserve: SGLang 0.5.23's own default rule (srt/arg_groups/memory_hook.py).
Every assumption is printed with the plan (and is in `--json` under "assumptions").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from .config import EngramConfig, configs_dir
from .errors import EngramError
from .hashing import EngramLayout
from .rowformat import BLOCK

GIB = 1 << 30
PLACEMENTS = ("device", "host", "disk")
HOST_LAYOUTS = ("shared", "per_rank")

# Batches the host-link estimate is quoted for: a decode step of 256 requests and one
# prefill chunk of 8192 tokens (DESIGN.md performance model).
DECODE_BATCH = 256
PREFILL_CHUNK = 8192
CACHE_LINE = 64

# SGLang's docker examples give the server itself --shm-size 32g (NCCL and torch IPC buffers);
# a shared host table in /dev/shm comes on top of that.
SGLANG_SHM_GIB = 32

# SGLang 0.5.23 memory_hook defaults behind its reserve (activations, graphs, NCCL): the
# chunked-prefill size and decode CUDA-graph batch it assumes on a large GPU.
SGLANG_CHUNKED_PREFILL = 8192
SGLANG_DECODE_GRAPH_BS = 256


class PlannerError(EngramError, ValueError):
    """Bad planner input (unknown SKU, invalid TP, missing model facts): one line."""


# Bounds on every number the plan reads, far beyond any real deployment: inf, NaN, negative
# or absurd values would otherwise overflow (int(inf)) or loop (TP sizes up to the head count).
MAX_GIB = 1 << 20  # 1 PiB: any memory size in GiB
MAX_TP = 1024
MAX_HEADS = 1 << 16  # attention heads, KV heads, layers
MAX_TOKENS = 1 << 40  # context length, KV tokens
MAX_KV_BYTES = 1 << 30  # KV cache bytes per token


def bounded(v: Any, what: str, lo: float, hi: float, whole: bool = False) -> Any:
    """`v` if it is a finite number (whole if asked) in [lo, hi]; else one line naming `what`."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    if ok and isinstance(v, float):
        ok = math.isfinite(v) and (not whole or v.is_integer())
    if not ok or not lo <= v <= hi:
        kind = "a whole number" if whole else "a number"
        raise PlannerError(f"{what} must be {kind} from {lo} to {hi}, got {v!r}")
    return int(v) if whole else v


# ----------------------------------------------------------------------------- data
@dataclasses.dataclass(frozen=True)
class GpuSku:
    key: str
    name: str
    vendor: str
    arch: str
    hbm_bytes: int
    host_link: str
    host_link_gbps: float
    gpus_per_node: int
    runner_label: str

    @property
    def docker_vendor(self) -> str:
        """Which of docker/Dockerfile.{cuda,rocm} serves this SKU."""
        return "cuda" if self.vendor == "nvidia" else "rocm"


def gpus_file() -> Path:
    return configs_dir() / "gpus.json"


def load_gpus(path: Optional[Path] = None) -> dict[str, GpuSku]:
    """All SKUs of configs/gpus.json, keyed by their upper-case name."""
    path = path or gpus_file()
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise PlannerError(f"{path}: no GPU SKU file") from None
    except json.JSONDecodeError as e:
        raise PlannerError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    out: dict[str, GpuSku] = {}
    for key, d in raw.items():
        if key.startswith("_"):
            continue
        try:
            out[key.upper()] = GpuSku(
                key=key,
                name=str(d["name"]),
                vendor=str(d["vendor"]),
                arch=str(d["arch"]),
                hbm_bytes=int(d["hbm_bytes"]),
                host_link=str(d["host_link"]),
                host_link_gbps=float(d["host_link_gbps"]),
                gpus_per_node=int(d["gpus_per_node"]),
                runner_label=str(d["runner_label"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PlannerError(f"{path}: SKU {key!r} is missing or has a bad field ({e})") from None
    return out


def gpu_sku(name: str, path: Optional[Path] = None) -> GpuSku:
    gpus = load_gpus(path)
    sku = gpus.get(str(name).strip().upper())
    if sku is None:
        known = ", ".join(g.key for g in gpus.values())
        raise PlannerError(f"unknown GPU SKU {name!r}; known SKUs: {known} (configs/gpus.json)")
    return sku


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What the planner knows about a model beyond its Engram tables, with sources."""

    name: str
    model_type: Optional[str]
    attention_heads: Optional[int]
    context_length: Optional[int]
    weight_bytes: Optional[int]
    kv_bytes_per_token: Optional[float]
    kv_replicated: bool
    kv_heads: Optional[int]  # KV heads of standard attention, split over TP; None: not known
    sources: dict[str, str]


def _raw_config(cfg: EngramConfig) -> dict[str, Any]:
    """The config dict the EngramConfig came from (text_config fields merged over the top)."""
    try:
        raw = json.loads(Path(cfg.source).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    if not isinstance(raw, dict):
        return {}
    text = raw.get("text_config")
    return {**raw, **text} if isinstance(text, dict) else raw


def _model_type(cfg_source: str) -> Optional[str]:
    try:
        raw = json.loads(Path(cfg_source).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    mt = raw.get("model_type") if isinstance(raw, dict) else None
    if not mt and isinstance(raw, dict) and isinstance(raw.get("text_config"), dict):
        mt = raw["text_config"].get("model_type")
    # SGLang and HF name the text half of a VLM "<type>_text"; its serving facts are the same.
    # A model type names a file of configs/models/: a plain name, never a path.
    if not isinstance(mt, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,100}", mt) or mt.startswith("."):
        return None
    return mt.removesuffix("_text")


def load_facts(cfg: EngramConfig) -> ModelFacts:
    """Serving facts: configs/models/<model_type>.json first, then the config's own fields."""
    raw = _raw_config(cfg)
    mt = _model_type(cfg.source)
    facts: dict[str, Any] = {}
    if mt:
        path = configs_dir() / "models" / f"{mt}.json"
        if path.is_file():
            try:
                facts = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise PlannerError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    sources: dict[str, str] = {}

    def fact(key: str, cfg_key: Optional[str] = None) -> Any:
        # A value in the model's own config.json wins over the facts file: it is the model.
        if cfg_key and isinstance(raw.get(cfg_key), (int, float)) and not isinstance(raw.get(cfg_key), bool):
            sources[key] = f"{cfg.source}: {cfg_key}"
            return raw[cfg_key]
        if key in facts:
            sources[key] = facts.get(f"{key}_source", f"configs/models/{mt}.json")
            return facts[key]
        return None

    def checked(key: str, value: Any, lo: float, hi: float, whole: bool) -> Any:
        return None if value is None else bounded(value, f"{sources[key]} ({key})", lo, hi, whole)

    heads = checked("num_attention_heads", fact("num_attention_heads", "num_attention_heads"), 1, MAX_HEADS, True)
    context = checked("context_length", fact("context_length", "max_position_embeddings"), 1, MAX_TOKENS, True)
    weight_gib = checked("non_engram_weight_gib", fact("non_engram_weight_gib"), 0, MAX_GIB, False)
    if weight_gib is not None:
        sources["weight_bytes"] = sources.pop("non_engram_weight_gib")
    kv = checked("kv_bytes_per_token", fact("kv_bytes_per_token"), 1, MAX_KV_BYTES, False)
    replicated = bool(facts.get("kv_replicated_across_tp", False))
    kv_heads = None
    if replicated:
        sources["kv_replicated_across_tp"] = facts.get("kv_replicated_source", f"configs/models/{mt}.json")
    if kv is None:
        kv, kv_heads = _kv_from_attention_fields(raw, sources, cfg.source)
    return ModelFacts(
        name=str(facts.get("name") or mt or Path(cfg.source).stem),
        model_type=mt,
        attention_heads=int(heads) if heads is not None else None,
        context_length=int(context) if context is not None else None,
        weight_bytes=int(round(weight_gib * GIB)) if weight_gib is not None else None,
        kv_bytes_per_token=float(kv) if kv is not None else None,
        kv_replicated=replicated,
        kv_heads=kv_heads,
        sources=sources,
    )


def _kv_from_attention_fields(raw: dict, sources: dict[str, str], where: str) -> tuple[Optional[float], Optional[int]]:
    """KV bytes per token of standard (GQA) attention in bf16: 2 (K, V) x kv heads x head_dim x
    layers x 2 bytes. Returned for the whole model; `kv_per_rank` divides it over TP."""
    if "num_hidden_layers" not in raw or "num_attention_heads" not in raw or not (
            raw.get("head_dim") or "hidden_size" in raw):
        return None, None

    def field(key: str, default: Any = None) -> int:
        return bounded(raw.get(key, default), f"{where}: {key}", 1, MAX_HEADS if key != "head_dim" else 1 << 20, True)

    layers = field("num_hidden_layers")
    heads = field("num_attention_heads")
    kv_heads = field("num_key_value_heads", heads)
    head_dim = field("head_dim") if raw.get("head_dim") else max(1, field("hidden_size") // heads)
    sources["kv_bytes_per_token"] = (
        f"{where}: 2 x num_key_value_heads {kv_heads} x head_dim {head_dim} x "
        f"num_hidden_layers {layers} x 2 B (bf16 KV cache, standard attention)"
    )
    return float(2 * kv_heads * head_dim * layers * 2), kv_heads


# --------------------------------------------------------------------------- the plan
@dataclasses.dataclass
class PlanInputs:
    model: str
    gpu: str
    tp: Optional[int] = None
    placement: str = "host"
    host_layout: str = "shared"
    hot_cache_gib: float = 0.0
    kv_bytes_per_token: Optional[float] = None
    weights_gib: Optional[float] = None
    reserve_gib: Optional[float] = None
    min_kv_tokens: Optional[int] = None
    host_dram_gib: Optional[float] = None


def row_bytes(cfg: EngramConfig) -> int:
    """Bytes of one packed row: head_dim fp8 values + one e8m0 scale per BLOCK values."""
    if cfg.head_dim % BLOCK:
        raise PlannerError(f"{cfg.source}: engram_head_dim {cfg.head_dim} is not a multiple of {BLOCK}")
    return cfg.head_dim + cfg.head_dim // BLOCK


def lines_per_row(rb: int) -> float:
    """Mean 64-byte lines a row touches: rows lie end to end from a page-aligned start, so a
    row's offset within its first line cycles with period 64 / gcd(rb, 64)."""
    period = CACHE_LINE // math.gcd(rb, CACHE_LINE)
    spans = [((k * rb) % CACHE_LINE + rb + CACHE_LINE - 1) // CACHE_LINE for k in range(period)]
    return sum(spans) / period


def shard_bytes(rows: Sequence[int], tp: int, rb: int) -> int:
    """The largest rank's table bytes under row-range sharding (rank r holds a contiguous
    1/TP of every layer's rows, so the largest shard has ceil(rows / TP) rows)."""
    return sum(-(-r // tp) for r in rows) * rb


def sglang_reserve_bytes(tp: int, hbm_bytes: int) -> int:
    """SGLang 0.5.23's default non-static reserve (srt/arg_groups/memory_hook.py): 512 MiB +
    1.5 MiB per chunked-prefill token + TP/8 GiB + 2 MiB per decode-graph batch slot, at least
    10 GiB on a GPU over 60 GiB."""
    mib = 512 + 1.5 * max(SGLANG_CHUNKED_PREFILL, 2048) + tp / 8 * 1024 + 2 * SGLANG_DECODE_GRAPH_BS
    if hbm_bytes > 60 * GIB:
        mib = max(mib, 10 * 1024)
    return int(mib * (1 << 20))


def valid_tps(heads: Optional[int], limit: int = 64) -> list[int]:
    """TP sizes the attention layers accept: divisors of the head count (any size when the
    head count is unknown; row-range table shards work at every TP)."""
    if heads is None:
        return list(range(1, limit + 1))
    return [t for t in range(1, heads + 1) if heads % t == 0]


def _check_tp(tp: Any, facts: ModelFacts) -> int:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise PlannerError(f"--tp must be a whole number >= 1, got {tp!r}")
    if tp > MAX_TP:
        raise PlannerError(f"--tp must be at most {MAX_TP}, got {tp}")
    heads = facts.attention_heads
    if heads is not None and heads % tp:
        ok = ", ".join(str(t) for t in valid_tps(heads))
        raise PlannerError(
            f"--tp {tp} does not divide {facts.name}'s {heads} attention heads; valid TP sizes: {ok}"
        )
    return tp


class Planner:
    """Capacity arithmetic for one model on one SKU; `plan()` gives the report dict."""

    def __init__(self, inputs: PlanInputs):
        if inputs.placement not in PLACEMENTS:
            raise PlannerError(f"--placement must be one of {', '.join(PLACEMENTS)}, got {inputs.placement!r}")
        if inputs.host_layout not in HOST_LAYOUTS:
            raise PlannerError(f"--host-layout must be one of {', '.join(HOST_LAYOUTS)}, got {inputs.host_layout!r}")
        for name in ("hot_cache_gib", "weights_gib", "reserve_gib", "host_dram_gib"):
            if getattr(inputs, name) is not None:
                bounded(getattr(inputs, name), f"--{name.replace('_', '-')}", 0, MAX_GIB)
        if inputs.kv_bytes_per_token is not None:
            bounded(inputs.kv_bytes_per_token, "--kv-bytes-per-token", 1, MAX_KV_BYTES)
        self.inputs = inputs
        self.gpu = gpu_sku(inputs.gpu)
        self.cfg = EngramConfig.resolve(inputs.model)
        self.rows = EngramLayout(self.cfg).num_embeddings
        self.row_bytes = row_bytes(self.cfg)
        facts = load_facts(self.cfg)
        overrides = {}
        if inputs.kv_bytes_per_token is not None:
            # The operator's figure is what one rank's pool spends per token: taken as is.
            overrides.update(kv_bytes_per_token=float(inputs.kv_bytes_per_token), kv_replicated=True, kv_heads=None)
            facts.sources["kv_bytes_per_token"] = "--kv-bytes-per-token (per rank)"
        if inputs.weights_gib is not None:
            overrides["weight_bytes"] = int(round(inputs.weights_gib * GIB))
            facts.sources["weight_bytes"] = "--weights-gib"
        self.facts = dataclasses.replace(facts, **overrides)
        if inputs.tp is not None:
            _check_tp(inputs.tp, self.facts)
        if inputs.min_kv_tokens is not None and (
            isinstance(inputs.min_kv_tokens, bool) or not isinstance(inputs.min_kv_tokens, int) or inputs.min_kv_tokens < 0
        ):
            raise PlannerError(f"--min-kv-tokens must be a whole number >= 0, got {inputs.min_kv_tokens!r}")
        if inputs.min_kv_tokens is not None and inputs.min_kv_tokens > MAX_TOKENS:
            raise PlannerError(f"--min-kv-tokens must be at most {MAX_TOKENS} (2^40), got {inputs.min_kv_tokens}")

    # ------------------------------------------------------------------ pieces
    @property
    def table_bytes(self) -> int:
        return sum(self.rows) * self.row_bytes

    @property
    def rows_per_token(self) -> int:
        return self.cfg.n_layers * self.cfg.hash_columns

    def min_kv_tokens(self) -> int:
        if self.inputs.min_kv_tokens is not None:
            return self.inputs.min_kv_tokens
        # One request at the full context must fit, else the server cannot honour its own limit.
        return self.facts.context_length or 0

    def kv_per_rank(self, tp: int) -> Optional[float]:
        kv = self.facts.kv_bytes_per_token
        if kv is None or self.facts.kv_replicated:
            return kv
        kv_heads = self.facts.kv_heads
        if kv_heads:
            # GQA: each rank keeps kv_heads / TP heads, at least one (replicated below that).
            return kv * max(1, kv_heads // tp) / kv_heads
        return kv / tp

    def reserve(self, tp: int) -> int:
        if self.inputs.reserve_gib is not None:
            return int(round(self.inputs.reserve_gib * GIB))
        return sglang_reserve_bytes(tp, self.gpu.hbm_bytes)

    def hbm(self, tp: int, placement: str) -> dict[str, Any]:
        """Per-GPU HBM budget at `tp` with tables in `placement`."""
        w = self.facts.weight_bytes
        weights = None if w is None else -(-w // tp)
        tables = shard_bytes(self.rows, tp, self.row_bytes) if placement == "device" else 0
        hot = int(round(self.inputs.hot_cache_gib * GIB)) if placement != "device" else 0
        reserve = self.reserve(tp)
        free = None if weights is None else self.gpu.hbm_bytes - weights - tables - hot - reserve
        kv = self.kv_per_rank(tp)
        tokens = None if free is None or kv is None else max(0, int(free // kv))
        freed = 0 if placement == "device" else shard_bytes(self.rows, tp, self.row_bytes) - hot
        need = None if kv is None else int(math.ceil(self.min_kv_tokens() * kv))
        fits = None if free is None or need is None else free >= need
        return {
            "hbm_bytes": self.gpu.hbm_bytes,
            "weights_bytes": weights,
            "tables_bytes": tables,
            "hot_cache_bytes": hot,
            "reserve_bytes": reserve,
            "free_for_kv_bytes": free,
            "kv_tokens": tokens,
            "hbm_freed_bytes": freed,
            "kv_tokens_gained": None if kv is None else int(max(0, freed) // kv),
            "min_kv_bytes": need,
            "fits": fits,
        }

    def smallest_tp(self, placement: str) -> Optional[int]:
        for tp in valid_tps(self.facts.attention_heads):
            if self.hbm(tp, placement)["fits"]:
                return tp
        return None

    def host_dram(self, tp: int) -> dict[str, Any]:
        """Host DRAM per node for the host placement, one node filled with replicas."""
        per_node = self.gpu.gpus_per_node
        ranks = min(tp, per_node)
        replicas = per_node // tp if tp <= per_node else 1
        gpus_used = ranks * replicas
        shard = shard_bytes(self.rows, tp, self.row_bytes)
        return {
            "gpus_per_node": per_node,
            "ranks_per_node": ranks,
            "replicas_per_node": replicas,
            "shared_bytes": self.table_bytes,
            "per_rank_bytes": shard * gpus_used,
            "per_rank_each_bytes": shard,
        }

    def dev_shm(self) -> dict[str, Any]:
        need = self.table_bytes if self.inputs.placement == "host" and self.inputs.host_layout == "shared" else 0
        size_g = math.ceil(need / GIB) + SGLANG_SHM_GIB
        return {
            "needed_bytes": need,
            "docker_shm_size": f"{size_g}g",
            "docker_flags": f"--shm-size={size_g}g (or --ipc=host)",
        }

    def host_link(self, tp: int) -> dict[str, Any]:
        lines = lines_per_row(self.row_bytes)
        per_token = self.rows_per_token * lines * CACHE_LINE
        # Shared layout: every rank maps all rows and gathers every row of its tokens; per-rank
        # layout: a rank gathers only the rows of its own shard (~1/TP), then all-reduces.
        share = 1.0 if self.inputs.host_layout == "shared" else 1.0 / tp
        gbps = self.gpu.host_link_gbps
        decode = DECODE_BATCH * per_token * share
        prefill = PREFILL_CHUNK * per_token * share
        return {
            "link": self.gpu.host_link,
            "peak_gbps": gbps,
            "lines_per_row": lines,
            "bytes_per_token": per_token,
            "decode_batch": DECODE_BATCH,
            "decode_step_bytes": int(decode),
            "decode_step_us_at_peak": decode / (gbps * 1e9) * 1e6,
            "prefill_chunk": PREFILL_CHUNK,
            "prefill_chunk_bytes": int(prefill),
            "prefill_chunk_ms_at_peak": prefill / (gbps * 1e9) * 1e3,
        }

    def assumptions(self, tp: int) -> list[str]:
        f = self.facts
        out = [
            f"table rows from the config's prime layout; {self.row_bytes} B per packed row "
            f"({self.cfg.head_dim} fp8 + {self.cfg.head_dim // BLOCK} e8m0 scales)",
            "row-range TP shards: the largest rank holds ceil(rows/TP) rows of every layer",
            f"HBM per GPU: driver-reported capacity ({self.gpu.name}, configs/gpus.json)",
        ]
        if f.weight_bytes is not None:
            out.append(
                f"non-Engram weights {f.weight_bytes / GIB:.2f} GiB split evenly over TP "
                f"(replicated pieces such as norms add a little): {f.sources.get('weight_bytes', '?')}"
            )
        else:
            out.append("non-Engram weight bytes unknown: pass --weights-gib to get KV room and the smallest TP")
        if f.kv_bytes_per_token is not None:
            where = "per rank, whatever the TP" if f.kv_replicated else "split over TP by KV head"
            out.append(
                f"KV cache {f.kv_bytes_per_token:g} B per token ({where}): {f.sources.get('kv_bytes_per_token', '?')}"
            )
        else:
            out.append("KV bytes per token unknown: pass --kv-bytes-per-token")
        if self.inputs.reserve_gib is None:
            out.append(
                f"runtime reserve {self.reserve(tp) / GIB:.2f} GiB per GPU: SGLang 0.5.23's default rule "
                f"(chunked prefill {SGLANG_CHUNKED_PREFILL}, decode graphs to batch {SGLANG_DECODE_GRAPH_BS}); "
                "--reserve-gib overrides"
            )
        out.append(
            f"'fits' means room for at least {self.min_kv_tokens():,} KV tokens "
            "(one request at the full context; --min-kv-tokens overrides)"
        )
        if f.attention_heads is not None:
            out.append(f"TP must divide the {f.attention_heads} attention heads ({f.sources.get('num_attention_heads', '?')})")
        out.append(
            f"/dev/shm: a shared host table is one {self.table_bytes / GIB:.2f} GiB copy per node in /dev/shm, "
            f"plus the {SGLANG_SHM_GIB} GiB SGLang's docker examples give the server; per-rank tables use anonymous memory"
        )
        out.append(
            f"host link times are at the link's peak ({self.gpu.host_link_gbps:g} GB/s per direction) for "
            f"{lines_per_row(self.row_bytes):g} 64-byte lines per row; measure with bench/tiers.py"
        )
        return out

    # ------------------------------------------------------------------ report
    def plan(self) -> dict[str, Any]:
        inp = self.inputs
        smallest = {p: self.smallest_tp(p) for p in PLACEMENTS}
        tp = inp.tp if inp.tp is not None else smallest[inp.placement]
        warnings: list[str] = []
        if tp is None:
            if self.facts.weight_bytes is None or self.facts.kv_bytes_per_token is None:
                raise PlannerError(
                    f"{self.facts.name}: cannot pick a TP without its weight and KV sizes; "
                    "pass --tp (and --weights-gib / --kv-bytes-per-token for the HBM budget)"
                )
            raise PlannerError(
                f"{self.facts.name} does not fit on {self.gpu.key} with tables in {inp.placement} "
                f"at any TP up to {valid_tps(self.facts.attention_heads)[-1]}"
            )
        per = {p: self.hbm(tp, p) for p in PLACEMENTS}
        chosen = per[inp.placement]
        if chosen["fits"] is False:
            warnings.append(
                f"TP{tp} with tables in {inp.placement} does not fit on {self.gpu.key}: "
                f"{(chosen['free_for_kv_bytes'] or 0) / GIB:.2f} GiB left for KV, need "
                f"{chosen['min_kv_bytes'] / GIB:.2f} GiB; smallest TP that fits: {smallest[inp.placement]}"
            )
        dram = self.host_dram(tp)
        if inp.host_dram_gib is not None and inp.placement == "host":
            need = dram["shared_bytes"] if inp.host_layout == "shared" else dram["per_rank_bytes"]
            if need > inp.host_dram_gib * GIB:
                warnings.append(
                    f"host tables need {need / GIB:.2f} GiB of DRAM per node ({inp.host_layout} layout), "
                    f"more than the {inp.host_dram_gib:g} GiB given"
                )
        shard = shard_bytes(self.rows, tp, self.row_bytes)
        return {
            "model": {
                "name": self.facts.name,
                "config": self.cfg.source,
                "model_type": self.facts.model_type,
                "engram_layers": list(self.cfg.layer_ids),
                "rows_per_layer": list(self.rows),
                "row_bytes": self.row_bytes,
                "attention_heads": self.facts.attention_heads,
                "context_length": self.facts.context_length,
                "weight_bytes": self.facts.weight_bytes,
                "kv_bytes_per_token": self.facts.kv_bytes_per_token,
                "kv_replicated_across_tp": self.facts.kv_replicated,
                "sources": dict(sorted(self.facts.sources.items())),
            },
            "gpu": dataclasses.asdict(self.gpu),
            "tp": tp,
            "placement": inp.placement,
            "host_layout": inp.host_layout,
            "tables": {
                "total_bytes": self.table_bytes,
                "total_gib": round(self.table_bytes / GIB, 2),
                "per_rank_bytes": shard,
                "per_rank_gib": round(shard / GIB, 2),
            },
            "hbm_per_gpu": per,
            "hbm_freed_bytes": chosen["hbm_freed_bytes"],
            "kv_tokens_gained": chosen["kv_tokens_gained"],
            "smallest_tp": smallest,
            "host_dram_per_node": dram,
            "dev_shm": self.dev_shm(),
            "disk_bytes_per_node": self.table_bytes if inp.placement == "disk" else 0,
            "host_link": self.host_link(tp),
            "assumptions": self.assumptions(tp),
            "warnings": warnings,
        }


def plan(**kwargs: Any) -> dict[str, Any]:
    """The plan as a dict (what `--json` prints); keyword arguments are PlanInputs fields."""
    return Planner(PlanInputs(**kwargs)).plan()


# ----------------------------------------------------------------------------- text
def _fmt_gib(b: Optional[float], signed: bool = False) -> str:
    if b is None:
        return "n/a"
    return f"{'+' if signed and b > 0 else ''}{b / GIB:.2f} GiB"


def _fmt_tokens(n: Optional[int], signed: bool = False) -> str:
    if n is None:
        return "n/a"
    sign = "+" if signed and n > 0 else ""
    if n >= 1_000_000:
        return f"{sign}{n / 1e6:.2f} M"
    if n >= 1_000:
        return f"{sign}{n / 1e3:.1f} k"
    return f"{sign}{n}"


def format_text(p: dict[str, Any]) -> str:
    g, m, t = p["gpu"], p["model"], p["tables"]
    tp = p["tp"]
    lines = [
        f"{m['name']} on {g['key']} ({g['vendor']} {g['arch']}, {g['hbm_bytes'] / GIB:.2f} GiB HBM, "
        f"{g['host_link']} {g['host_link_gbps']:g} GB/s), TP{tp}, tables in {p['placement']}"
        + (f" ({p['host_layout']} layout)" if p["placement"] == "host" else ""),
        "",
        "Engram tables",
        f"  {'total':<34}{_fmt_gib(t['total_bytes']):>14}   "
        f"({len(m['rows_per_layer'])} layers, {sum(m['rows_per_layer']):,} rows x {m['row_bytes']} B)",
        f"  {f'per rank at TP{tp}':<34}{_fmt_gib(t['per_rank_bytes']):>14}   (row-range shards, largest rank)",
        "",
        f"HBM per GPU at TP{tp}{'':<22}{'device':>14}{'host':>14}{'disk':>14}",
    ]
    h = p["hbm_per_gpu"]

    def row(label: str, key: str, fmt=_fmt_gib, **kw: Any) -> str:
        return f"  {label:<38}" + "".join(f"{fmt(h[pl][key], **kw):>14}" for pl in PLACEMENTS)

    kvb = m["kv_bytes_per_token"]
    lines += [
        row("weights (non-Engram)", "weights_bytes"),
        row("Engram tables", "tables_bytes"),
        row("hot-row cache", "hot_cache_bytes"),
        row("runtime reserve", "reserve_bytes"),
        row("left for KV cache", "free_for_kv_bytes"),
        row("HBM freed vs device", "hbm_freed_bytes"),
        row(f"KV tokens ({kvb:g} B/token)" if kvb else "KV tokens", "kv_tokens", fmt=_fmt_tokens),
        row("KV tokens gained", "kv_tokens_gained", fmt=_fmt_tokens, signed=True),
        f"  {'fits (room for min KV)':<38}"
        + "".join(f"{('n/a' if h[pl]['fits'] is None else 'yes' if h[pl]['fits'] else 'NO'):>14}" for pl in PLACEMENTS),
        f"  {'smallest TP that fits':<38}"
        + "".join(f"{(str(p['smallest_tp'][pl]) if p['smallest_tp'][pl] else 'none'):>14}" for pl in PLACEMENTS),
        "",
    ]
    d = p["host_dram_per_node"]
    lines += [
        f"Host DRAM per node for host tables ({d['gpus_per_node']} GPUs, {d['replicas_per_node']} "
        f"replica{'s' if d['replicas_per_node'] != 1 else ''} of TP{tp})",
        f"  {'shared layout (one copy per node)':<38}{_fmt_gib(d['shared_bytes']):>14}",
        f"  {'per-rank layout (a shard per rank)':<38}{_fmt_gib(d['per_rank_bytes']):>14}",
    ]
    s = p["dev_shm"]
    lines += [
        f"  {'/dev/shm needed':<38}{_fmt_gib(s['needed_bytes']):>14}   docker run {s['docker_flags']}",
    ]
    if p["disk_bytes_per_node"]:
        lines.append(f"  {'table files on local disk':<38}{_fmt_gib(p['disk_bytes_per_node']):>14}")
    hl = p["host_link"]
    lines += [
        "",
        f"Host link ({hl['link']}, {hl['peak_gbps']:g} GB/s peak; {hl['lines_per_row']:g} lines of 64 B per row, "
        f"{p['host_layout']} layout)",
        f"  {'decode step of ' + str(hl['decode_batch']) + ' tokens':<38}"
        f"{hl['decode_step_bytes'] / 1e6:>10.2f} MB   {hl['decode_step_us_at_peak']:.0f} us at peak",
        f"  {'prefill chunk of ' + str(hl['prefill_chunk']) + ' tokens':<38}"
        f"{hl['prefill_chunk_bytes'] / 1e6:>10.2f} MB   {hl['prefill_chunk_ms_at_peak']:.2f} ms at peak",
        "",
        "Assumptions",
        *(f"  - {a}" for a in p["assumptions"]),
    ]
    if p["warnings"]:
        lines += ["", "Warnings", *(f"  ! {w}" for w in p["warnings"])]
    return "\n".join(lines)


# ------------------------------------------------------------------------------ CLI
def add_parser(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    """Add the `plan` subcommand to an argparse subparsers object; its handler is `cmd_plan`
    (also set as the parser's `func` default)."""
    p = subparsers.add_parser(
        "plan",
        help="plan capacity: table bytes, HBM freed, KV gained, smallest TP, host DRAM, /dev/shm",
        description=(
            "Capacity plan for serving a model's Engram tables on a GPU SKU: table bytes in total "
            "and per rank, HBM freed and KV tokens gained by moving them off HBM, the smallest TP "
            "that fits per placement, host DRAM per node and /dev/shm needed."
        ),
    )
    _add_arguments(p)
    p.set_defaults(func=cmd_plan)
    return p


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="CONFIG_OR_PRESET",
                   help="preset name (e.g. deepseek-v4.1-flash), a config.json or a model directory")
    p.add_argument("--gpu", required=True, metavar="SKU",
                   help="GPU SKU from configs/gpus.json (H100, H200, B200, B300, GB200, MI300X, MI355X)")
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel size (default: the smallest that fits with the chosen placement)")
    p.add_argument("--placement", choices=PLACEMENTS, default="host",
                   help="where the tables live (default: host)")
    p.add_argument("--host-layout", choices=HOST_LAYOUTS, default="shared",
                   help="host placement: one copy per node in /dev/shm, or a shard per rank (default: shared)")
    p.add_argument("--hot-cache-gib", type=float, default=0.0,
                   help="HBM per GPU given to the hot-row cache with host/disk placement (default: 0)")
    p.add_argument("--kv-bytes-per-token", type=float, default=None,
                   help="override the model's KV cache bytes per token (per rank)")
    p.add_argument("--weights-gib", type=float, default=None,
                   help="override the model's non-Engram weight size (GiB, whole model)")
    p.add_argument("--reserve-gib", type=float, default=None,
                   help="override the runtime reserve per GPU (default: SGLang's own rule)")
    p.add_argument("--min-kv-tokens", type=int, default=None,
                   help="KV tokens a placement must leave room for to 'fit' (default: the context length)")
    p.add_argument("--host-dram-gib", type=float, default=None,
                   help="host DRAM per node; warns when host tables need more")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def cmd_plan(args: argparse.Namespace) -> int:
    """Handler of `engram-sglang plan`: prints the plan; one-line error and exit code 2 on bad input."""
    try:
        result = plan(
            model=args.model,
            gpu=args.gpu,
            tp=args.tp,
            placement=args.placement,
            host_layout=args.host_layout,
            hot_cache_gib=args.hot_cache_gib,
            kv_bytes_per_token=args.kv_bytes_per_token,
            weights_gib=args.weights_gib,
            reserve_gib=args.reserve_gib,
            min_kv_tokens=args.min_kv_tokens,
            host_dram_gib=args.host_dram_gib,
        )
    except EngramError as e:
        print(f"engram-sglang plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_text(result))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m engram_sglang.planner ...`: the same as `engram-sglang plan ...`."""
    parser = argparse.ArgumentParser(prog="engram-sglang plan", description="Engram capacity planner")
    _add_arguments(parser)
    return cmd_plan(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
