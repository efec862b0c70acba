"""`helm install` into the fake API server, then the real operator reconciles it.

The chart's objects (CRDs first, as Helm applies crds/) are created in the
fake Kubernetes API server (devcluster/: real HTTP, resourceVersions, CRD
validation with CEL, built-ins checked by kubernetes-validate); then the
operator runs as its own process with the flags the chart gives its
Deployment. No mocks. Checked:

* the TandemDeployment from default values reconciles into workloads that
  validate (Kubernetes schemas for 1.30 and the newest; the LeaderWorkerSet
  schema of tests/operators/lws_schema.py for multi-node pools);
* every selector the chart renders (monitors, NetworkPolicies, InferencePool)
  picks the operator's pods and names ports they have;
* every API request the operator made is allowed by the chart's RBAC (the
  rules Kubernetes' RBAC authorizer would apply: bound by RoleBinding in the
  release namespace, plus the cluster rules).

The operator runs with operator.watchAllNamespaces here: watching one
namespace, kopf lists the cluster's namespaces (GET /api/v1/namespaces), a
path kmock 0.8's request parser fails on. The RBAC of the chart's default
(one namespace) is still checked, against the same requests made in the
release's namespace.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.ports import free_port
from devcluster.apiserver import RunningApiServer
from devcluster.kinds import Kind
from tests.helm.cases import CASES
from tests.helm.chart import (
    NAMESPACE,
    RELEASE,
    REPO,
    by_kind,
    chart_crds,
    containers,
    example,
    foreign_crds,
    one,
    pod_templates,
    problems,
    render,
    selects,
)

MANAGED = "app.kubernetes.io/managed-by=tandem-operator"
# Kinds the operator creates, as (group, version, plural).
OPERATOR_KINDS = [
    ("apps", "v1", "deployments"),
    ("apps", "v1", "daemonsets"),
    ("", "v1", "services"),
    ("", "v1", "configmaps"),
    ("", "v1", "serviceaccounts"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("rbac.authorization.k8s.io", "v1", "rolebindings"),
    ("tandem.dev", "v1alpha1", "enginepools"),
    ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets"),
]
FEATURES = {
    **CASES["feature-monitoring"],
    **CASES["feature-network-policy-restricted"],
    **CASES["feature-inference-pool"],
    **CASES["feature-watch-all-namespaces"],
}


class Cluster:
    """A fake API server with the chart installed and the operator running against it."""

    def __init__(self, tmp_path: Path) -> None:
        self.server = RunningApiServer(bookmark_interval=0.5).start()
        self.kubeconfig = self.server.write_kubeconfig(tmp_path / "kubeconfig")
        self.log = tmp_path / "operator.log"
        self.proc: subprocess.Popen | None = None
        self.docs: list[dict] = []
        self.server.call(self._serve_network_policies)

    def _serve_network_policies(self) -> None:
        # A built-in the fake server does not list yet; served like the others.
        kind = Kind("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy")
        self.server.store.kinds[kind.key] = kind
        self.server.store.on_kinds_changed()

    def helm_install(self, values: dict) -> None:
        """What `helm install` creates: the CRDs, then every object but the test hooks."""
        self.server.install(*chart_crds(), *foreign_crds())
        self.server.install(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
        )
        self.docs = render(values)
        self.server.install(
            *[d for d in self.docs if "helm.sh/hook" not in d["metadata"].get("annotations", {})]
        )

    def start_operator(self) -> None:
        """The chart's operator container, run here: its args, but free local ports."""
        container = one(self.docs, "Deployment", f"{RELEASE}-operator")["spec"]["template"]["spec"][
            "containers"
        ][0]
        assert container["command"] == ["tandem", "operator"]
        args = [
            a for a in container["args"] if not a.startswith(("--health-port", "--metrics-port"))
        ]
        env = dict(os.environ, KUBECONFIG=str(self.kubeconfig), TANDEM_LOG_LEVEL="INFO")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "operators",
                *args,
                f"--health-port={free_port()}",
                "--metrics-port=0",
            ],
            cwd=REPO,
            env=env,
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
        )

    def objects(self, group: str, version: str, plural: str) -> list[dict]:
        return self.server.list(group, version, plural, NAMESPACE, MANAGED)

    def operator_objects(self) -> list[dict]:
        return [o for key in OPERATOR_KINDS for o in self.objects(*key)]

    def wait_for(self, predicate, what: str, timeout: float = 90.0):
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(
                    f"the operator exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out waiting for {what}; operator log:\n{self.log.read_text()[-3000:]}"
                )
            time.sleep(0.2)

    def requests(self) -> list:
        return list(self.server.handler)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.server.stop()


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.stop()


def reconciled(cluster: Cluster, deployments: set[str]):
    """The operator's objects once every expected Deployment exists and the status is written."""

    def done():
        names = {d["metadata"]["name"] for d in cluster.objects("apps", "v1", "deployments")}
        td = cluster.server.get("tandem.dev", "v1alpha1", "tandemdeployments", NAMESPACE, RELEASE)
        return deployments <= names and td.get("status", {}).get("conditions")

    cluster.wait_for(done, f"Deployments {sorted(deployments)} and the TandemDeployment's status")
    return cluster.operator_objects()


# ---- RBAC as Kubernetes' authorizer applies it --------------------------------


def rbac_attributes(request) -> tuple[str, str, str | None, str] | None:
    """(API group, resource[/subresource], namespace, verb) of one request; None for
    non-resource URLs (discovery, /version, OpenAPI: allowed to every user)."""
    parts = [p for p in request.url.path.split("/") if p]
    if parts[:1] == ["api"] and len(parts) >= 3:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 4:
        group, rest = parts[1], parts[3:]
    else:
        return None
    namespace = None
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    resource, name, sub = rest[0], (rest[1] if len(rest) > 1 else None), rest[2:]
    method = request.method.value.upper()
    if method == "GET":
        verb = (
            "watch" if request.params.get("watch") in ("true", "1") else ("get" if name else "list")
        )
    else:
        verb = {
            "POST": "create",
            "PUT": "update",
            "PATCH": "patch",
            "DELETE": "delete" if name else "deletecollection",
        }[method]
    return group, "/".join([resource, *sub]), namespace, verb


def allowed(rules: list[dict], group: str, resource: str, verb: str) -> bool:
    for rule in rules:
        if rule.get("resourceNames"):
            continue  # name-scoped rules never allow list/watch/create on a collection
        if group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]:
            return True
    return False


def operator_rules(docs: list[dict]) -> tuple[list[dict], list[dict]]:
    """(rules in the release namespace, rules cluster-wide) of the operator's account."""
    account = f"{RELEASE}-operator"
    roles = {r["metadata"]["name"]: r["rules"] for r in by_kind(docs, "ClusterRole")}
    namespaced, cluster = [], []
    for binding in by_kind(docs, "RoleBinding") + by_kind(docs, "ClusterRoleBinding"):
        if not any(
            s["kind"] == "ServiceAccount" and s["name"] == account and s["namespace"] == NAMESPACE
            for s in binding["subjects"]
        ):
            continue
        rules = roles[binding["roleRef"]["name"]]
        namespaced += rules
        if binding["kind"] == "ClusterRoleBinding":
            cluster += rules
    return namespaced, cluster


# ---- the tests ----------------------------------------------------------------


def test_default_values_reconcile_to_valid_workloads_the_chart_can_see(cluster):
    cluster.helm_install(FEATURES)
    td = one(cluster.docs, "TandemDeployment")
    assert td["spec"] == one(render({}), "TandemDeployment")["spec"]  # defaults, features aside
    cluster.start_operator()
    workloads = {
        f"{RELEASE}-{n}" for n in ("router", "redis", "kvstore-master", "prefill", "decode")
    }
    objects = reconciled(cluster, workloads)

    found = [p for obj in objects for p in problems(obj) + policy_problems(obj)]
    assert not found, "\n".join(found)
    assert {p["spec"]["role"]: p["spec"]["replicas"] for p in by_kind(objects, "EnginePool")} == {
        "prefill": 1,
        "decode": 1,
    }

    # What the chart decided for the operator's pods reached them.
    pools = {d["metadata"]["name"]: d for d in by_kind(objects, "Deployment")}
    for role in ("prefill", "decode"):
        engine = containers(pools[f"{RELEASE}-{role}"])[0]
        resources = td["spec"][role]["resources"]
        assert engine["resources"]["requests"] == {**resources["requests"], "nvidia.com/gpu": "1"}
        assert engine["image"] == td["spec"]["images"]["engine"]
    router = containers(pools[f"{RELEASE}-router"])[0]
    assert router["resources"] == td["spec"]["router"]["resources"]

    check_selectors(cluster.docs, objects, absent=("engine-worker",))
    check_operator_rbac(cluster, cluster.docs)
    check_operator_rbac(cluster, render({}), in_release_namespace=True)


def policy_problems(obj: dict) -> list[str]:
    """test_policy's rules for the operator's pods: every container asks for CPU and
    memory and has readiness and liveness probes; engine pods mount a memory /dev/shm."""
    out = []
    for template in pod_templates(obj):
        for c in template["spec"]["containers"]:
            where = f"{obj['kind']}/{obj['metadata']['name']} {c['name']}"
            if not {"cpu", "memory"} <= set(c.get("resources", {}).get("requests", {})):
                out.append(f"{where}: no CPU/memory request")
            if not ("readinessProbe" in c and "livenessProbe" in c):
                out.append(f"{where}: no readiness or liveness probe")
        if template["metadata"]["labels"].get("tandem.dev/role"):
            shm = [v for v in template["spec"].get("volumes", []) if v["name"] == "shm"]
            if not shm or shm[0]["emptyDir"].get("medium") != "Memory":
                out.append(f"{obj['metadata']['name']}: engine pod without a memory /dev/shm")
    return out


def check_selectors(docs: list[dict], objects: list[dict], absent: tuple[str, ...] = ()) -> None:
    """Every selector the chart renders picks the operator's pods it means, by named ports
    those pods have; every operator pod is under the default-deny policy. `absent`: pod
    components this configuration does not run (NetworkPolicy peers may name them)."""
    pods = [(o["metadata"]["name"], t) for o in objects + docs for t in pod_templates(o)]
    services = by_kind(objects, "Service")

    def chosen(selector: dict) -> list[tuple[str, dict]]:
        return [(name, t) for name, t in pods if selects(selector, t["metadata"]["labels"])]

    def ports(templates: list[tuple[str, dict]]) -> set:
        return {
            p.get("name")
            for _, t in templates
            for c in t["spec"]["containers"]
            for p in c.get("ports", [])
        } | {
            p["containerPort"]
            for _, t in templates
            for c in t["spec"]["containers"]
            for p in c.get("ports", [])
        }

    for monitor in by_kind(docs, "ServiceMonitor"):
        name = monitor["metadata"]["name"]
        if name.endswith("-operator"):
            continue  # the chart's own Service (test_policy checks it)
        picked = [
            s for s in services if selects(monitor["spec"]["selector"], s["metadata"]["labels"])
        ]
        assert [s["metadata"]["name"] for s in picked] == [f"{RELEASE}-router"], name
        assert monitor["spec"]["endpoints"][0]["port"] in {
            p["name"] for p in picked[0]["spec"]["ports"]
        }
    expected = {
        f"{RELEASE}-engines": {f"{RELEASE}-prefill", f"{RELEASE}-decode"},
        f"{RELEASE}-kvstore-master": {f"{RELEASE}-kvstore-master"},
    }
    for monitor in by_kind(docs, "PodMonitor"):
        name = monitor["metadata"]["name"]
        picked = chosen(monitor["spec"]["selector"])
        assert {n for n, _ in picked} == expected[name], name
        assert monitor["spec"]["podMetricsEndpoints"][0]["port"] in ports(picked), name
        for label in monitor["spec"].get("podTargetLabels", []):
            assert all(label in t["metadata"]["labels"] for _, t in picked), label

    policies = {p["metadata"]["name"]: p["spec"] for p in by_kind(docs, "NetworkPolicy")}
    deny = policies.pop(f"{RELEASE}-default-deny")
    assert len(chosen(deny["podSelector"])) == len(pods)
    covered: set[str] = set()
    for name, spec in policies.items():
        picked = chosen(spec["podSelector"])
        assert picked, f"NetworkPolicy {name} selects no pod"
        covered |= {n for n, _ in picked}
        for rule in spec.get("ingress", []):
            for port in rule.get("ports", []):
                assert port["port"] in ports(picked), f"{name}: no pod has port {port['port']}"
            for peer in rule.get("from", []):
                if "podSelector" in peer and "namespaceSelector" not in peer:
                    component = peer["podSelector"]["matchLabels"].get(
                        "app.kubernetes.io/component"
                    )
                    if component not in ("helm-test", "operator", *absent):
                        assert chosen(peer["podSelector"]), f"{name}: peer {component} is no pod"
    # Every pod that serves something (all but the test hook) lets its clients in.
    serving = {
        n for n, t in pods if t["metadata"]["labels"]["app.kubernetes.io/component"] != "helm-test"
    }
    assert covered == serving, serving - covered

    for pool in by_kind(docs, "InferencePool"):
        picked = chosen(pool["spec"]["selector"])
        assert picked, "the InferencePool selects no pod"
        for target in pool["spec"]["targetPorts"]:
            assert target["number"] in ports(picked)


def check_operator_rbac(
    cluster: Cluster, docs: list[dict], in_release_namespace: bool = False
) -> None:
    """Every request the operator made is one `docs`' RBAC allows. With
    `in_release_namespace`, cluster-wide requests for namespaced resources count as
    made in the release's namespace (what the operator sends watching only it)."""
    namespaced, cluster_wide = operator_rules(docs)
    kinds = {(k.group, k.plural): k.namespaced for k in cluster.server.store.kinds.values()}
    refused, seen = [], set()
    for request in cluster.requests():
        attrs = rbac_attributes(request)
        if attrs is None:
            continue
        group, resource, namespace, verb = attrs
        if (
            in_release_namespace
            and namespace is None
            and kinds.get((group, resource.split("/")[0]))
        ):
            namespace = NAMESPACE
        rules = namespaced if namespace == NAMESPACE else cluster_wide
        seen.add((group, resource, verb))
        if not allowed(rules, group, resource, verb):
            refused.append(f"{verb} {group or 'core'}/{resource} in {namespace or 'the cluster'}")
    assert not refused, "the chart's RBAC would refuse: " + "; ".join(sorted(set(refused)))
    # The check saw the operator at work, not only its start.
    assert ("apps", "deployments", "create") in seen
    assert ("tandem.dev", "tandemdeployments/status", "patch") in seen


def test_multi_node_pools_reconcile_to_valid_leaderworkersets(cluster):
    cluster.helm_install({**example("multinode-lws"), **CASES["feature-watch-all-namespaces"]})
    cluster.start_operator()
    objects = reconciled(cluster, {f"{RELEASE}-router", f"{RELEASE}-kvstore-master"})
    lws = cluster.wait_for(
        lambda: (
            len(cluster.objects("leaderworkerset.x-k8s.io", "v1", "leaderworkersets")) == 2
            and cluster.objects("leaderworkerset.x-k8s.io", "v1", "leaderworkersets")
        ),
        "two LeaderWorkerSets",
    )
    found = [p for obj in lws + objects for p in problems(obj) + policy_problems(obj)]
    assert not found, "\n".join(found)
    for group in lws:
        template = group["spec"]["leaderWorkerTemplate"]
        assert template["size"] == 2
        gpus = containers(group)[0]["resources"]["limits"]["nvidia.com/gpu"]
        assert gpus == "8"
    check_operator_rbac(cluster, cluster.docs)
    check_selectors(
        render({**example("multinode-lws"), **FEATURES}),
        [o for o in objects if o["kind"] != "LeaderWorkerSet"] + lws,
    )
