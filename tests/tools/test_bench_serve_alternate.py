"""bench/serve.py --alternate, without servers: the runs go in turns (disk, host, disk, ...),
each pair's ratio is its disk run over its host run, the median is over the pairs, the load
of each run is kept, and a pair whose completions differ fails the run."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import serve


def fake_run(speeds: dict, order: list, tokens: dict):
    def run_placement(model_dir, placement, passes, args):
        k = sum(1 for p in order if p == placement)
        order.append(placement)
        tps = speeds[placement][k]
        return {"placement": placement, "output_tokens_per_s": tps, "load": [0.5 + k, 0.6 + k],
                "forward_ms_per_step": 1000 / tps, "engram_ms_per_step": 1.0, "wait_ms_per_step": 0.1,
                "gather_ms_per_step": 0.5, "completions": tokens[placement][k]}
    return run_placement


@pytest.fixture
def out(tmp_path, monkeypatch):
    monkeypatch.setattr(serve, "OUT", tmp_path)
    monkeypatch.setattr(serve, "gather_profile", lambda model_dir, names: [])
    monkeypatch.setattr(serve, "plot_alternate", lambda *a: None)
    monkeypatch.setattr("bench.common.OUT", tmp_path)
    return tmp_path


def args(n=3):
    return SimpleNamespace(alternate=n, placements="disk,host", requests=4, new_tokens=8, concurrency=2, passes=1,
                           engram="")


def test_turns_ratios_and_median(out, capsys, monkeypatch):
    order = []
    speeds = {"disk": [90.0, 50.0, 80.0], "host": [100.0, 100.0, 100.0]}
    monkeypatch.setattr(serve, "run_placement", fake_run(speeds, order, {p: [[[1, 2]]] * 3 for p in speeds}))
    assert serve.alternate(Path("m"), [[]], args()) == 0
    assert order == ["disk", "host"] * 3
    written = json.loads((out / "serve-alternate.json").read_text())
    assert [round(p["ratio"], 3) for p in written["pairs"]] == [0.9, 0.5, 0.8]
    assert written["median_ratio"] == pytest.approx(0.8)
    assert [r["load"] for r in written["pairs"][1]["runs"]] == [[1.5, 1.6], [1.5, 1.6]]
    assert "median disk/host tokens/s ratio over 3 pairs: 0.800" in capsys.readouterr().out


def test_a_pair_with_other_tokens_fails(out, monkeypatch):
    order = []
    speeds = {"disk": [90.0, 90.0], "host": [100.0, 100.0]}
    tokens = {"disk": [[[1, 2]], [[1, 3]]], "host": [[[1, 2]], [[1, 2]]]}
    monkeypatch.setattr(serve, "run_placement", fake_run(speeds, order, tokens))
    assert serve.alternate(Path("m"), [[]], args(2)) == 1
    written = json.loads((out / "serve-alternate.json").read_text())
    assert [p["same_tokens"] for p in written["pairs"]] == [True, False]


def test_two_placements_only(out):
    with pytest.raises(SystemExit, match="compares two placements"):
        serve.alternate(Path("m"), [[]], SimpleNamespace(**{**vars(args()), "placements": "disk,host,device"}))
