"""Grafana dashboard, Prometheus alerts and the adapter rules behind the HPAs: they parse,
and every metric and label they query is one the tiers really export (read from
prometheus_client's registry after importing every tier's metrics module)."""

from __future__ import annotations

import importlib
import json
import pkgutil
import re
from functools import cache
from pathlib import Path
from typing import Any

import prometheus_client
import pytest
import yaml

from tests.deploy.conftest import REPO, by_kind

DASHBOARD = REPO / "deploy" / "grafana" / "llmesh.json"
ALERTS = REPO / "deploy" / "prometheus" / "llmesh-alerts.yaml"
ADAPTER = REPO / "deploy" / "prometheus" / "adapter-rules.yaml"
SCRAPE = REPO / "deploy" / "prometheus" / "scrape-config.yaml"

PROMQL_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
    "offset", "inf", "nan",
}  # fmt: skip


def metrics_modules() -> list[str]:
    """Every tier's metrics module that exists (tiers land independently)."""
    import services

    names = ["services.common.metrics"]
    for info in pkgutil.iter_modules(services.__path__):
        if info.ispkg and (Path(services.__path__[0]) / info.name / "metrics.py").is_file():
            names.append(f"services.{info.name}.metrics")
    if (REPO / "gateway" / "metrics.py").is_file():
        names.append("gateway.metrics")
    return names


@cache
def exported() -> dict[str, set[str]]:
    """Sample name -> label names, for every llmesh_ metric the tiers define."""
    for name in metrics_modules():
        importlib.import_module(name)
    registry = prometheus_client.REGISTRY
    found: dict[str, set[str]] = {}
    for collector in list(registry._collector_to_names):  # the tiers' collectors, by object
        labels = set(getattr(collector, "_labelnames", ()))
        for family in collector.describe() if hasattr(collector, "describe") else []:
            if not family.name.startswith("llmesh_"):
                continue
            suffixes = {
                "counter": ["_total"],
                "histogram": ["_bucket", "_sum", "_count"],
                "summary": ["", "_sum", "_count"],
                "gauge": [""],
                "info": ["_info"],
            }.get(family.type, [""])
            for suffix in suffixes:
                found[family.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    # Prometheus's own per-target series, labelled by the scrape config.
    found["up"] = set()
    return found


@cache
def scrape_labels() -> set[str]:
    """Labels Prometheus attaches to every llmesh series (target labels and relabelling)."""
    config = yaml.safe_load(SCRAPE.read_text())
    added = {
        r["target_label"]
        for job in config["scrape_configs"]
        for r in job["relabel_configs"]
        if "target_label" in r
    }
    return added | {"job", "instance"}


def normalise(expr: str) -> str:
    """Grafana variables replaced by values PromQL accepts."""
    return expr.replace("$__rate_interval", "5m").replace("$namespace", ".*")


def selectors(expr: str) -> list[tuple[str, list[str]]]:
    """(metric name, label names in its matchers) for every vector selector."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', normalise(expr))  # strings cannot hide names
    text = re.sub(r"\[[^\]]*\]", "", text)
    for word in ("by", "without", "on", "ignoring", "group_left", "group_right"):
        text = re.sub(rf"\b{word}\s*\([^)]*\)", " ", text)
    found = []
    for match in re.finditer(r"([A-Za-z_:][\w:]*)\s*(\{[^}]*\})?(\s*\()?", text):
        name, braces, call = match.group(1), match.group(2), match.group(3)
        if call or name.lower() in PROMQL_KEYWORDS or re.fullmatch(r"\d+\w*", name):
            continue
        labels = re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", braces or "")
        found.append((name, labels))
    return found


def grouping_labels(expr: str) -> list[str]:
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    labels: list[str] = []
    for group in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", text):
        labels += [label.strip() for label in group.split(",") if label.strip()]
    return labels


AGGREGATIONS = r"\b(?:sum|min|max|avg|count|group|stddev|stdvar|topk|bottomk|quantile|count_values)\b"


def result_labels(expr: str) -> set[str]:
    """Labels the expression's result keeps: its `by (...)` labels once it aggregates,
    otherwise every label of its metrics."""
    if re.search(AGGREGATIONS + r"\s*(?:by\s*\([^)]*\)\s*)?\(", expr):
        return set(grouping_labels(expr))
    labels = set(scrape_labels())
    for name, _ in selectors(expr):
        labels |= exported().get(name, set())
    return labels


def check_expression(expr: str, where: str) -> None:
    """Every metric exists, every label it matches or groups by exists on it, and (when
    promql-parser is installed) the expression is valid PromQL."""
    metrics = exported()
    names = selectors(expr)
    assert names, f"{where}: no metric in {expr!r}"
    available: set[str] = set(scrape_labels())
    for name, labels in names:
        assert name in metrics, f"{where}: metric {name} is not exported by any tier"
        known = metrics[name] | scrape_labels()
        for label in labels:
            assert label in known, f"{where}: {name} has no label {label!r}"
        available |= metrics[name]
    for label in grouping_labels(expr):
        assert label in available, f"{where}: groups by {label!r}, which none of its metrics has"
    depth: list[str] = []
    for char in re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr):
        if char in "({[":
            depth.append(char)
        elif char in ")}]":
            assert depth and "({[".index(depth.pop()) == ")}]".index(char), f"{where}: unbalanced {expr!r}"
    assert not depth, f"{where}: unbalanced {expr!r}"
    try:
        import promql_parser  # optional: full PromQL syntax check
    except ImportError:
        return
    try:
        promql_parser.parse(normalise(expr))
    except (ValueError, TypeError) as err:
        pytest.fail(f"{where}: invalid PromQL {expr!r}: {err}")


def test_metrics_modules_are_found() -> None:
    metrics = exported()
    assert "llmesh_rpc_requests_total" in metrics and "llmesh_rpc_duration_seconds_bucket" in metrics
    assert {"tier", "method", "code"} <= metrics["llmesh_rpc_requests_total"]


def test_selector_extraction() -> None:
    expr = (
        'sum by (zone) (rate(llmesh_a_total{tier="x",code=~"A|B"}[5m])) '
        "/ ignoring(code) group_left sum(llmesh_b) > bool 0"
    )
    assert selectors(expr) == [("llmesh_a_total", ["tier", "code"]), ("llmesh_b", [])]
    assert grouping_labels(expr) == ["zone", "code"]
    assert result_labels(expr) == {"zone", "code"}
    assert "tier" in result_labels('rate(llmesh_rpc_requests_total{tier="x"}[5m]) > 0')


# ---------------------------------------------------------------------------- dashboard


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def test_dashboard_shape(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] and dashboard["title"] == "llmesh"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "namespace"} <= variables
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        area = {(grid["x"] + dx, grid["y"] + dy) for dx in range(grid["w"]) for dy in range(grid["h"])}
        assert not area & cells, f"panel {panel['title']!r} overlaps another"
        cells |= area
    for panel in panels(dashboard):
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"], panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])


def test_dashboard_covers_what_operators_need(dashboard: dict[str, Any]) -> None:
    titles = " | ".join(p["title"] for p in panels(dashboard))
    exprs = " ".join(t["expr"] for p in panels(dashboard) for t in p["targets"])
    for needed in ("QPS", "P50", "P99", "TTFT", "Tokens per second", "Healthy workers per zone", "Failovers"):
        assert needed in titles, needed
    assert "llmesh_router_worker_healthy" in exprs and "llmesh_router_failovers_total" in exprs
    assert "histogram_quantile(0.99" in exprs and "histogram_quantile(0.5" in exprs


def test_dashboard_queries_exported_metrics(dashboard: dict[str, Any]) -> None:
    for panel in panels(dashboard):
        for target in panel["targets"]:
            check_expression(target["expr"], f"panel {panel['title']!r}")
            assert 'namespace=~"$namespace"' in target["expr"], panel["title"]
            for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")):
                assert label in result_labels(target["expr"]), f"{panel['title']}: legend {{{{{label}}}}}"
    for variable in dashboard["templating"]["list"]:
        for metric in re.findall(r"label_values\((\w+)", json.dumps(variable.get("query", ""))):
            assert metric in exported()


# ---------------------------------------------------------------------------- alerts


@pytest.fixture(scope="module")
def rules() -> list[dict[str, Any]]:
    config = yaml.safe_load(ALERTS.read_text())
    assert set(config) == {"groups"}
    return [rule for group in config["groups"] for rule in group["rules"]]


def test_alert_rules_are_well_formed(rules: list[dict[str, Any]]) -> None:
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}
        assert re.fullmatch(r"\d+[smh]", rule["for"])
        assert rule["labels"]["severity"] in ("critical", "warning")
        assert rule["annotations"]["summary"]
        check_expression(rule["expr"], rule["alert"])
        used = re.findall(r"\$labels\.(\w+)", json.dumps(rule["annotations"]))
        for label in used:
            assert label in result_labels(rule["expr"]), (
                f"{rule['alert']}: $labels.{label} is aggregated away"
            )


def test_required_alerts_exist(rules: list[dict[str, Any]]) -> None:
    by_name = {r["alert"]: r["expr"] for r in rules}
    assert "llmesh_router_worker_healthy" in by_name["LlmeshZoneNoHealthyWorker"]
    assert "by (zone)" in by_name["LlmeshZoneNoHealthyWorker"]
    assert "histogram_quantile(0.99" in by_name["LlmeshHighP99Latency"]
    assert "code=~" in by_name["LlmeshHighErrorRate"] and "/" in by_name["LlmeshHighErrorRate"]


# ---------------------------------------------------------------------------- autoscaling


def test_every_hpa_custom_metric_is_served_by_an_adapter_rule(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    adapter = yaml.safe_load(ADAPTER.read_text())["rules"]
    served = {}
    for rule in adapter:
        check_expression(rule["seriesQuery"], f"adapter rule {rule['name']['as']}")
        series = selectors(rule["seriesQuery"])[0][0]
        assert re.fullmatch(rule["name"]["matches"], series)
        served[rule["name"]["as"]] = rule
        query = rule["metricsQuery"].replace("<<.Series>>", series).replace("<<.LabelMatchers>>,", "")
        query = query.replace("<<.LabelMatchers>>", "").replace("<<.GroupBy>>", "pod")
        check_expression(query, f"adapter metricsQuery {rule['name']['as']}")
    wanted = {
        m["pods"]["metric"]["name"]
        for objects in rendered.values()
        for hpa in by_kind(objects, "HorizontalPodAutoscaler")
        for m in hpa["spec"]["metrics"]
        if m["type"] == "Pods"
    }
    assert wanted == {"llmesh_gateway_requests_per_second", "llmesh_worker_engine_waiting"}
    assert wanted <= set(served)
