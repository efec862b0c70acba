"""The local cluster's controllers (devcluster/controllers/) against its API server.

No mocks and no processes: the real server and store with its controllers
running, the real kubectl; the test plays the kubelet (writes pod status,
finishes graceful deletions with grace 0), as the process kubelet does.
"""

from __future__ import annotations

import copy
import time

import pytest

from devcluster import semantics
from devcluster.controllers import NODE_NAME
from devcluster.controllers.replicaset import DELETION_COST, deletion_order
from services.router.discovery import merge_endpoints, slice_endpoints
from tests.helm.foreign_schemas import crds as foreign_crds

NS = "default"
PODS = ("", "v1", "pods")
DEPLOYMENTS = ("apps", "v1", "deployments")
REPLICASETS = ("apps", "v1", "replicasets")
SLICES = ("discovery.k8s.io", "v1", "endpointslices")
LWS = ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets")


@pytest.fixture
def kube_api(kube_api_with_controllers):
    """Every test here (and the kubectl fixture) gets the server with controllers."""
    return kube_api_with_controllers


# ---- playing the kubelet ------------------------------------------------------------


class Kubelet:
    def __init__(self, api) -> None:
        self.api = api
        self.next_ip = 10

    def pods(self, selector: str | None = None) -> list[dict]:
        return self.api.list(*PODS, NS, selector)

    def ready(self, pod: dict, ready: bool = True) -> None:
        """Running with an IP, Ready as asked, as the kubelet reports a pod."""
        status = pod.get("status") or {}
        ip = status.get("podIP")
        if ip is None:
            self.next_ip += 1
            ip = f"10.244.0.{self.next_ip}"
        body = {
            "status": {
                "phase": "Running",
                "podIP": ip,
                "podIPs": [{"ip": ip}],
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True" if ready else "False",
                        "lastTransitionTime": semantics.now_rfc3339(),
                    }
                ],
            }
        }
        meta = pod["metadata"]

        def write() -> None:
            store = self.api.store
            store.patch(
                store.kind(*PODS),
                NS,
                meta["name"],
                body,
                "application/merge-patch+json",
                subresource="status",
            )

        self.api.call(write)

    def finish(self, pod: dict) -> None:
        """The processes are gone: delete with grace 0, as the kubelet does."""
        self.api.call(
            lambda: self.api.store.delete(
                self.api.store.kind(*PODS), NS, pod["metadata"]["name"], {"gracePeriodSeconds": 0}
            )
        )

    def settle(self) -> None:
        """Until the controllers have acted on every write so far."""
        manager = self.api.controllers
        deadline = time.monotonic() + 30
        while not self.api.call(manager.idle):
            assert time.monotonic() < deadline, "the controllers never settled"
            time.sleep(0.01)
        assert not manager.errors, list(manager.errors)


@pytest.fixture
def kubelet(kube_api) -> Kubelet:
    return Kubelet(kube_api)


def edit(kube_api, group_version_plural, name, change) -> None:
    """Read, change and replace an object in one step on the server's loop, so
    no controller write (a status update) comes between: a client would retry
    the 409 instead."""

    def run():
        kind = kube_api.store.kind(*group_version_plural)
        obj = copy.deepcopy(kube_api.store.get(kind, NS, name))
        change(obj)
        kube_api.store.replace(kind, NS, name, obj)

    kube_api.call(run)


def set_image(image):
    def change(obj):
        obj["spec"]["template"]["spec"]["containers"][0]["image"] = image

    return change


def deployment(name: str = "web", replicas: int = 3, **spec) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "containers": [
                        {
                            "name": "c",
                            "image": "i:1",
                            "ports": [{"name": "grpc", "containerPort": 50051}],
                        }
                    ]
                },
            },
            **spec,
        },
    }


def service(name: str = "web", **spec) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": NS, "labels": {"tandem.dev/role": "decode"}},
        "spec": {
            "selector": {"app": name},
            "ports": [{"name": "grpc", "port": 9000, "targetPort": "grpc"}],
            **spec,
        },
    }


def active(pods: list[dict]) -> list[dict]:
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def is_ready(pod: dict) -> bool:
    return any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def scale(api, name: str, replicas: int) -> None:
    api.call(
        lambda: api.store.patch(
            api.store.kind(*DEPLOYMENTS),
            NS,
            name,
            {"spec": {"replicas": replicas}},
            "application/merge-patch+json",
            subresource="scale",
        )
    )


# ---- Deployment → ReplicaSet → pods --------------------------------------------------


def test_a_deployment_gets_a_replicaset_and_bound_pods_with_owner_chains(kube_api, kubelet):
    kube_api.install(deployment(replicas=3))
    kubelet.settle()
    d = kube_api.get(*DEPLOYMENTS, NS, "web")
    (rs,) = kube_api.list(*REPLICASETS, NS)
    pod_hash = rs["metadata"]["labels"]["pod-template-hash"]
    assert rs["metadata"]["name"] == f"web-{pod_hash}"
    assert rs["metadata"]["annotations"]["deployment.kubernetes.io/revision"] == "1"
    assert rs["metadata"]["ownerReferences"][0]["uid"] == d["metadata"]["uid"]
    assert rs["spec"]["selector"]["matchLabels"] == {"app": "web", "pod-template-hash": pod_hash}
    pods = kubelet.pods()
    assert len(pods) == 3
    for pod in pods:
        assert pod["metadata"]["name"].startswith(f"web-{pod_hash}-")
        assert len(pod["metadata"]["name"]) == len(f"web-{pod_hash}-") + 5
        assert pod["metadata"]["ownerReferences"][0]["uid"] == rs["metadata"]["uid"]
        assert pod["metadata"]["labels"]["pod-template-hash"] == pod_hash
        assert pod["spec"]["nodeName"] == NODE_NAME
    node = kube_api.get("", "v1", "nodes", None, NODE_NAME)
    assert node["status"]["allocatable"]["nvidia.com/gpu"]
    assert d["status"]["replicas"] == 3 and d["status"]["readyReplicas"] == 0
    assert d["status"]["observedGeneration"] == d["metadata"]["generation"]


def test_ready_pods_are_counted_and_listed_as_ready_endpoints(kube_api, kubelet):
    kube_api.install(deployment(replicas=3), service())
    kubelet.settle()
    pods = kubelet.pods()
    for pod in pods[:2]:
        kubelet.ready(pod)
    kubelet.ready(pods[2], ready=False)
    kubelet.settle()
    status = kube_api.get(*DEPLOYMENTS, NS, "web")["status"]
    assert (status["readyReplicas"], status["availableReplicas"]) == (2, 2)
    conditions = {c["type"]: c for c in status["conditions"]}
    # maxUnavailable 25% of 3 rounds down to 0: all 3 must be available.
    assert conditions["Available"]["status"] == "False"
    (eps,) = kube_api.list(*SLICES, NS)
    labels = eps["metadata"]["labels"]
    assert labels["kubernetes.io/service-name"] == "web"
    assert labels["tandem.dev/role"] == "decode"  # the Service's labels are copied
    assert labels["endpointslice.kubernetes.io/managed-by"] == "endpointslice-controller.k8s.io"
    assert eps["ports"] == [{"name": "grpc", "port": 50051, "protocol": "TCP"}]
    ready = [e for e in eps["endpoints"] if e["conditions"]["ready"]]
    assert len(ready) == 2 and len(eps["endpoints"]) == 3
    for e in eps["endpoints"]:
        assert e["targetRef"]["kind"] == "Pod" and e["nodeName"] == NODE_NAME
    # What the router's discovery makes of it: two engines to use, one not yet.
    found = merge_endpoints({"s": eps})
    assert sorted(e.ready for e in found.values()) == [False, True, True]
    kubelet.ready(pods[2])
    kubelet.settle()
    status = kube_api.get(*DEPLOYMENTS, NS, "web")["status"]
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Available"]["status"] == "True"
    assert conditions["Progressing"]["reason"] == "NewReplicaSetAvailable"


def test_a_terminating_pod_stays_listed_as_serving_and_terminating(kube_api, kubelet):
    kube_api.install(deployment(replicas=2), service())
    kubelet.settle()
    for pod in kubelet.pods():
        kubelet.ready(pod)
    kubelet.settle()
    scale(kube_api, "web", 1)
    kubelet.settle()
    (eps,) = kube_api.list(*SLICES, NS)
    conditions = sorted(
        (e["conditions"]["ready"], e["conditions"]["serving"], e["conditions"]["terminating"])
        for e in eps["endpoints"]
    )
    assert conditions == [(False, True, True), (True, True, False)]
    endpoints = slice_endpoints(eps)
    assert sorted((e.ready, e.terminating) for e in endpoints) == [(False, True), (True, False)]
    (going,) = [p for p in kubelet.pods() if p["metadata"].get("deletionTimestamp")]
    kubelet.finish(going)
    kubelet.settle()
    (eps,) = kube_api.list(*SLICES, NS)
    assert len(eps["endpoints"]) == 1


def test_named_ports_that_resolve_differently_go_in_separate_slices(kube_api, kubelet):
    kube_api.install(deployment("a", replicas=1), deployment("b", replicas=1))
    other = deployment("b", replicas=1)
    other["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = 7000
    kube_api.call(
        lambda: kube_api.store.replace(
            kube_api.store.kind(*DEPLOYMENTS), NS, "b", {**other, "metadata": {"name": "b"}}
        )
    )
    svc = service("both")
    svc["spec"]["selector"] = {"tier": "x"}
    for name in ("a", "b"):
        edit(
            kube_api,
            DEPLOYMENTS,
            name,
            lambda d: d["spec"]["template"]["metadata"]["labels"].update(tier="x"),
        )
    kube_api.install(svc)
    kubelet.settle()
    for pod in active(kubelet.pods("tier=x")):
        kubelet.ready(pod)
    kubelet.settle()
    slices = kube_api.list(*SLICES, NS, "kubernetes.io/service-name=both")
    assert sorted(s["ports"][0]["port"] for s in slices) == [7000, 50051]
    assert all(len(s["endpoints"]) == 1 for s in slices)


def test_scale_down_deletes_the_cheapest_pods_first_and_gracefully(kube_api, kubelet, kubectl):
    kube_api.install(deployment(replicas=3))
    kubelet.settle()
    pods = kubelet.pods()
    for pod in pods:
        kubelet.ready(pod)
    costly = pods[0]["metadata"]["name"]
    kube_api.call(
        lambda: kube_api.store.patch(
            kube_api.store.kind(*PODS),
            NS,
            costly,
            {"metadata": {"annotations": {DELETION_COST: "100"}}},
            "application/merge-patch+json",
        )
    )
    kubectl("scale", "deploy/web", "--replicas", "1")
    kubelet.settle()
    pods = kubelet.pods()
    assert len(pods) == 3  # graceful: the two victims wait for the kubelet
    (kept,) = active(pods)
    assert kept["metadata"]["name"] == costly
    for pod in pods:
        if pod["metadata"]["name"] != costly:
            assert pod["metadata"]["deletionTimestamp"]
            assert pod["metadata"]["deletionGracePeriodSeconds"] == 30
            kubelet.finish(pod)
    kubelet.settle()
    assert [p["metadata"]["name"] for p in kubelet.pods()] == [costly]
    assert kube_api.get(*DEPLOYMENTS, NS, "web")["status"]["replicas"] == 1


def pod(name: str, node: str = NODE_NAME, phase: str = "Running", ready: bool = True, **more):
    return {
        "metadata": {
            "name": name,
            "creationTimestamp": more.get("created", "2026-01-01T00:00:00Z"),
            "annotations": more.get("annotations", {}),
        },
        "spec": {"nodeName": node},
        "status": {
            "phase": phase,
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True" if ready else "False",
                    "lastTransitionTime": more.get("ready_at", "2026-01-01T00:00:00Z"),
                }
            ],
            "containerStatuses": [{"restartCount": more.get("restarts", 0)}],
        },
    }


def test_deletion_order_follows_the_replicaset_controllers_ranking():
    pods = [
        pod("old-ready"),
        pod("newer-ready", ready_at="2026-01-02T00:00:00Z"),
        pod("restarted", restarts=3),
        pod("costly-unready", ready=False, annotations={DELETION_COST: "9"}),
        pod("unready", ready=False),
        pod("pending", phase="Pending", ready=False),
        pod("unscheduled", node="", phase="Pending", ready=False),
        pod("cheap", annotations={DELETION_COST: "-5"}),
        pod("bad-cost", annotations={DELETION_COST: "x"}),
        pod("young", created="2026-01-03T00:00:00Z"),
    ]
    order = [p["metadata"]["name"] for p in deletion_order(copy.deepcopy(pods), pods)]
    assert order[:5] == ["unscheduled", "pending", "unready", "costly-unready", "cheap"]
    # Then equal cost (the bad annotation counts as 0): ready most recently,
    # more restarts, created most recently.
    assert order[5] == "newer-ready"
    assert order.index("restarted") < order.index("young") < order.index("old-ready")


def wait_rollout(kube_api, kubelet, replicas: int, min_available: int) -> int:
    """Play the kubelet through a rollout: make new pods ready and finish
    terminating ones, one step at a time, checking after each that at least
    `min_available` pods are ready and not terminating. Returns the steps."""
    steps = 0
    while True:
        kubelet.settle()
        pods = kubelet.pods()
        serving = [p for p in active(pods) if is_ready(p)]
        assert len(serving) >= min_available, f"only {len(serving)} available at step {steps}"
        status = kube_api.get(*DEPLOYMENTS, NS, "web")["status"]
        if (
            status.get("updatedReplicas") == replicas
            and status.get("availableReplicas") == replicas
            and status.get("replicas") == replicas
            and len(pods) == replicas
        ):
            return steps
        going = [p for p in pods if p["metadata"].get("deletionTimestamp")]
        waiting = [p for p in active(pods) if not is_ready(p)]
        assert going or waiting, f"stuck: {status}"
        if going:
            kubelet.finish(going[0])
        else:
            kubelet.ready(waiting[0])
        steps += 1
        assert steps < 50


def test_a_rolling_update_keeps_replicas_minus_max_unavailable_ready(kube_api, kubelet, kubectl):
    kube_api.install(deployment(replicas=4))
    wait_rollout(kube_api, kubelet, 4, 0)
    edit(kube_api, DEPLOYMENTS, "web", set_image("i:2"))
    # Defaults: maxSurge 25% of 4 = 1, maxUnavailable 1: at least 3 ready throughout.
    steps = wait_rollout(kube_api, kubelet, 4, 3)
    assert steps >= 8
    rses = {
        r["metadata"]["annotations"]["deployment.kubernetes.io/revision"]: r
        for r in kube_api.list(*REPLICASETS, NS)
    }
    assert rses["1"]["spec"]["replicas"] == 0 and rses["2"]["spec"]["replicas"] == 4
    images = {p["spec"]["containers"][0]["image"] for p in kubelet.pods()}
    assert images == {"i:2"}
    out = kubectl("rollout", "status", "deploy/web", "--timeout=10s").stdout
    assert "successfully rolled out" in out


def test_the_operators_strategy_never_drops_below_replicas(kube_api, kubelet):
    """maxSurge 1, maxUnavailable 0: what the operator renders for engine pools."""
    strategy = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    kube_api.install(deployment(replicas=2, strategy=strategy))
    wait_rollout(kube_api, kubelet, 2, 0)
    edit(kube_api, DEPLOYMENTS, "web", set_image("i:2"))
    wait_rollout(kube_api, kubelet, 2, 2)


def test_recreate_starts_new_pods_only_once_the_old_are_gone(kube_api, kubelet):
    kube_api.install(deployment(replicas=2, strategy={"type": "Recreate"}, revisionHistoryLimit=0))
    wait_rollout(kube_api, kubelet, 2, 0)
    edit(kube_api, DEPLOYMENTS, "web", set_image("i:2"))
    kubelet.settle()
    pods = kubelet.pods()
    assert len(pods) == 2 and all(p["metadata"].get("deletionTimestamp") for p in pods)
    kubelet.finish(pods[0])
    kubelet.settle()
    assert len(kubelet.pods()) == 1  # still waiting for the second old pod
    kubelet.finish(pods[1])
    kubelet.settle()
    images = [p["spec"]["containers"][0]["image"] for p in kubelet.pods()]
    assert images == ["i:2", "i:2"]
    # revisionHistoryLimit 0: the old, empty ReplicaSet is deleted.
    (rs,) = kube_api.list(*REPLICASETS, NS)
    assert rs["metadata"]["annotations"]["deployment.kubernetes.io/revision"] == "2"


def test_deleting_a_deployment_collects_its_replicaset_and_pods_gracefully(kube_api, kubelet):
    kube_api.install(deployment(replicas=2))
    kubelet.settle()
    kube_api.call(lambda: kube_api.store.delete(kube_api.store.kind(*DEPLOYMENTS), NS, "web"))
    kubelet.settle()
    assert kube_api.list(*REPLICASETS, NS) == []
    pods = kubelet.pods()
    assert len(pods) == 2 and all(p["metadata"]["deletionTimestamp"] for p in pods)
    for p in pods:
        kubelet.finish(p)
    kubelet.settle()
    assert kubelet.pods() == []


def test_kubectl_agrees_with_the_controllers(kube_api, kubelet, kubectl):
    kube_api.install(deployment(replicas=2))
    kubelet.settle()
    out = kubectl("rollout", "status", "deploy/web", "--timeout=1s", check=False)
    assert out.returncode != 0 and "0 of 2 updated replicas are available" in out.stdout
    for p in kubelet.pods():
        kubelet.ready(p)
    kubelet.settle()
    out = kubectl("get", "deploy,rs,pods", "--no-headers").stdout
    lines = out.splitlines()
    deploy = next(line for line in lines if line.startswith("deployment.apps/web "))
    assert deploy.split()[1:4] == ["2/2", "2", "2"]
    rs = next(line for line in lines if line.startswith("replicaset.apps/web-"))
    assert rs.split()[1:4] == ["2", "2", "2"]
    assert sum(1 for line in lines if line.startswith("pod/web-") and " Running " in line) == 2
    assert "successfully rolled out" in kubectl("rollout", "status", "deploy/web").stdout


def test_a_bare_pod_is_bound_to_the_node(kube_api, kubelet, kubectl):
    bare = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "bare", "namespace": NS},
        "spec": {"containers": [{"name": "c", "image": "i"}]},
    }
    other = copy.deepcopy(bare)
    other["metadata"]["name"] = "elsewhere"
    other["spec"]["schedulerName"] = "volcano"
    kube_api.install(bare, other)
    kubelet.settle()
    pods = {p["metadata"]["name"]: p for p in kubelet.pods()}
    assert pods["bare"]["spec"]["nodeName"] == NODE_NAME
    (scheduled,) = pods["bare"]["status"]["conditions"]
    assert (scheduled["type"], scheduled["status"]) == ("PodScheduled", "True")
    assert "nodeName" not in pods["elsewhere"]["spec"]  # another scheduler's pod


# ---- DaemonSet ----------------------------------------------------------------------


def test_a_daemonset_runs_one_pod_and_replaces_it_on_a_template_change(kube_api, kubelet):
    ds = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "store", "namespace": NS},
        "spec": {
            "selector": {"matchLabels": {"app": "store"}},
            "template": {
                "metadata": {"labels": {"app": "store"}},
                "spec": {"containers": [{"name": "c", "image": "s:1"}]},
            },
        },
    }
    kube_api.install(ds)
    kubelet.settle()
    (first,) = kubelet.pods()
    assert first["spec"]["nodeName"] == NODE_NAME
    kubelet.ready(first)
    kubelet.settle()
    status = kube_api.get("apps", "v1", "daemonsets", NS, "store")["status"]
    assert status["desiredNumberScheduled"] == 1 and status["numberReady"] == 1
    assert status["updatedNumberScheduled"] == 1
    edit(kube_api, ("apps", "v1", "daemonsets"), "store", set_image("s:2"))
    kubelet.settle()
    pods = kubelet.pods()
    old = next(p for p in pods if p["metadata"]["name"] == first["metadata"]["name"])
    assert old["metadata"]["deletionTimestamp"]
    (new,) = active(pods)
    assert new["spec"]["containers"][0]["image"] == "s:2"
    status = kube_api.get("apps", "v1", "daemonsets", NS, "store")["status"]
    assert status["numberReady"] == 0 and status["updatedNumberScheduled"] == 1


# ---- LeaderWorkerSet ----------------------------------------------------------------


def test_a_leaderworkerset_makes_groups_with_the_lws_env(kube_api, kubelet, kubectl):
    kube_api.install(*foreign_crds())
    template = {
        "spec": {
            "containers": [{"name": "c", "image": "e:1", "env": [{"name": "X", "value": "1"}]}]
        }
    }
    kube_api.install(
        {
            "apiVersion": "leaderworkerset.x-k8s.io/v1",
            "kind": "LeaderWorkerSet",
            "metadata": {"name": "eng", "namespace": NS},
            "spec": {
                "replicas": 2,
                "leaderWorkerTemplate": {"size": 2, "workerTemplate": template},
            },
        }
    )
    kubelet.settle()
    pods = {p["metadata"]["name"]: p for p in kubelet.pods()}
    assert sorted(pods) == ["eng-0", "eng-0-1", "eng-1", "eng-1-1"]
    for name, p in pods.items():
        group, worker = name.split("-")[1], (name.split("-")[2:] or ["0"])[0]
        labels = p["metadata"]["labels"]
        assert labels["leaderworkerset.sigs.k8s.io/name"] == "eng"
        assert labels["leaderworkerset.sigs.k8s.io/group-index"] == group
        assert labels["leaderworkerset.sigs.k8s.io/worker-index"] == worker
        env = {e["name"]: e["value"] for e in p["spec"]["containers"][0]["env"]}
        assert env == {
            "LWS_LEADER_ADDRESS": f"eng-{group}.eng.{NS}",
            "LWS_GROUP_SIZE": "2",
            "LWS_WORKER_INDEX": worker,
            "X": "1",
        }
        assert (p["spec"]["hostname"], p["spec"]["subdomain"]) == (name, "eng")
    svc = kube_api.get("", "v1", "services", NS, "eng")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    for p in pods.values():
        kubelet.ready(p)
    kubelet.settle()
    lws = kube_api.get(*LWS, NS, "eng")
    assert lws["status"]["readyReplicas"] == 2
    kubectl("scale", "leaderworkerset/eng", "--replicas", "1")
    kubelet.settle()
    going = [p for p in kubelet.pods() if p["metadata"].get("deletionTimestamp")]
    assert [p["metadata"]["name"] for p in going] == ["eng-1"]
    kubelet.finish(going[0])
    kubelet.settle()
    # The worker follows its leader (owner reference), gracefully too.
    (worker,) = [p for p in kubelet.pods() if p["metadata"].get("deletionTimestamp")]
    assert worker["metadata"]["name"] == "eng-1-1"
    kubelet.finish(worker)
    kubelet.settle()
    assert sorted(p["metadata"]["name"] for p in kubelet.pods()) == ["eng-0", "eng-0-1"]
    assert kube_api.get(*LWS, NS, "eng")["status"]["replicas"] == 1
