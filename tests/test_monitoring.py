"""The Grafana dashboard and the Prometheus alert rules (configs/monitoring/) against the
metrics the code defines: a panel for every engram_* series, every name an alert or a panel
uses exists, each alert has its threshold and its runbook line in docs/operations.md, and
`promtool` accepts the rules and fires each tested alert at its threshold, not below it."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "configs" / "monitoring" / "grafana-engram.json"
ALERTS = ROOT / "configs" / "monitoring" / "engram-alerts.yml"
GUIDE = ROOT / "docs" / "operations.md"
NAME = re.compile(r"\bengram_[a-z_]+\b")
# Sample names by kind, as prometheus_client exposes them.
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
COLLECTORS = {"Counter": "counter", "Gauge": "gauge", "Histogram": "histogram", "Summary": "summary",
              "Info": "info", "Enum": "stateset"}


def defined_in_source() -> dict[str, str]:
    """engram_* collector name -> kind, from every Counter/Gauge/Histogram/... call in the package
    (and the stores' local `gauge(...)` helper), read from the source."""
    found = {}
    for path in sorted((ROOT / "engram_sglang").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
                continue
            name = node.args[0].value
            func = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            if isinstance(name, str) and name.startswith("engram_") and func in (*COLLECTORS, "gauge"):
                found[name] = COLLECTORS.get(func, "gauge")
    return found


@pytest.fixture(scope="module")
def metrics() -> dict[str, str]:
    """engram_* family -> kind, from the collectors the stores and the runtime create; the same
    set the source defines (a collector made some other way would be missed by both checks)."""
    from prometheus_client.metrics import MetricWrapperBase

    from engram_sglang.core.stores.cache_metrics import CACHE_METRICS
    from engram_sglang.core.stores.metrics import METRICS

    made = {}
    for holder in (METRICS.get(), CACHE_METRICS.get()):
        for collector in vars(holder).values():
            if isinstance(collector, MetricWrapperBase):
                made[collector._name] = collector._type
    assert made == defined_in_source()
    return made


def sample_names(metrics: dict[str, str]) -> dict[str, str]:
    """Every sample name a query may use -> its family."""
    return {family + suffix: family for family, kind in metrics.items() for suffix in SUFFIXES[kind]}


def dashboard_exprs() -> list[str]:
    def walk(panels):
        for p in panels:
            yield from (t["expr"] for t in p.get("targets", []))
            yield from walk(p.get("panels", []))

    return list(walk(json.loads(DASHBOARD.read_text())["panels"]))


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def names_used(exprs) -> set[str]:
    return {m for e in exprs for m in NAME.findall(e)}


def test_every_metric_has_a_panel_and_every_panel_names_a_metric(metrics):
    exprs = dashboard_exprs()
    samples = sample_names(metrics)
    assert names_used(exprs) <= set(samples), f"panels query names no collector has: {names_used(exprs) - set(samples)}"
    shown = {samples[n] for n in names_used(exprs)}
    assert shown == set(metrics), f"engram_* series without a panel: {sorted(set(metrics) - shown)}"


def test_every_alert_names_existing_metrics_and_has_a_threshold_and_runbook(metrics):
    rules = alert_rules()
    assert rules
    guide = GUIDE.read_text()
    runbook = guide[guide.index("### Alerts"):]
    samples = sample_names(metrics)
    for rule in rules:
        used = names_used([rule["expr"]])
        assert used and used <= set(samples), (rule["alert"], used - set(samples))
        assert re.search(r"[<>]=?\s*[0-9.]+\s*$", rule["expr"].strip()), f"{rule['alert']}: no threshold compared"
        assert rule["labels"]["severity"] in ("warning", "critical"), rule
        assert rule["annotations"]["threshold"] and rule["annotations"]["summary"], rule
        assert rule["annotations"]["runbook_url"] == "docs/operations.md#alerts", rule
        assert re.search(rf"^\| `{rule['alert']}`", runbook, re.M), f"{rule['alert']}: no runbook line in {GUIDE.name}"


def test_the_guide_lists_every_metric(metrics):
    guide = GUIDE.read_text()
    table = guide[guide.index("**Prometheus**"):guide.index("**Statistics.**")]
    missing = [m for m in metrics if f"`{m}`" not in table]
    assert not missing, f"docs/operations.md's metrics table lacks {missing}"


def test_a_typo_in_a_panel_is_caught(metrics):
    samples = sample_names(metrics)
    assert "engram_rows_served_total" in samples and "engram_rows_served" not in samples  # a counter needs _total
    assert not names_used(["rate(engram_rows_servd_total[5m])"]) <= set(samples)


PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package prometheus; "
                                                             "scripts/setup.sh installs it as root)")

RANK = 'job="sglang", instance="n1:30000", tp_rank="0", dp_rank="1", pp_rank="0"'
# (alert, input series, minutes to evaluate at, fires): just over and just under each threshold.
CASES = [
    ("EngramReadFaults", [(f'engram_read_faults_total{{placement="disk", {RANK}}}', "0 0 0 1 1 1 1")], 5, True),
    ("EngramReadFaults", [(f'engram_read_faults_total{{placement="disk", {RANK}}}', "0+0x10")], 5, False),
    ("EngramMixedTables", [(f'engram_build_info{{{RANK}, version="0.1.0", table_identity="a", table_fingerprint="f", '
                            f'placement="disk"}}', "1+0x30"),
                           ('engram_build_info{job="sglang", instance="n2:30000", tp_rank="0", dp_rank="0", '
                            'pp_rank="0", version="0.1.0", table_identity="b", table_fingerprint="f", '
                            'placement="disk"}', "1+0x30")], 20, True),
    ("EngramDramCacheHitRateLow", [(f'engram_dram_cache_lookups_total{{layer="3", placement="disk", {RANK}}}',
                                    "0+100x80"),
                                   (f'engram_dram_cache_hits_total{{layer="3", placement="disk", {RANK}}}',
                                    "0+40x80")], 60, True),
    ("EngramDramCacheHitRateLow", [(f'engram_dram_cache_lookups_total{{layer="3", placement="disk", {RANK}}}',
                                    "0+100x80"),
                                   (f'engram_dram_cache_hits_total{{layer="3", placement="disk", {RANK}}}',
                                    "0+60x80")], 60, False),
]


@needs_promtool
def test_promtool_accepts_the_rules():
    out = subprocess.run([PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in out.stdout, out.stdout


@needs_promtool
def test_promtool_parses_every_panel_query(tmp_path):
    """The dashboard's queries, its variables filled in, as recording rules: promtool parses
    each one's PromQL."""
    filled = [e.replace("$__rate_interval", "5m").replace('=~"$', '=~"x') for e in dashboard_exprs()]
    assert not any("$" in e for e in filled), [e for e in filled if "$" in e]
    rules = tmp_path / "panels.yml"
    rules.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": [
        {"record": f"engram:panel_{i}", "expr": e} for i, e in enumerate(filled)]}]}))
    out = subprocess.run([PROMTOOL, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
@pytest.mark.parametrize("alert, series, at, fires", CASES, ids=[f"{c[0]}-{'fires' if c[3] else 'quiet'}" for c in CASES])
def test_promtool_fires_the_alert_at_its_threshold(tmp_path, alert, series, at, fires):
    rule = next(r for r in alert_rules() if r["alert"] == alert)
    expected = []
    if fires:
        by = re.search(r"(?:count|sum) by \(([^)]*)\)", rule["expr"]).group(1).split(", ")
        labels = {k: v for s, _ in series for k, v in re.findall(r'(\w+)="([^"]*)"', s) if k in by}
        expected = [{"exp_labels": {**labels, "severity": rule["labels"]["severity"]}}]
    # The rules as they are but without annotations: promtool compares those too, and their
    # templates are the operator's text, not what is tested here.
    rules = tmp_path / "rules.yml"
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    for g in groups:
        for r in g["rules"]:
            r.pop("annotations", None)
    rules.write_text(yaml.safe_dump({"groups": groups}))
    test = {"rule_files": [str(rules)], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": [{"series": s, "values": v} for s, v in series],
                       "alert_rule_test": [{"eval_time": f"{at}m", "alertname": alert, "exp_alerts": expected}]}]}
    path = tmp_path / "test.yml"
    path.write_text(yaml.safe_dump(test))
    out = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
