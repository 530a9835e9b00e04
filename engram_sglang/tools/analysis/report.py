"""Figures of `ablate`: bits/token per set and mode, the difference vs Engram on with its
spread over documents (a bootstrap over documents), the printed table, JSON and PNG."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from ...core.errors import EngramError

BOOTSTRAP = 2000
SEED = 0
LN2 = math.log(2)
MODE_ORDER = ("on", "answer-window", "off")  # the plot's bar order: least to most Engram removed


def bits(logprobs: Sequence[float]) -> float:
    """Total bits of a document's scored tokens (-log2 p, summed)."""
    return -float(np.sum(np.asarray(logprobs, dtype=np.float64))) / LN2


def summarize(set_name: str, kind: str, per_mode: dict[str, list[list[float]]]) -> list[dict]:
    """One row per mode: bits/token over all documents (total bits / total tokens), and vs
    mode "on": the difference and its 95% interval and standard error from a bootstrap over
    documents (paired: a resample takes a document in every mode)."""
    on = per_mode["on"]
    tokens = np.array([len(d) for d in on], dtype=np.float64)
    base = np.array([bits(d) for d in on])
    rng = np.random.default_rng(SEED)
    draws = rng.integers(0, len(on), size=(BOOTSTRAP, len(on)))
    rows = []
    for mode, docs in per_mode.items():
        b = np.array([bits(d) for d in docs])
        row = {"set": set_name, "kind": kind, "mode": mode, "docs": len(docs), "tokens": int(tokens.sum()),
               "bits_per_token": float(b.sum() / tokens.sum())}
        if mode != "on":
            diff = b - base
            boot = diff[draws].sum(1) / tokens[draws].sum(1)
            row["diff_vs_on"] = float(diff.sum() / tokens.sum())
            row["diff_ci95"] = [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))]
            row["diff_stderr"] = float(boot.std(ddof=1)) if len(docs) > 1 else float("nan")
            row["docs_worse"] = int((diff > 0).sum())
        rows.append(row)
    return rows


def table(rows: Sequence[dict]) -> str:
    head = f"  {'set':<22} {'mode':<14} {'docs':>5} {'tokens':>8} {'bits/token':>11} {'vs on':>9}  {'95% interval':<22} {'worse':>7}"
    lines = [head]
    for r in rows:
        if "diff_vs_on" in r:
            lo, hi = r["diff_ci95"]
            extra = f"{r['diff_vs_on']:+9.3f}  [{lo:+8.3f}, {hi:+8.3f}]   {r['docs_worse']:>3}/{r['docs']:<3}"
        else:
            extra = ""
        lines.append(f"  {r['set']:<22} {r['mode']:<14} {r['docs']:>5} {r['tokens']:>8} {r['bits_per_token']:>11.3f} {extra}")
    return "\n".join(lines)


def write_json(path: str | os.PathLike, payload: dict) -> Path:
    path = Path(path)
    try:
        path.write_text(json.dumps(payload, indent=2) + "\n")
    except OSError as e:
        raise EngramError(f"{path}: cannot write ({e.strerror})") from None
    return path


def plot(path: str | os.PathLike, rows: Sequence[dict], title: str) -> Path:
    """Two panels: bits/token per set and mode; the difference vs on with its 95% interval."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise EngramError("the PNG needs matplotlib (pip install matplotlib), or leave out --png") from None
    sets = list(dict.fromkeys(r["set"] for r in rows))
    seen = list(dict.fromkeys(r["mode"] for r in rows))
    modes = [m for m in MODE_ORDER if m in seen] + [m for m in seen if m not in MODE_ORDER]
    at = {(r["set"], r["mode"]): r for r in rows}
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = np.arange(len(sets))
    width = 0.8 / max(1, len(modes))
    for i, mode in enumerate(modes):
        vals = [at[(s, mode)]["bits_per_token"] if (s, mode) in at else np.nan for s in sets]
        a.bar(x + i * width, vals, width, label=mode, color=f"C{i}")
    a.set_xticks(x + width * (len(modes) - 1) / 2, sets, rotation=20, ha="right")
    a.set_ylabel("bits / token")
    a.legend(loc="upper left", fontsize=8, framealpha=0.9)
    others = [m for m in modes if m != "on"]
    width = 0.8 / max(1, len(others))
    for i, mode in enumerate(others):
        vals, err = [], [[], []]
        for s in sets:
            r = at.get((s, mode))
            vals.append(r["diff_vs_on"] if r else np.nan)
            err[0].append(r["diff_vs_on"] - r["diff_ci95"][0] if r else 0)
            err[1].append(r["diff_ci95"][1] - r["diff_vs_on"] if r else 0)
        b.bar(x + i * width, vals, width, yerr=err, capsize=3, label=mode, color=f"C{modes.index(mode)}")
    b.axhline(0, color="black", linewidth=0.8)
    b.set_xticks(x + width * (len(others) - 1) / 2, sets, rotation=20, ha="right")
    b.set_ylabel("bits / token vs on (95% interval over documents)")
    b.legend(framealpha=0.9)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    try:
        fig.savefig(path, dpi=100, format="png")  # the name given, no .png appended
    except OSError as e:
        raise EngramError(f"{path}: cannot write the PNG ({e.strerror})") from None
    finally:
        plt.close(fig)
    return path
