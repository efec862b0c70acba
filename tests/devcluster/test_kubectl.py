"""What a new user does with the real kubectl against the local API server:
namespaces, field validation, tables, events in describe, `get all`, the
server's version. Each test is one gap a new user met (issue 26).

No mocks: the real kubectl binary over HTTP (and httpx where kubectl hides
the status code).
"""

from __future__ import annotations

import datetime as dt
import json

import httpx
import pytest

TD = """
apiVersion: tandem.dev/v1alpha1
kind: TandemDeployment
metadata: {name: demo}
spec:
  model: {path: /models/llama}
  prefill: {replicas: 1}
  decode: {replicas: 1, replicaz: 3}
"""

WEB = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: web, namespace: NS}
spec:
  replicas: 2
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec: {containers: [{name: c, image: nginx:1.27}]}
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: NS}
spec:
  selector: {app: web}
  ports: [{port: 80, targetPort: 8080}]
"""


def web(namespace: str = "default") -> str:
    return WEB.replace("NS", namespace)


def rows(text: str) -> list[list[str]]:
    return [line.split() for line in text.splitlines() if line.strip()]


@pytest.fixture
def http(kube_api):
    with httpx.Client(base_url=kube_api.url, timeout=10) as client:
        yield client


def test_namespaces_are_created_listed_and_deleted_with_their_objects(kubectl, http):
    kubectl("create", "namespace", "team-a")  # a protobuf body, as kubectl sends it
    listed = http.get("/api/v1/namespaces")
    assert listed.status_code == 200 and listed.json()["kind"] == "NamespaceList"
    assert "team-a" in {ns["metadata"]["name"] for ns in listed.json()["items"]}
    table = rows(kubectl("get", "ns").stdout)
    assert table[0] == ["NAME", "STATUS", "AGE"]
    assert next(r for r in table if r[0] == "team-a")[:2] == ["team-a", "Active"]
    assert kubectl("get", "ns", "team-a", "-o", "jsonpath={.status.phase}").stdout == "Active"

    kubectl("create", "configmap", "settings", "--from-literal=a=b", "-n", "team-a")
    kubectl("create", "secret", "generic", "token", "--from-literal=k=v", "-n", "team-a")
    kubectl("apply", "-f", "-", stdin=web("team-a"))
    assert rows(kubectl("get", "cm", "-n", "team-a").stdout)[1][:2] == ["settings", "1"]
    assert rows(kubectl("get", "secret", "-n", "team-a").stdout)[1][:3] == [
        "token",
        "Opaque",
        "1",
    ]

    # A finalizer holds one object: the namespace stays Terminating and takes no new content.
    kubectl("patch", "cm", "settings", "-n", "team-a", "-p", '{"metadata":{"finalizers":["x/y"]}}')
    kubectl("delete", "ns", "team-a", "--wait=false")
    assert kubectl("get", "ns", "team-a", "-o", "jsonpath={.status.phase}").stdout == "Terminating"
    assert http.get("/apis/apps/v1/namespaces/team-a/deployments/web").status_code == 404
    refused = kubectl("create", "configmap", "late", "-n", "team-a", check=False)
    assert refused.returncode != 0 and "being terminated" in refused.stderr
    kubectl(
        "patch",
        "cm",
        "settings",
        "-n",
        "team-a",
        "--type=merge",
        "-p",
        '{"metadata":{"finalizers":null}}',
    )
    assert http.get("/api/v1/namespaces/team-a").status_code == 404
    assert "team-a" not in kubectl("get", "ns").stdout

    refused = kubectl("delete", "ns", "default", check=False)
    assert refused.returncode != 0 and "may not be deleted" in refused.stderr


def test_strict_field_validation_refuses_unknown_fields_warn_and_ignore_prune(kubectl, http):
    strict = kubectl("apply", "-f", "-", stdin=TD, check=False)  # kubectl sends Strict
    assert strict.returncode != 0
    assert "Error from server (BadRequest)" in strict.stderr
    assert 'unknown field "spec.decode.replicaz"' in strict.stderr
    assert "No resources found" in kubectl("get", "td").stderr

    warned = kubectl("apply", "--validate=warn", "-f", "-", stdin=TD)
    assert 'Warning: unknown field "spec.decode.replicaz"' in warned.stderr
    spec = json.loads(kubectl("get", "td", "demo", "-o", "json").stdout)["spec"]
    assert "replicaz" not in spec["decode"]
    kubectl("delete", "td", "demo")

    ignored = kubectl("apply", "--validate=false", "-f", "-", stdin=TD)
    assert "unknown field" not in ignored.stderr

    # The same for a built-in kind, over HTTP: 400 naming the field.
    bad = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "c"},
        "data": {},
        "datta": {},
    }
    r = http.post("/api/v1/namespaces/default/configmaps?fieldValidation=Strict", json=bad)
    assert r.status_code == 400 and r.json()["reason"] == "BadRequest"
    assert 'unknown field "datta"' in r.json()["message"]
    r = http.post("/api/v1/namespaces/default/configmaps?fieldValidation=Sloppy", json=bad)
    assert r.status_code == 400 and "fieldValidation" in r.json()["message"]


def test_builtin_kinds_have_kubectls_columns(kubectl, kube_api):
    kubectl("apply", "-f", "-", stdin=web())
    wide = rows(kubectl("get", "deploy", "-o", "wide").stdout)
    assert wide[0] == [
        "NAME",
        "READY",
        "UP-TO-DATE",
        "AVAILABLE",
        "AGE",
        "CONTAINERS",
        "IMAGES",
        "SELECTOR",
    ]
    assert wide[1][:4] + wide[1][5:] == ["web", "0/2", "0", "0", "c", "nginx:1.27", "app=web"]
    svc = rows(kubectl("get", "svc", "web").stdout)
    assert svc[0] == ["NAME", "TYPE", "CLUSTER-IP", "EXTERNAL-IP", "PORT(S)", "AGE"]
    assert svc[1][:2] == ["web", "ClusterIP"] and svc[1][3:5] == ["<none>", "80/TCP"]

    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "web-1"},
        "spec": {"nodeName": "node-1", "containers": [{"name": "c", "image": "nginx"}]},
    }
    kubectl("create", "-f", "-", stdin=json.dumps(pod))
    kube_api.call(
        lambda: kube_api.store.patch(
            kube_api.store.kind("", "v1", "pods"),
            "default",
            "web-1",
            {
                "status": {
                    "phase": "Running",
                    "podIP": "127.0.0.1",
                    "containerStatuses": [
                        {
                            "name": "c",
                            "ready": True,
                            "restartCount": 2,
                            "image": "nginx",
                            "imageID": "",
                            "state": {"running": {}},
                        }
                    ],
                }
            },
            "application/merge-patch+json",
            "status",
        )
    )
    pods = rows(kubectl("get", "pods", "-o", "wide").stdout)
    assert pods[0][:6] == ["NAME", "READY", "STATUS", "RESTARTS", "AGE", "IP"]
    assert pods[1][:4] == ["web-1", "1/1", "Running", "2"] and pods[1][5:7] == [
        "127.0.0.1",
        "node-1",
    ]

    slice_ = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": "web-abc", "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": True}}],
    }
    kubectl("create", "-f", "-", stdin=json.dumps(slice_))
    slices = rows(kubectl("get", "endpointslices").stdout)
    assert slices[0] == ["NAME", "ADDRESSTYPE", "PORTS", "ENDPOINTS", "AGE"]
    assert slices[1][:4] == ["web-abc", "IPv4", "8080", "127.0.0.1"]
    kubectl("create", "configmap", "two", "--from-literal=a=1", "--from-literal=b=2")
    assert rows(kubectl("get", "cm", "two").stdout)[0] == ["NAME", "DATA", "AGE"]
    assert rows(kubectl("get", "cm", "two").stdout)[1][:2] == ["two", "2"]


def test_describe_shows_the_objects_events(kubectl, http):
    kubectl("apply", "-f", "-", stdin=web())
    uid = http.get("/apis/apps/v1/namespaces/default/deployments/web").json()["metadata"]["uid"]
    now = dt.datetime.now(dt.UTC).isoformat()  # kopf's timestamps: microseconds, +00:00

    def event(reason: str, name: str, uid: str) -> dict:
        # What kopf posts (kopf/_cogs/clients/events.py).
        return {
            "metadata": {"namespace": "default", "generateName": "kopf-event-"},
            "action": "Action?",
            "type": "Normal",
            "reason": reason,
            "message": f"{reason} happened",
            "reportingComponent": "kopf",
            "reportingInstance": "dev",
            "source": {"component": "kopf"},
            "involvedObject": {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "name": name,
                "uid": uid,
                "namespace": "default",
            },
            "firstTimestamp": now,
            "lastTimestamp": now,
            "eventTime": now,
        }

    for body in (event("Scaled", "web", uid), event("Other", "api", "uid-of-another")):
        assert http.post("/api/v1/namespaces/default/events", json=body).status_code == 201
    described = kubectl("describe", "deploy", "web").stdout
    events = described[described.index("Events:") :]
    assert "Scaled" in events and "Scaled happened" in events and "kopf" in events
    assert "Other" not in events

    selected = http.get(
        "/api/v1/namespaces/default/events",
        params={"fieldSelector": f"involvedObject.uid={uid},involvedObject.kind=Deployment"},
    ).json()["items"]
    assert [e["reason"] for e in selected] == ["Scaled"]
    assert rows(kubectl("get", "events").stdout)[0] == [
        "LAST",
        "SEEN",
        "TYPE",
        "REASON",
        "OBJECT",
        "MESSAGE",
    ]
    r = http.get("/api/v1/namespaces/default/events", params={"fieldSelector": "spec.x=1"})
    assert r.status_code == 400
    assert r.json()["message"] == 'field label not supported: "spec.x"'


def test_get_all_lists_the_workloads_kinds(kubectl):
    kubectl("apply", "-f", "-", stdin=web())
    pool = {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "EnginePool",
        "metadata": {"name": "p-decode"},
        "spec": {"deployment": "p", "role": "decode", "replicas": 1},
    }
    kubectl("create", "-f", "-", stdin=json.dumps(pool))
    listed = kubectl("get", "all").stdout
    assert "deployment.apps/web" in listed and "service/web" in listed
    assert "enginepool" not in listed  # the CRD puts it in "tandem", not "all"
    assert "enginepool.tandem.dev/p-decode" in kubectl("get", "tandem").stdout


def test_the_server_reports_the_release_its_schemas_are_from(kubectl):
    # Built-ins are validated against Kubernetes 1.32 (devcluster/store.py);
    # the chart requires >= 1.30.
    version = json.loads(kubectl("version", "-o", "json").stdout)["serverVersion"]
    assert (version["major"], version["minor"]) == ("1", "32")
