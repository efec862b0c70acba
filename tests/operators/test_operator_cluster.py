"""The operator as a real process (`python -m operators`, kopf) against the fake API
server over HTTP, driven with the real kubectl. No mocks; no kube-controller-manager
either, so nothing creates pods: the tests look at what the operator writes."""

from __future__ import annotations

import json
import time

import pytest

from tests.kube.plugin import running_operator, start_operator, wait_for

TD = """
apiVersion: tandem.dev/v1alpha1
kind: TandemDeployment
metadata: {name: demo}
spec:
  model: {path: /models/llama}
  prefill: {replicas: 1}
  decode: {replicas: 2}
"""
WORKLOADS = {"demo-router", "demo-redis", "demo-kvstore-master", "demo-prefill", "demo-decode"}


def deployments(api) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in api.list("apps", "v1", "deployments", "default")}


def td_status(api) -> dict:
    return api.get("tandem.dev", "v1alpha1", "tandemdeployments", "default", "demo").get(
        "status", {}
    )


def condition(status: dict, kind: str) -> dict:
    return next((c for c in status.get("conditions", []) if c["type"] == kind), {})


def events(api, reason: str) -> list[dict]:
    return [e for e in api.list("", "v1", "events", "default") if e.get("reason") == reason]


@pytest.fixture
def operator(kube_api, tmp_path):
    with running_operator(kube_api, tmp_path) as proc:
        yield proc


def test_create_scale_update_foreign_edit_and_delete(kube_api, kubectl, operator):
    started = time.monotonic()
    kubectl("create", "-f", "-", stdin=TD)
    wait_for(lambda: set(deployments(kube_api)) >= WORKLOADS, what="workloads")
    print(
        f"\nreconcile latency, create -> {len(WORKLOADS)} Deployments written: "
        f"{time.monotonic() - started:.2f}s"
    )
    td = kube_api.get("tandem.dev", "v1alpha1", "tandemdeployments", "default", "demo")
    for obj in deployments(kube_api).values():
        assert [o["uid"] for o in obj["metadata"]["ownerReferences"]] == [td["metadata"]["uid"]]
    assert deployments(kube_api)["demo-decode"]["spec"]["replicas"] == 2
    status = wait_for(
        lambda: td_status(kube_api).get("decode") and td_status(kube_api), what="status"
    )
    assert status["observedGeneration"] == td["metadata"]["generation"]
    assert status["ratio"] == "1:2" and condition(status, "Ready")["status"] == "False"
    table = kubectl("get", "td").stdout.splitlines()
    assert table[0].split() == ["NAME", "PREFILL", "DECODE", "P:D", "MODE", "READY", "AGE"]
    assert table[1].split()[:6] == ["demo", "0/1", "0/2", "1:2", "Off", "False"]

    # kubectl scale on the pool: the operator follows.
    started = time.monotonic()
    kubectl("scale", "enginepool/demo-decode", "--replicas", "3")
    wait_for(
        lambda: deployments(kube_api)["demo-decode"]["spec"]["replicas"] == 3,
        what="decode scaled to 3",
    )
    print(
        f"reconcile latency, kubectl scale -> Deployment replicas: "
        f"{time.monotonic() - started:.2f}s"
    )

    # A spec change: the pool template's count is copied over once, the model everywhere.
    started = time.monotonic()
    kubectl(
        "patch",
        "td",
        "demo",
        "--type=merge",
        "-p",
        json.dumps({"spec": {"decode": {"replicas": 4}, "model": {"path": "/models/v2"}}}),
    )
    wait_for(
        lambda: (
            deployments(kube_api)["demo-decode"]["spec"]["replicas"] == 4
            and "--model=/models/v2"
            in deployments(kube_api)["demo-prefill"]["spec"]["template"]["spec"]["containers"][0][
                "args"
            ]
        ),
        what="update applied",
    )
    print(f"reconcile latency, spec change -> workloads updated: {time.monotonic() - started:.2f}s")
    generation = kube_api.get("tandem.dev", "v1alpha1", "tandemdeployments", "default", "demo")[
        "metadata"
    ]["generation"]
    wait_for(
        lambda: td_status(kube_api).get("observedGeneration") == generation,
        what="observedGeneration",
    )

    # A foreign edit is put back and reported.
    kubectl("scale", "deployment/demo-router", "--replicas", "7")
    wait_for(
        lambda: deployments(kube_api)["demo-router"]["spec"]["replicas"] == 2,
        what="router replicas put back",
    )
    edits = wait_for(lambda: events(kube_api, "ForeignEditReverted"), what="event")
    assert "Deployment/demo-router" in edits[0]["message"]
    assert "spec.replicas" in edits[0]["message"]

    # Deleting the deployment collects everything it owns, pools' workloads included.
    kubectl("delete", "td", "demo")
    assert deployments(kube_api) == {}
    assert kube_api.list("tandem.dev", "v1alpha1", "enginepools", "default") == []
    assert kube_api.list("", "v1", "services", "default") == []


def test_foreign_hpa_on_a_pool_workload_is_reported_not_fought(kube_api, kubectl, operator):
    kubectl("create", "-f", "-", stdin=TD)
    wait_for(lambda: "demo-decode" in deployments(kube_api), what="decode pool")
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "decode-cpu"},
        "spec": {
            "scaleTargetRef": {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "name": "demo-decode",
            },
            "minReplicas": 1,
            "maxReplicas": 5,
        },
    }
    kubectl("create", "-f", "-", stdin=json.dumps(hpa))
    pool = wait_for(
        lambda: (
            condition(
                kube_api.get("tandem.dev", "v1alpha1", "enginepools", "default", "demo-decode").get(
                    "status", {}
                ),
                "ScalingConflict",
            ).get("status")
            == "True"
            and kube_api.get("tandem.dev", "v1alpha1", "enginepools", "default", "demo-decode")
        ),
        what="conflict condition",
    )
    message = condition(pool["status"], "ScalingConflict")["message"]
    assert "decode-cpu" in message and "enginepool/demo-decode" in message
    wait_for(
        lambda: condition(td_status(kube_api), "Degraded").get("status") == "True", what="Degraded"
    )
    # The HPA (here: a person acting for it) moves the Deployment; the operator leaves it.
    kubectl("scale", "deployment/demo-decode", "--replicas", "5")
    kubectl("scale", "enginepool/demo-decode", "--replicas", "1")
    operator.wait_passes()  # a whole reconcile since: nothing may put it back
    assert deployments(kube_api)["demo-decode"]["spec"]["replicas"] == 5


def test_invalid_specs_are_refused_with_what_to_fix(kube_api, kubectl, operator, tmp_path):
    bad = TD.replace("decode: {replicas: 2}", "decode: {replicas: 5, maxReplicas: 2}")
    refused = kubectl("create", "-f", "-", stdin=bad, check=False)
    assert refused.returncode != 0
    assert "replicas must lie between minReplicas and maxReplicas" in refused.stderr

    # An API server that does not evaluate CEL (before Kubernetes 1.29) lets it in:
    # the operator refuses to act on it and says why.
    def drop_cel() -> None:
        kind = kube_api.store.kinds[("tandem.dev", "v1alpha1", "tandemdeployments")]
        text = json.dumps(kind.schema)
        kind.schema = json.loads(text.replace('"x-kubernetes-validations"', '"x-ignored"'))

    kube_api.call(drop_cel)
    kubectl("create", "-f", "-", stdin=bad)
    status = wait_for(
        lambda: (
            condition(td_status(kube_api), "Ready").get("reason") == "InvalidSpec"
            and td_status(kube_api)
        ),
        what="InvalidSpec",
    )
    assert (
        "decode.replicas (5) must lie between minReplicas (0) and maxReplicas (2)"
        in condition(status, "Ready")["message"]
    )
    assert "demo-decode" not in deployments(kube_api)
    assert events(kube_api, "InvalidSpec")


def test_restarted_mid_reconcile_converges_to_the_same_objects(kube_api, kubectl, tmp_path):
    first = start_operator(kube_api, tmp_path, name="first")
    try:
        kubectl("create", "-f", "-", stdin=TD)
        wait_for(lambda: deployments(kube_api), what="a first object")
    finally:
        first.stop(kill=True)  # SIGKILL, mid-reconcile
    partial = set(deployments(kube_api))
    second = start_operator(kube_api, tmp_path, name="second")
    try:
        wait_for(lambda: set(deployments(kube_api)) >= WORKLOADS, what="convergence")
        second.wait_passes()  # a whole pass after convergence: settled
        settled = {n: d["metadata"]["resourceVersion"] for n, d in deployments(kube_api).items()}
        second.wait_passes()  # and another pass changes nothing
        assert {
            n: d["metadata"]["resourceVersion"] for n, d in deployments(kube_api).items()
        } == settled
    finally:
        second.stop()
    print(f"\nobjects before the restart: {sorted(partial)}")
    assert deployments(kube_api)["demo-decode"]["spec"]["replicas"] == 2


def pools(api) -> dict[str, dict]:
    return {p["metadata"]["name"]: p for p in api.list("tandem.dev", "v1alpha1", "enginepools")}


def tds(api) -> dict[str, dict]:
    return {
        t["metadata"]["name"]: t for t in api.list("tandem.dev", "v1alpha1", "tandemdeployments")
    }


def test_deleting_needs_no_operator_and_old_finalizers_are_removed(kube_api, kubectl, tmp_path):
    # Deleted while no operator ran, holding the finalizer an older operator put on it.
    old = TD.replace(
        "metadata: {name: demo}",
        "metadata: {name: old, finalizers: [kopf.zalando.org/KopfFinalizerMarker]}",
    )
    kubectl("create", "-f", "-", stdin=old)
    kubectl("delete", "td", "old", "--wait=false")
    assert tds(kube_api)["old"]["metadata"]["deletionTimestamp"]
    with running_operator(kube_api, tmp_path) as operator:
        wait_for(lambda: "old" not in tds(kube_api), what="the old finalizer removed")
        kubectl("create", "-f", "-", stdin=TD)
        wait_for(lambda: set(deployments(kube_api)) >= WORKLOADS, what="workloads")
        operator.wait_passes()
        assert "finalizers" not in tds(kube_api)["demo"]["metadata"]
    # The operator is down: the deletion returns and owner references collect the rest.
    kubectl("delete", "td", "demo", "--timeout=20s")
    assert tds(kube_api) == {} and deployments(kube_api) == {}
    assert kube_api.list("tandem.dev", "v1alpha1", "enginepools", "default") == []


def test_a_pool_without_its_api_is_reported_and_a_deleted_pool_comes_back_as_it_was(
    kube_api, kubectl, operator
):
    # No LeaderWorkerSet CRD in this API server: the prefill pool cannot be created.
    multi_node = (
        "prefill: {replicas: 1, nodesPerReplica: 2, gpusPerPod: 1, parallelism: {pipeline: 2}}"
    )
    kubectl("create", "-f", "-", stdin=TD.replace("prefill: {replicas: 1}", multi_node))
    status = wait_for(
        lambda: (
            condition(td_status(kube_api), "Degraded").get("status") == "True"
            and td_status(kube_api)
        ),
        what="Degraded",
    )
    assert (
        "prefill pool: LeaderWorkerSet is not installed (needed for nodesPerReplica > 1): "
        "install LWS >= 0.6" in condition(status, "Degraded")["message"]
    )
    # The rest is reconciled all the same.
    wait_for(
        lambda: {"demo-router", "demo-kvstore-master", "demo-decode"} <= set(deployments(kube_api)),
        what="the other workloads",
    )
    assert wait_for(lambda: td_status(kube_api).get("decode") == "0/2", what="decode status")

    # Deleting the decode EnginePool leaves its engines; it comes back at its scaled size.
    kubectl("scale", "enginepool/demo-decode", "--replicas", "3")
    wait_for(lambda: deployments(kube_api)["demo-decode"]["spec"]["replicas"] == 3, what="scaled")
    uid = deployments(kube_api)["demo-decode"]["metadata"]["uid"]
    kubectl("delete", "enginepool", "demo-decode")
    pool = wait_for(lambda: pools(kube_api).get("demo-decode"), what="the pool back")
    assert pool["spec"]["replicas"] == 3
    operator.wait_passes()
    decode = deployments(kube_api)["demo-decode"]
    assert decode["metadata"]["uid"] == uid and decode["spec"]["replicas"] == 3
