"""The hand-written schemas of other projects' kinds (foreign_schemas.py) refuse what their
API servers would: a misspelt field is dropped (reported), a wrong value is refused.
"""

from __future__ import annotations

import copy

import pytest

from tests.helm.cases import CASES
from tests.helm.chart import by_kind, foreign_crds, one, problems, render


def _set(obj: dict, path: str, value: object) -> dict:
    """A copy of obj with the dotted path (list indices as numbers) set to value."""
    out = copy.deepcopy(obj)
    *parents, last = path.split(".")
    node: object = out
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]  # type: ignore[index]
    node[int(last) if isinstance(node, list) else last] = value  # type: ignore[index]
    return out


def test_the_chart_renders_every_foreign_kind_and_each_is_valid():
    docs = render(
        {
            **CASES["feature-monitoring"],
            **CASES["feature-inference-pool"],
            **CASES["feature-grpc-tls"],
            **CASES["feature-autoscaling-keda"],
            **CASES["feature-pod-groups-volcano"],
            **CASES["feature-http-route"],
        }
    )
    kinds = {crd["spec"]["names"]["kind"] for crd in foreign_crds()}
    rendered = [d for d in docs if d["kind"] in kinds]
    assert {d["kind"] for d in rendered} == kinds - {"LeaderWorkerSet"}  # the operator's
    assert [p for d in rendered for p in problems(d)] == []


@pytest.mark.parametrize(
    "kind,path,value,expect",
    [
        ("ServiceMonitor", "spec.endpoints.0.intervall", "15s", "unknown field"),
        ("ServiceMonitor", "spec.endpoints.0.interval", "15 seconds", "interval"),
        ("ServiceMonitor", "spec.namespaceSelector.matchName", ["serving"], "unknown field"),
        ("ServiceMonitor", "spec.selectors", {}, "unknown field"),
        ("PodMonitor", "spec.podMetricsEndpoints.0.scrapeTimeout", "10", "scrapeTimeout"),
        ("PodMonitor", "spec.targetLabels", ["a"], "unknown field"),
        (
            "PodMonitor",
            "spec.selector.matchExpressions",
            [{"key": "a", "operator": "Equals"}],
            "operator",
        ),
    ],
)
def test_monitor_schemas_refuse_typos_and_bad_values(kind, path, value, expect):
    monitor = by_kind(render(CASES["feature-monitoring"]), kind)[0]
    found = problems(_set(monitor, path, value))
    assert any(expect in p for p in found), found


@pytest.mark.parametrize(
    "path,value,expect",
    [
        ("spec.targetPorts", [], "targetPorts"),
        ("spec.targetPorts.0.number", 0, "number"),
        ("spec.targetPorts.0.port", 8000, "unknown field"),
        ("spec.appProtocol", "grpc", "appProtocol"),
        ("spec.selector.matchExpressions", [], "unknown field"),
        ("spec.endpointPickerRef.failureMode", "Open", "failureMode"),
        ("spec.endpointPickerRef.port.number", 70000, "number"),
        ("spec.endpointPickerRef.portNumber", 9002, "unknown field"),
    ],
)
def test_inference_pool_schema_refuses_typos_and_bad_values(path, value, expect):
    pool = one(render(CASES["feature-inference-pool"]), "InferencePool")
    found = problems(_set(pool, path, value))
    assert any(expect in p for p in found), found


@pytest.mark.parametrize(
    "kind,name,path,value,expect",
    [
        ("Certificate", "tandem-grpc-tls", "spec.dnsName", ["a"], "unknown field"),
        ("Certificate", "tandem-grpc-tls", "spec.usages", ["client authentication"], "usages"),
        ("Certificate", "tandem-grpc-tls", "spec.privateKey.algorithm", "EC", "algorithm"),
        ("Certificate", "tandem-grpc-tls", "spec.issuerRef.name", "", "name"),
        ("Issuer", "tandem-grpc-ca", "spec.ca.secret", "x", "unknown field"),
        ("Issuer", "tandem-grpc-ca", "spec.selfSigned", {}, "spec"),  # two kinds at once
    ],
)
def test_cert_manager_schemas_refuse_typos_and_bad_values(kind, name, path, value, expect):
    obj = one(render(CASES["feature-grpc-tls"]), kind, name)
    found = problems(_set(obj, path, value))
    assert any(expect in p for p in found), found


@pytest.mark.parametrize(
    "path,value,expect",
    [
        ("spec.minReplicas", 1, "unknown field"),
        ("spec.scaleTargetRef.namespace", "serving", "unknown field"),
        ("spec.triggers.0.metricType", "Average", "metricType"),
        ("spec.triggers.0.metadata.threshold", 32, "threshold"),
        ("spec.fallback", {"replicas": 2}, "failureThreshold"),
    ],
)
def test_scaled_object_schema_refuses_typos_and_bad_values(path, value, expect):
    scaled = one(render(CASES["feature-autoscaling-keda"]), "ScaledObject")
    found = problems(_set(scaled, path, value))
    assert any(expect in p for p in found), found


@pytest.mark.parametrize(
    "case,path,value,expect",
    [
        ("pod-groups-volcano", "spec.minMembers", 2, "unknown field"),
        ("pod-groups-volcano", "spec.scheduleTimeoutSeconds", 60, "unknown field"),
        ("pod-groups-coscheduling", "spec.queue", "inference", "unknown field"),
        ("pod-groups-coscheduling", "spec.minMember", -1, "minMember"),
    ],
)
def test_pod_group_schemas_refuse_typos_and_bad_values(case, path, value, expect):
    group = one(render(CASES[f"feature-{case}"]), "PodGroup", "tandem-decode")
    found = problems(_set(group, path, value))
    assert any(expect in p for p in found), found


@pytest.mark.parametrize(
    "path,value,expect",
    [
        ("spec.rules.0.backendRefs.0", {"kind": "Service", "name": "tandem-router"}, "port"),
        ("spec.rules.0.timeouts.request", "1 hour", "request"),
        ("spec.rules.0.matches.0.path.type", "Prefix", "type"),
        ("spec.hostnames.0", "LLM.example.com", "hostnames"),
        ("spec.parentRefs.0.gateway", "gw", "unknown field"),
        ("spec.rules.0.backendRef", [], "unknown field"),
    ],
)
def test_http_route_schema_refuses_typos_and_bad_values(path, value, expect):
    route = one(render(CASES["feature-http-route"]), "HTTPRoute")
    found = problems(_set(route, path, value))
    assert any(expect in p for p in found), found
