"""What the chart's NetworkPolicies admit, pod to pod and port by port.

The chart is rendered with policies on; the pods are the real ones: the
chart's (operator, `helm test`) and what the operator builds from the
rendered TandemDeployment (router, Redis, prefill and decode engines with a
multi-node decode pool's Ray workers, KV store master and clients), with
their labels and named ports, plus pods that are not the deployment's: one
in the same namespace, one in another, an Ingress controller's and a
Prometheus'. The policies are evaluated as Kubernetes does (a pod selected by
any policy admits only what some rule of those policies allows) and the
resulting matrix — for each source and destination, the destination's ports
admitted, "*" for every port — must be exactly the intended one. No cluster,
no mocks."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from operators import manifests
from operators.spec import parse
from tests.helm.chart import NAMESPACE, RELEASE, by_kind, pod_templates, render, selects

INGRESS_NS, MONITORING_NS = "ingress-nginx", "monitoring"
OWNER = manifests.Owner("TandemDeployment", RELEASE, "uid-td")
# A port no container names: what Ray, UCX and Mooncake's transfer engine pick.
PICKED_PORT = 40123

VALUES = {
    "router": {"replicas": 2},  # with managed Redis between the replicas
    "kvStore": {"enabled": True},
    "decode": {"nodesPerReplica": 2, "gpusPerPod": 8, "parallelism": {"tensor": 8, "pipeline": 2}},
}
RESTRICTED = {
    "enabled": True,
    "routerFrom": [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": INGRESS_NS}}}
    ],
    "metricsFrom": [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": MONITORING_NS}}}
    ],
}

ENGINE_PEERS = ("engine", "engine-worker", "kvstore-client")
# Source → destination → ports admitted, with routerFrom and metricsFrom set.
RESTRICTED_MATRIX: dict[tuple[str, str], str] = {
    # The public entry: the Ingress, `helm test`, the operator (router loads
    # before a scale-down) and Prometheus, on the HTTP port only.
    ("ingress", "router"): "http",
    ("helm-test", "router"): "http",
    ("operator", "router"): "http",
    ("monitoring", "router"): "http",
    # Engines: the router's gRPC calls and KV-event streams, by port; the
    # deployment's engine and store pods on every port (NIXL and UCX, Ray,
    # Mooncake's transfer engine).
    ("router", "engine"): "grpc kv-events kv-replay",
    **{(peer, "engine"): "*" for peer in ENGINE_PEERS},
    **{(peer, "engine-worker"): "*" for peer in ENGINE_PEERS},
    ("monitoring", "engine"): "metrics",
    # The KV store: its master's RPC and metadata from engines and clients;
    # the clients' transfer engine from engines, clients and the master.
    **{(peer, "kvstore-master"): "metadata rpc" for peer in ENGINE_PEERS},
    ("monitoring", "kvstore-master"): "metrics",
    **{(peer, "kvstore-client"): "*" for peer in (*ENGINE_PEERS, "kvstore-master")},
    ("router", "redis"): "redis",
    ("monitoring", "operator"): "metrics",
}


@dataclass(frozen=True)
class Pod:
    name: str  # its component, or what the outside pod stands for
    namespace: str
    labels: dict[str, str]
    ports: frozenset[str | int]  # named ports and the numbers behind them


def deployment_pods(docs: list[dict]) -> list[Pod]:
    td = by_kind(docs, "TandemDeployment")[0]
    spec = parse(td["spec"])
    objects = manifests.shared_objects(RELEASE, NAMESPACE, spec, OWNER)
    for role in spec.roles:
        objects += manifests.pool_workload(RELEASE, NAMESPACE, spec, role, 1, OWNER)
    pods: dict[str, Pod] = {}
    for obj in objects + docs:
        for template in pod_templates(obj):
            labels = template["metadata"]["labels"]
            name = labels["app.kubernetes.io/component"]
            ports: set[str | int] = {PICKED_PORT}
            for container in template["spec"]["containers"]:
                for port in container.get("ports", []):
                    ports |= {port["name"], port["containerPort"]}
            if name in pods:  # prefill and decode engines: the same ports
                assert pods[name].ports == ports, name
            pods[name] = Pod(name, NAMESPACE, labels, frozenset(ports))
    return list(pods.values())


OUTSIDERS = [
    Pod("outside", NAMESPACE, {"app": "curious"}, frozenset()),
    Pod("other-namespace", "team-b", {"app": "curious"}, frozenset()),
    Pod("ingress", INGRESS_NS, {"app.kubernetes.io/name": "ingress-nginx"}, frozenset()),
    Pod("monitoring", MONITORING_NS, {"app.kubernetes.io/name": "prometheus"}, frozenset()),
]


def peer_matches(peer: dict, source: Pod, policy_ns: str) -> bool:
    if "ipBlock" in peer:
        raise AssertionError(f"ipBlock peers are not evaluated here: {peer}")
    if "namespaceSelector" in peer:
        ns_labels = {"kubernetes.io/metadata.name": source.namespace}
        if not selects(peer["namespaceSelector"], ns_labels):
            return False
    elif source.namespace != policy_ns:
        return False
    return "podSelector" not in peer or selects(peer["podSelector"], source.labels)


def admitted(policies: list[dict], source: Pod, dest: Pod) -> str:
    """The ports of `dest` that `source` may reach: "*" (all), names, or ""."""
    chosen = [p for p in policies if selects(p["spec"]["podSelector"], dest.labels)]
    assert chosen, f"{dest.name}: no policy selects it (it would admit anyone)"
    ports: set[str | int] = set()
    for policy in chosen:
        for rule in policy["spec"].get("ingress", []):
            froms = rule.get("from")
            if froms is not None and not any(
                peer_matches(peer, source, policy["metadata"]["namespace"]) for peer in froms
            ):
                continue
            if "ports" not in rule:
                return "*"
            ports |= {p["port"] for p in rule["ports"]} & dest.ports
    return " ".join(sorted(str(p) for p in ports))


def matrix(network_policy: dict) -> tuple[dict[tuple[str, str], str], list[Pod]]:
    docs = render({**VALUES, "networkPolicy": network_policy})
    policies = by_kind(docs, "NetworkPolicy")
    assert {p["metadata"]["namespace"] for p in policies} == {NAMESPACE}
    pods = deployment_pods(docs)
    found = {}
    for source in pods + OUTSIDERS:
        for dest in pods:
            ports = admitted(policies, source, dest)
            if ports:
                found[(source.name, dest.name)] = ports
    return found, pods


@pytest.fixture(scope="module")
def restricted():
    return matrix(RESTRICTED)


@pytest.fixture(scope="module")
def open_router():
    # routerFrom and metricsFrom empty (the defaults): the router is open to
    # anyone, on its HTTP port; nothing else of the deployment is.
    return matrix({"enabled": True})


def test_every_component_of_the_deployment_is_in_the_matrix(restricted):
    _, pods = restricted
    assert sorted(p.name for p in pods) == [
        "engine",
        "engine-worker",
        "helm-test",
        "kvstore-client",
        "kvstore-master",
        "operator",
        "redis",
        "router",
    ]


def test_restricted_policies_admit_exactly_the_intended_matrix(restricted):
    found, _ = restricted
    assert found == RESTRICTED_MATRIX


@pytest.mark.parametrize("outsider", [o.name for o in OUTSIDERS])
def test_an_outside_pod_reaches_only_the_routers_http_port(open_router, outsider):
    found, _ = open_router
    reached = {dest: ports for (src, dest), ports in found.items() if src == outsider}
    assert reached == {"router": "http"}


def test_inside_the_deployment_an_open_router_changes_only_the_router(open_router):
    found, pods = open_router
    outsiders = {o.name for o in OUTSIDERS}
    inside = {k: v for k, v in found.items() if k[0] not in outsiders}
    expected = {
        k: v for k, v in RESTRICTED_MATRIX.items() if k[0] not in outsiders and k[1] != "operator"
    }
    expected |= {(pod.name, "router"): "http" for pod in pods}
    assert inside == expected
