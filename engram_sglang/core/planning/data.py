"""The planner's data: GPU SKUs (configs/gpus.json) and a model's serving facts beyond its Engram
config (configs/models/<model_type>.json, else the config's standard attention fields), each
figure with its source; the bounds every number the plan reads must keep.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any, Optional

from ..config import EngramConfig, configs_dir
from ..errors import EngramError

GIB = 1 << 30


class PlannerError(EngramError, ValueError):
    """Bad planner input (unknown SKU, invalid TP, missing model facts): one line."""


# Bounds on every number the plan reads, far beyond any real deployment: inf, NaN, negative
# or absurd values would otherwise overflow (int(inf)) or loop (TP sizes up to the head count).
MAX_GIB = 1 << 20  # 1 PiB: any memory size in GiB
MAX_TP = 1024
MAX_NUMA_NODES = 1024  # the kernel's NODES_SHIFT is at most 10
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
    numa_nodes: int = 1  # NUMA nodes with CPUs of the usual host, and the DRAM of each
    dram_per_numa_node_bytes: Optional[int] = None
    dram_source: str = ""
    gpu_link: str = ""  # GPU-to-GPU link (what a TP all-reduce runs over) and its peak per direction
    gpu_link_gbps: Optional[float] = None

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
                numa_nodes=int(bounded(d.get("numa_nodes", 1), f"{path}: {key} numa_nodes", 1, MAX_NUMA_NODES, True)),
                dram_per_numa_node_bytes=None if d.get("dram_per_numa_node_gib") is None else int(round(
                    bounded(d["dram_per_numa_node_gib"], f"{path}: {key} dram_per_numa_node_gib", 0, MAX_GIB) * GIB)),
                dram_source=str(d.get("dram_source", "")),
                gpu_link=str(d.get("gpu_link", "")),
                gpu_link_gbps=None if d.get("gpu_link_gbps") is None else float(
                    bounded(d["gpu_link_gbps"], f"{path}: {key} gpu_link_gbps", 1, 1e5)),
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
    decode_lead_ms: Optional[float] = None  # a decode step's time before the first Engram layer (disk plan)
    kv_fixed_bytes: int = 0  # per rank, before KV tokens are counted (DeepSeek-V4's sliding-window pool)
    kv_bytes_per_token_elsewhere: Optional[float] = None  # another engine's figure, shown beside ours


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
    lead = checked("decode_lead_ms", fact("decode_lead_ms"), 0, 1e6, False)
    fixed = checked("kv_fixed_bytes_per_rank", fact("kv_fixed_bytes_per_rank"), 0, MAX_GIB * GIB, False)
    elsewhere = checked("kv_bytes_per_token_elsewhere", fact("kv_bytes_per_token_elsewhere"), 1, MAX_KV_BYTES, False)
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
        decode_lead_ms=float(lead) if lead is not None else None,
        kv_fixed_bytes=int(round(fixed)) if fixed is not None else 0,
        kv_bytes_per_token_elsewhere=float(elsewhere) if elsewhere is not None else None,
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
