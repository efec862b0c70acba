"""The fake API server's Kubernetes semantics, over real HTTP (httpx, kubectl).

No mocks: a real aiohttp server (kmock's) and the real kubectl binary.
"""

from __future__ import annotations

import datetime as dt
import json
import threading

import httpx
import pytest

NS = "/api/v1/namespaces/default"
DEPLOY = "/apis/apps/v1/namespaces/default/deployments"
POOLS = "/apis/tandem.dev/v1alpha1/namespaces/default/enginepools"
MERGE = {"Content-Type": "application/merge-patch+json"}
JSONP = {"Content-Type": "application/json-patch+json"}


def deployment(name: str = "web", replicas: int = 1, **labels: str) -> dict:
    lbls = {"app": name, **labels}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": lbls},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{"name": "c", "image": "i"}]},
            },
        },
    }


def pool(name: str = "p-decode", replicas: int = 1) -> dict:
    return {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "EnginePool",
        "metadata": {"name": name},
        "spec": {"deployment": "p", "role": "decode", "replicas": replicas},
    }


@pytest.fixture
def http(kube_api):
    with httpx.Client(base_url=kube_api.url, timeout=10) as client:
        yield client


def test_every_write_bumps_resource_version_and_stale_writes_conflict(http):
    created = http.post(DEPLOY, json=deployment()).json()
    rv0 = int(created["metadata"]["resourceVersion"])
    patched = http.patch(f"{DEPLOY}/web", json={"spec": {"replicas": 2}}, headers=MERGE).json()
    assert int(patched["metadata"]["resourceVersion"]) > rv0
    stale = dict(created, spec=dict(created["spec"], replicas=5))
    r = http.put(f"{DEPLOY}/web", json=stale)
    assert r.status_code == 409 and r.json()["reason"] == "Conflict"
    r = http.patch(
        f"{DEPLOY}/web",
        headers=MERGE,
        json={"metadata": {"resourceVersion": str(rv0)}, "spec": {"replicas": 7}},
    )
    assert r.status_code == 409
    assert http.get(f"{DEPLOY}/web").json()["spec"]["replicas"] == 2
    # A write that changes nothing is no write: same resourceVersion.
    again = http.patch(f"{DEPLOY}/web", json={"spec": {"replicas": 2}}, headers=MERGE).json()
    assert again["metadata"]["resourceVersion"] == patched["metadata"]["resourceVersion"]
    assert http.post(DEPLOY, json=deployment()).status_code == 409  # AlreadyExists


def test_json_patch_test_op_on_resource_version_fails_with_422(http):
    obj = http.post(DEPLOY, json=deployment()).json()
    rv = obj["metadata"]["resourceVersion"]
    ok = http.patch(
        f"{DEPLOY}/web",
        headers=JSONP,
        json=[
            {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
            {"op": "add", "path": "/metadata/finalizers", "value": ["x/y"]},
        ],
    )
    assert ok.status_code == 200 and ok.json()["metadata"]["finalizers"] == ["x/y"]
    failed = http.patch(
        f"{DEPLOY}/web",
        headers=JSONP,
        json=[
            {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
            {"op": "remove", "path": "/metadata/finalizers"},
        ],
    )
    assert failed.status_code == 422
    assert http.get(f"{DEPLOY}/web").json()["metadata"]["finalizers"] == ["x/y"]


def test_generation_moves_with_spec_only_and_status_is_its_own_endpoint(http):
    http.post(POOLS, json=pool(), headers={})
    labelled = http.patch(
        f"{POOLS}/p-decode", headers=MERGE, json={"metadata": {"labels": {"a": "b"}}}
    ).json()
    assert labelled["metadata"]["generation"] == 1
    # The main endpoint ignores status; /status ignores everything else.
    main = http.patch(
        f"{POOLS}/p-decode",
        headers=MERGE,
        json={"spec": {"replicas": 2}, "status": {"readyReplicas": 9}},
    ).json()
    assert main["metadata"]["generation"] == 2 and "status" not in main
    status = http.patch(
        f"{POOLS}/p-decode/status",
        headers=MERGE,
        json={"spec": {"replicas": 5}, "status": {"readyReplicas": 1}},
    ).json()
    assert status["status"] == {"readyReplicas": 1}
    assert status["spec"]["replicas"] == 2 and status["metadata"]["generation"] == 2


def test_scale_subresource_reads_and_writes_the_crd_paths(http):
    http.post(POOLS, json=pool(replicas=1))
    http.patch(
        f"{POOLS}/p-decode/status",
        headers=MERGE,
        json={"status": {"replicas": 1, "selector": "tandem.dev/role=decode"}},
    )
    scale = http.get(f"{POOLS}/p-decode/scale").json()
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 1
    assert scale["status"] == {"replicas": 1, "selector": "tandem.dev/role=decode"}
    scale["spec"]["replicas"] = 3
    assert http.put(f"{POOLS}/p-decode/scale", json=scale).json()["spec"]["replicas"] == 3
    assert http.get(f"{POOLS}/p-decode").json()["spec"]["replicas"] == 3
    # The CRD's own validation still applies through /scale.
    r = http.patch(f"{POOLS}/p-decode/scale", headers=MERGE, json={"spec": {"replicas": 99}})
    assert r.status_code == 422 and "between minReplicas and maxReplicas" in r.text


def test_custom_resources_are_pruned_defaulted_and_validated_with_cel(http):
    created = http.post(POOLS, json={**pool(), "spec": {**pool()["spec"], "bogus": 1}}).json()
    assert "bogus" not in created["spec"]
    assert created["spec"]["minReplicas"] == 0 and created["spec"]["maxReplicas"] == 16
    r = http.post(POOLS, json=pool("p2", replicas=-1))
    assert r.status_code == 422 and "spec.replicas" in r.text
    # A transition rule (oldSelf) runs on updates only.
    r = http.patch(f"{POOLS}/p-decode", headers=MERGE, json={"spec": {"role": "prefill"}})
    assert r.status_code == 422 and "role is immutable" in r.text
    # PUT of a custom resource must carry its resourceVersion.
    body = http.get(f"{POOLS}/p-decode").json()
    del body["metadata"]["resourceVersion"]
    assert http.put(f"{POOLS}/p-decode", json=body).status_code == 422


def test_builtins_are_validated_against_the_kubernetes_schema(http):
    bad = deployment()
    bad["spec"]["replicaz"] = 1
    r = http.post(DEPLOY, json=bad)
    assert r.status_code == 422 and "replicaz" in r.text


def test_label_and_field_selectors(http):
    http.post(DEPLOY, json=deployment("a", tier="x"))
    http.post(DEPLOY, json=deployment("b", tier="y"))

    def names(r):
        return [i["metadata"]["name"] for i in r.json()["items"]]

    assert names(http.get(DEPLOY, params={"labelSelector": "tier=x"})) == ["a"]
    assert names(http.get(DEPLOY, params={"labelSelector": "tier in (x,y),tier!=y"})) == ["a"]
    assert names(http.get(DEPLOY, params={"labelSelector": "!tier"})) == []
    assert names(http.get(DEPLOY, params={"fieldSelector": "metadata.name=b"})) == ["b"]
    assert http.get(DEPLOY).json()["kind"] == "DeploymentList"


def _watch(kube_api, path: str, params: dict, count: int) -> list[dict]:
    events: list[dict] = []
    with httpx.stream(
        "GET", kube_api.url + path, params={"watch": "true", **params}, timeout=10
    ) as r:
        for line in r.iter_lines():
            if line:
                events.append(json.loads(line))
            if len(events) >= count:
                break
    return events


def test_watch_resumes_from_a_resource_version_with_bookmarks_and_label_filtering(http, kube_api):
    rv = http.get(DEPLOY).json()["metadata"]["resourceVersion"]
    http.post(DEPLOY, json=deployment("a", tier="x"))
    http.post(DEPLOY, json=deployment("b", tier="y"))
    http.patch(f"{DEPLOY}/a", headers=MERGE, json={"metadata": {"labels": {"tier": "z"}}})
    events = _watch(
        kube_api,
        DEPLOY,
        {"resourceVersion": rv, "labelSelector": "tier=x", "allowWatchBookmarks": "true"},
        3,
    )
    assert [e["type"] for e in events[:2]] == ["ADDED", "DELETED"]  # left the selector
    assert events[2]["type"] == "BOOKMARK"
    assert int(events[2]["object"]["metadata"]["resourceVersion"]) >= int(rv) + 3


def test_boolean_query_parameters_read_as_the_api_server_reads_them(http, kube_api):
    http.post(DEPLOY, json=deployment())
    for value in ("true", "True", "1"):  # "True": kubernetes_asyncio sends Python's str(True)
        assert _watch(kube_api, DEPLOY, {"watch": value}, 1)[0]["type"] == "ADDED"
    for value in ("false", "False", "0", ""):
        assert http.get(DEPLOY, params={"watch": value}).json()["kind"] == "DeploymentList"


def test_watch_from_a_compacted_resource_version_gets_410(http, kube_api):
    rv = http.post(DEPLOY, json=deployment()).json()["metadata"]["resourceVersion"]
    http.patch(f"{DEPLOY}/web", headers=MERGE, json={"spec": {"replicas": 3}})
    kube_api.call(kube_api.store.compact)
    events = _watch(kube_api, DEPLOY, {"resourceVersion": rv}, 1)
    assert events[0]["type"] == "ERROR" and events[0]["object"]["code"] == 410


def test_watch_sees_writes_made_while_it_is_open(http, kube_api):
    rv = http.get(DEPLOY).json()["metadata"]["resourceVersion"]
    writer = threading.Timer(
        0.3, lambda: httpx.post(kube_api.url + DEPLOY, json=deployment("late"))
    )
    writer.start()
    events = _watch(kube_api, DEPLOY, {"resourceVersion": rv}, 1)
    writer.join()
    assert events[0]["type"] == "ADDED" and events[0]["object"]["metadata"]["name"] == "late"


def test_finalizers_hold_deletion_until_removed(http):
    body = deployment()
    body["metadata"]["finalizers"] = ["example.com/hold"]
    http.post(DEPLOY, json=body)
    deleting = http.delete(f"{DEPLOY}/web").json()
    assert deleting["metadata"]["deletionTimestamp"]
    assert http.get(f"{DEPLOY}/web").status_code == 200
    r = http.patch(
        f"{DEPLOY}/web",
        headers=MERGE,
        json={"metadata": {"finalizers": ["example.com/hold", "new/one"]}},
    )
    assert r.status_code == 422  # no new finalizers on a deleting object
    http.patch(f"{DEPLOY}/web", headers=MERGE, json={"metadata": {"finalizers": None}})
    assert http.get(f"{DEPLOY}/web").status_code == 404


def _owned(owner: dict, name: str) -> dict:
    body = deployment(name)
    body["metadata"]["ownerReferences"] = [
        {
            "apiVersion": owner["apiVersion"],
            "kind": owner["kind"],
            "name": owner["metadata"]["name"],
            "uid": owner["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    return body


@pytest.mark.parametrize(
    "policy,survives", [("Background", False), ("Foreground", False), ("Orphan", True)]
)
def test_owner_reference_garbage_collection(http, policy, survives):
    owner = http.post(POOLS, json=pool()).json()
    http.post(DEPLOY, json=_owned(owner, "child"))
    http.delete(f"{POOLS}/p-decode", params={"propagationPolicy": policy})
    assert http.get(f"{POOLS}/p-decode").status_code == 404
    child = http.get(f"{DEPLOY}/child")
    assert (child.status_code == 200) == survives
    if survives:
        assert "ownerReferences" not in child.json()["metadata"]


def test_an_object_created_for_a_gone_owner_is_collected(http):
    owner = http.post(POOLS, json=pool()).json()
    http.delete(f"{POOLS}/p-decode")
    assert http.post(DEPLOY, json=_owned(owner, "late")).status_code == 201
    assert http.get(f"{DEPLOY}/late").status_code == 404


def test_scheduled_pods_terminate_gracefully_unscheduled_go_at_once(http):
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p"},
        "spec": {"containers": [{"name": "c", "image": "i"}]},
    }
    http.post(f"{NS}/pods", json=pod)
    http.delete(f"{NS}/pods/p")
    assert http.get(f"{NS}/pods/p").status_code == 404
    pod["spec"]["nodeName"] = "node-1"
    pod["spec"]["terminationGracePeriodSeconds"] = 60
    http.post(f"{NS}/pods", json=pod)
    terminating = http.delete(f"{NS}/pods/p").json()
    assert terminating["metadata"]["deletionGracePeriodSeconds"] == 60
    assert http.get(f"{NS}/pods/p").status_code == 200  # the kubelet's turn
    # A second delete may shorten the grace period, never lengthen it.
    assert (
        http.delete(f"{NS}/pods/p", params={"gracePeriodSeconds": "90"}).json()["metadata"][
            "deletionGracePeriodSeconds"
        ]
        == 60
    )
    shorter = http.delete(f"{NS}/pods/p", params={"gracePeriodSeconds": "5"}).json()
    assert shorter["metadata"]["deletionGracePeriodSeconds"] == 5
    # deletionTimestamp is when it is to be gone: 55 s sooner now.
    was = dt.datetime.fromisoformat(terminating["metadata"]["deletionTimestamp"])
    now = dt.datetime.fromisoformat(shorter["metadata"]["deletionTimestamp"])
    assert was - now == dt.timedelta(seconds=55)
    created = dt.datetime.fromisoformat(terminating["metadata"]["creationTimestamp"])
    assert dt.timedelta(seconds=59) <= was - created <= dt.timedelta(seconds=62)
    http.delete(f"{NS}/pods/p", params={"gracePeriodSeconds": "0"})
    assert http.get(f"{NS}/pods/p").status_code == 404


def test_kubectl_works_against_it(kubectl, kube_api):
    kubectl("create", "-f", "-", stdin=json.dumps(pool()))
    table = kubectl("get", "enginepools").stdout.splitlines()
    assert table[0].split() == ["NAME", "ROLE", "DESIRED", "READY", "DRAINING", "AGE"]
    assert table[1].split()[:3] == ["p-decode", "decode", "1"]
    kubectl("scale", "enginepool/p-decode", "--replicas", "3")
    assert (
        kube_api.get("tandem.dev", "v1alpha1", "enginepools", "default", "p-decode")["spec"][
            "replicas"
        ]
        == 3
    )
    refused = kubectl("scale", "enginepool/p-decode", "--replicas", "40", check=False)
    assert refused.returncode != 0 and "between minReplicas and maxReplicas" in refused.stderr
    changed = json.loads(json.dumps(pool()))
    changed["spec"]["maxReplicas"] = 4
    changed["spec"]["replicas"] = 3
    kubectl("apply", "-f", "-", stdin=json.dumps(changed))
    got = kubectl("get", "epool", "p-decode", "-o", "jsonpath={.spec.maxReplicas}").stdout
    assert got == "4"
    kubectl("delete", "enginepool", "p-decode")
    assert "No resources found" in kubectl("get", "enginepools").stderr


def test_requests_are_recorded_for_tests_and_not_by_a_long_running_server():
    from devcluster.apiserver import running

    for keep, expected in ((True, 3), (False, 0)):
        with running(keep_requests=keep) as server:
            httpx.get(server.url + "/api/v1/namespaces")  # served apart from kmock's parser
            httpx.get(server.url + DEPLOY)
            httpx.get(server.url + f"{NS}/configmaps")
            assert len(list(server.handler)) == expected
