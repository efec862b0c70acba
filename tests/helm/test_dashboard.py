"""The Grafana dashboard (helm/tandem/files/dashboards/tandem.json).

Checked for what Grafana's dashboard importer and its sidecar need: a title,
a uid, a schemaVersion, templating variables, and panels of a known type,
each with a grid position and Prometheus targets (expr, refId, datasource).
Every PromQL expression is parsed by a real
PromQL parser (promql-parser, the Rust parser's Python binding) and every
metric it reads must be one Tandem's components really export — the router's
registry, vLLM's metric definitions, the Mooncake master's metrics, the
chart's kube-state-metrics config — with `rate()` only over counters.
"""

from __future__ import annotations

import importlib.util
import json
import re
from functools import lru_cache
from pathlib import Path

import promql_parser
import pytest
import yaml

from operators.spec import crd_schema
from services.kvstore.metrics import TRANSLATIONS
from services.router.metrics import RouterMetrics
from tests.helm.chart import CHART_DIR, one, render

DASHBOARD = json.loads((CHART_DIR / "files" / "dashboards" / "tandem.json").read_text())
KSM_CONFIG = yaml.safe_load(
    (CHART_DIR / "files" / "kube-state-metrics" / "enginepools.yaml").read_text()
)
COUNTER, GAUGE = "counter", "gauge"
# The panel plugins built into Grafana that this dashboard uses.
PANEL_TYPES = {"timeseries", "stat"}
# The schemaVersion range of the Grafana releases the dashboard is written for (10.x-12.x).
SCHEMA_VERSIONS = range(36, 42)
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


@lru_cache(maxsize=1)
def exported_metrics() -> dict[str, str]:
    """Sample name → counter or gauge, for every metric the dashboard may read."""
    out: dict[str, str] = {}
    for family in RouterMetrics().registry.collect():
        for suffix, kind in {
            "counter": [("_total", COUNTER)],
            "histogram": [("_bucket", COUNTER), ("_sum", COUNTER), ("_count", COUNTER)],
            "gauge": [("", GAUGE)],
        }[family.type]:
            out[family.name + suffix] = kind
    # vLLM's metric definitions, read from its source (importing vLLM takes seconds).
    vllm = importlib.util.find_spec("vllm")
    assert vllm is not None and vllm.origin, "vLLM is not installed"
    source = (Path(vllm.origin).parent / "v1" / "metrics" / "loggers.py").read_text()
    for cls, name in re.findall(
        r'self\._(counter|histogram|gauge)_cls\(\s*name="(vllm:[^"]+)"', source
    ):
        if cls == "counter":
            out[name + "_total"] = COUNTER
        elif cls == "histogram":
            out.update({name + s: COUNTER for s in ("_bucket", "_sum", "_count")})
        else:
            out[name] = GAUGE
    for row in TRANSLATIONS:  # the Mooncake master's own names (its metrics port)
        out[row.source] = COUNTER if row.kind == "counter" else GAUGE
    for resource in KSM_CONFIG["spec"]["resources"]:
        for metric in resource["metrics"]:
            out[f"{resource['metricNamePrefix']}_{metric['name']}"] = GAUGE
    return out


def expressions() -> list[tuple[str, str]]:
    return [
        (panel["title"], target["expr"])
        for panel in DASHBOARD["panels"]
        for target in panel["targets"]
    ]


def parse(expr: str):
    """Grafana substitutes its variables before Prometheus sees a query; so do we."""
    concrete = expr.replace("$__rate_interval", "5m")
    concrete = re.sub(r"\$\{?(\w+)\}?", "x", concrete)
    return promql_parser.parse(concrete)


def selectors(node, in_rate: bool = False):
    """(metric name, inside rate/increase) for every selector in a parsed expression."""
    if isinstance(node, promql_parser.VectorSelector):
        yield node.name, in_rate
    elif isinstance(node, promql_parser.MatrixSelector):
        yield from selectors(node.vector_selector, in_rate)
    elif isinstance(node, promql_parser.Call):
        counting = node.func.name in ("rate", "irate", "increase")
        for arg in node.args:
            yield from selectors(arg, in_rate or counting)
    elif isinstance(node, promql_parser.BinaryExpr):
        yield from selectors(node.lhs, in_rate)
        yield from selectors(node.rhs, in_rate)
    elif isinstance(
        node,
        (
            promql_parser.AggregateExpr,
            promql_parser.ParenExpr,
            promql_parser.UnaryExpr,
            promql_parser.SubqueryExpr,
        ),
    ):
        yield from selectors(node.expr, in_rate)


def test_dashboard_has_what_grafanas_importer_needs():
    assert isinstance(DASHBOARD["title"], str) and DASHBOARD["title"]
    # Grafana's uid: at most 40 characters of letters, digits, '-' and '_'.
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,40}", DASHBOARD["uid"]), DASHBOARD["uid"]
    assert DASHBOARD["schemaVersion"] in SCHEMA_VERSIONS
    assert "id" not in DASHBOARD or DASHBOARD["id"] is None  # set by the Grafana it lands in
    assert isinstance(DASHBOARD["panels"], list) and DASHBOARD["panels"]
    variables = DASHBOARD["templating"]["list"]
    assert len({v["name"] for v in variables}) == len(variables)
    for variable in variables:
        assert variable["type"] in ("datasource", "query", "custom", "constant", "interval")
        if variable["type"] == "query":
            assert variable["datasource"] == DATASOURCE, variable["name"]
            assert variable["query"], variable["name"]


@pytest.mark.parametrize("panel", DASHBOARD["panels"], ids=lambda p: p["title"])
def test_each_panel_has_a_type_a_place_and_prometheus_targets(panel):
    assert panel["type"] in PANEL_TYPES
    assert isinstance(panel["title"], str) and panel["title"]
    assert isinstance(panel["id"], int)
    grid = panel["gridPos"]
    assert set(grid) == {"x", "y", "w", "h"}
    assert all(isinstance(grid[k], int) and grid[k] >= 0 for k in grid)
    assert grid["w"] >= 1 and grid["h"] >= 1
    assert isinstance(panel.get("options", {}), dict)
    assert isinstance(panel.get("fieldConfig", {}).get("defaults", {}), dict)
    assert panel["targets"], f"{panel['title']} has no query"
    ref_ids = [t["refId"] for t in panel["targets"]]
    assert len(ref_ids) == len(set(ref_ids))
    for target in panel["targets"]:
        assert isinstance(target["expr"], str) and target["expr"].strip()
        assert target["datasource"] == panel["datasource"] == DATASOURCE


def test_panels_have_unique_ids_and_do_not_overlap():
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in DASHBOARD["panels"]:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine


def test_variables_the_queries_use_are_defined():
    defined = {v["name"] for v in DASHBOARD["templating"]["list"]}
    used = {m for _, e in expressions() for m in re.findall(r"\$\{?(\w+)\}?", e)}
    assert used - {"__rate_interval"} <= defined


@pytest.mark.parametrize("title,expr", expressions())
def test_every_query_parses_and_reads_exported_metrics(title, expr):
    known = exported_metrics()
    found = list(selectors(parse(expr)))
    assert found, f"{title}: no metric in {expr}"
    for name, in_rate in found:
        assert name in known, f"{title}: {name} is exported by no Tandem component"
        expected = COUNTER if in_rate else GAUGE
        assert known[name] == expected, f"{title}: {name} is a {known[name]} used as a {expected}"


def test_parser_refuses_a_broken_query():
    with pytest.raises(ValueError):
        parse('sum(rate(tandem_router_requests_total{namespace="$namespace"}[5m])')


def test_the_dashboard_shows_what_an_operator_of_tandem_watches():
    read = {name for _, e in expressions() for name, _ in selectors(parse(e))}
    wanted = {
        "TTFT": "tandem_router_ttft_seconds_bucket",
        "interactivity (ITL)": "vllm:inter_token_latency_seconds_bucket",
        "prefix hit rate": "vllm:prefix_cache_hits_total",
        "pool sizes": "tandem_enginepool_spec_replicas",
        "the controller's recommendation": "tandem_enginepool_recommended_replicas",
        "KV store RAM tier": "master_allocated_bytes",
        "KV store disk tier": "file_cache_nums_",
        "router overhead": "tandem_router_overhead_seconds_bucket",
        "429s": "tandem_router_requests_rejected_total",
    }
    assert {what for what, metric in wanted.items() if metric not in read} == set()


def test_kube_state_metrics_config_reads_enginepool_fields_that_exist():
    schema = crd_schema("enginepools")
    for resource in KSM_CONFIG["spec"]["resources"]:
        gvk = resource["groupVersionKind"]
        assert (gvk["group"], gvk["version"], gvk["kind"]) == (
            "tandem.dev",
            "v1alpha1",
            "EnginePool",
        )
        paths = list(resource["labelsFromPath"].values())
        paths += [m["each"]["gauge"]["path"] for m in resource["metrics"]]
        for path in paths:
            if path[0] == "metadata":
                continue
            node = schema
            for part in path:
                node = node["properties"][part]
            assert node["type"] in ("integer", "string"), path


def test_chart_ships_the_dashboard_unchanged_with_grafanas_sidecar_label():
    docs = render({"monitoring": {"grafanaDashboard": {"enabled": True}}})
    config_map = one(docs, "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["tandem.json"]) == DASHBOARD
