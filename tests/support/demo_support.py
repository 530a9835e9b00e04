"""The demo model, built once per test session, its reference forward, and trace parsing."""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from engram_sglang.tools.demo.model import TABLE_DIR_NAME, build_demo_model


@functools.lru_cache(maxsize=1)
def demo_dir() -> Path:
    """The demo model (config, weights, tokenizer, engram_tables/), built on first use."""
    root = Path(tempfile.mkdtemp(prefix="engram-demo-"))
    atexit.register(shutil.rmtree, root, True)
    return build_demo_model(root / "model")


def table_dir() -> Path:
    return demo_dir() / TABLE_DIR_NAME


@functools.lru_cache(maxsize=2)
def reference(engram_scale: float = 1.0):
    from engram_sglang.models.reference import ReferenceModel

    return ReferenceModel(demo_dir(), table_dir(), engram_scale=engram_scale)


@functools.lru_cache(maxsize=256)
def reference_completion(prompt_ids: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    new, _ = reference().generate(list(prompt_ids), max_new_tokens)
    return tuple(new)


def trace_requests(path: Path, lines: Optional[int] = None) -> list[dict]:
    """Group a trace (its first `lines` steps, default all) into requests: a slot's tokens
    continue its current request while their positions follow on (prefill chunks, decode
    steps); any other position (a new request in the slot, possibly starting after a
    prefix-cache hit) starts a new one."""
    requests: list[dict] = []
    current: dict[int, dict] = {}
    for line in Path(path).read_text().splitlines()[:lines]:
        step = json.loads(line)
        for t, (slot, pos, tok) in enumerate(zip(step["req"], step["pos"], step["tok"])):
            if slot not in current or current[slot]["pos"][-1] + 1 != pos:
                current[slot] = {"tok": [], "pos": [], "ids": {}, "sum": {}}
                requests.append(current[slot])
            r = current[slot]
            r["tok"].append(tok)
            r["pos"].append(pos)
            for layer, ids in step["ids"].items():
                r["ids"].setdefault(layer, []).append(ids[t])
            for layer, sums in step["sum"].items():
                r["sum"].setdefault(layer, []).append(sums[t])
    return requests
