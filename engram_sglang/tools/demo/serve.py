"""The demo's serving part: one real SGLang server per placement plus one with Engram off.

Every server gets the same prompts all at once (one batch), after a short warm-up request.
Per server it measures output tokens/s (wall clock of the batch, with the load average
beside it: the machine may be shared) and, from the runtime's statistics in /server_info
(differences over the batch), per forward step: the Engram layers' time (gate, projections,
conv, waiting for rows), the wait for rows, the stores' gather time, and one decoder layer.

Engram off is a copy of the demo model whose Engram layers' value projection is zero: each
Engram layer then adds exactly 0 to the residual stream (value 0, its norm 0, conv of 0 is
0), which is the reference forward's `engram_scale=0`. The same serving code runs (rows
are still read), so the completions differ only by what the Engram rows contribute.
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

OFF = "Engram off"
STARTS_AT_ONCE = 2  # server start-up is single-threaded Python: two at a time fill two cores


@dataclass
class Served:
    name: str  # a placement, or OFF
    placement: str
    completions: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0
    tokens: int = 0
    load: float = 0.0  # 1-minute load average right after the batch
    per_step: dict = field(default_factory=dict)  # ms per forward step; "layer": one decoder layer

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def engram_off_model(model_dir: Path, out_dir: Path) -> Path:
    """The demo model with every Engram layer's value_proj zeroed (written fresh each run: a
    few MB), config and tokenizer copied; it reads the demo model's tables."""
    from safetensors.torch import load_file, save_file

    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.is_file() and (f.suffix in (".json", ".txt") or f.name.startswith("tokenizer")):
            shutil.copy2(f, out_dir / f.name)
    weights = load_file(str(model_dir / "model.safetensors"))
    zeroed = [k for k in weights if k.endswith(".engram.value_proj.weight")]
    for k in zeroed:
        weights[k] = weights[k].new_zeros(weights[k].shape)
    if not zeroed:
        raise RuntimeError(f"{model_dir}/model.safetensors: no Engram value_proj to zero (not the demo model?)")
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def _totals(stats: dict) -> dict:
    steps = stats["steps"]
    return {"steps": steps, "engram": stats["engram_seconds_per_step"] * steps,
            "wait": stats["wait_seconds_per_step"] * steps, "forward": stats["forward_seconds_per_step"] * steps,
            "gather": sum(t["gather_seconds"] for t in stats["tables"])}


def _measure(server, run: Served, prompts: Sequence[list[int]], new_tokens: int) -> Served:
    server.generate(prompts[0], 4)  # warm-up: first-request set-up stays out of the figures
    before = _totals(server.engram_stats())
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: server.generate(p, new_tokens), prompts))
    run.seconds = time.perf_counter() - t0
    run.load = os.getloadavg()[0]
    stats = server.engram_stats()
    after = _totals(stats)
    steps = max(after["steps"] - before["steps"], 1)
    run.per_step = {k: 1e3 * (after[k] - before[k]) / steps for k in ("forward", "engram", "wait", "gather")}
    run.per_step["layer"] = 1e3 * stats["layer_seconds"]
    run.per_step["steps"] = steps
    run.completions = [o["output_ids"] for o in outs]
    run.tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return run


def serve_all(model_dir: Path, off_dir: Path, placements: Sequence[str], prompts: Sequence[list[int]],
              new_tokens: int, workdir: Path) -> list[Served]:
    """Start a server per placement and one with Engram off (device placement), two starts
    at a time; then measure them one by one (the idle ones sleep), stopping each after."""
    from ...serving.launch import Server
    from .model import TABLE_DIR_NAME

    common = {"max_total_tokens": 4096, "args": ("--max-running-requests", str(len(prompts)))}
    runs = [Served(p, p) for p in placements] + [Served(OFF, "device")]
    servers = [Server(model_dir, engram={"placement": p}, log_path=workdir / f"sglang-{p}.log", **common)
               for p in placements]
    servers.append(Server(off_dir, engram={"placement": "device", "table_dir": model_dir / TABLE_DIR_NAME},
                          log_path=workdir / "sglang-engram-off.log", **common))
    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(STARTS_AT_ONCE) as pool:
            list(pool.map(lambda s: s.start(), servers))
        print(f"  {len(servers)} servers ready in {time.perf_counter() - t0:.1f} s ({STARTS_AT_ONCE} starts at a time; "
              f"logs: {workdir}/sglang-*.log)")
        for server, run in zip(servers, runs):
            _measure(server, run, prompts, new_tokens)
            server.stop()
    finally:
        for server in servers:
            server.stop()
    return runs


def print_costs(runs: Sequence[Served], n_prompts: int, new_tokens: int) -> None:
    cores = os.cpu_count() or 1
    print(f"\n{n_prompts} prompts served at once, {new_tokens} new tokens each "
          f"(per forward step, from /server_info; load average beside: {cores} cores here):")
    head = ("", "tokens/s", "step ms", "Engram ms", "rows wait ms", "gather ms", "1 layer ms", "load")
    print("  " + "".join(f"{h:>13}" for h in head))
    for r in runs:
        s = r.per_step
        name = r.name if r.name != OFF else f"off ({r.placement})"
        cells = (name, f"{r.tokens_per_s:.0f}", f"{s['forward']:.1f}", f"{s['engram']:.2f}", f"{s['wait']:.3f}",
                 f"{s['gather']:.2f}", f"{s['layer']:.2f}", f"{r.load:.1f}")
        print("  " + "".join(f"{c:>13}" for c in cells))
    busy = max(r.load for r in runs)
    if busy > cores * 0.75:
        print(f"  the machine was busy (load average up to {busy:.1f} on {cores} cores): the figures are slower than "
              f"on a quiet machine")
    print("  Engram ms: both Engram layers of a step (gate, projections, conv and the wait for rows); gather ms: the "
          "stores' reads and decoding (on a worker thread, overlapping the layers before); 1 layer: one decoder layer")
