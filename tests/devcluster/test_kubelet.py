"""The process kubelet and the pod network, as a user meets them: `tandem
cluster up` (as root), bare pods bound to the node created with the real
kubectl, reached over their pod IPs, Service names and loopback ports, and
`tandem cluster down` leaving nothing behind. Needs root and iproute2: where
they are missing the cluster does not start and the tests fail, naming what is
missing. EndpointSlices are written by hand here (the test acts as the
EndpointSlice controller)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from bench.harness import cluster_down, cluster_up
from devcluster.client import LocalCluster, kubectl_binary
from devcluster.kubelet.network import NETNS_PREFIX, VETH_PREFIX
from devcluster.kubelet.podspec import argv_of, expand, image_repository
from tests.localcluster import cluster_fixture

# A bridge and addresses of their own per test process: a user's cluster
# (tandem0, 10.250.0.0/16) and other pytest-xdist workers may run beside.
WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")) % 20
BRIDGE = f"tdtest{os.getpid() % 10000}"
POD_CIDR = f"10.{200 + WORKER}.0.0/16"
DOWN_CIDR = f"10.{220 + WORKER}.0.0/16"


cluster = cluster_fixture(BRIDGE, POD_CIDR, scope="module")


def pod(name: str, container: dict, **spec: object) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {"nodeName": "devcluster-node", "containers": [container], **spec},
    }


def ready(p: dict | None) -> bool:
    conditions = (p or {}).get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def test_pods_reach_each_other_by_service_and_the_host_by_loopback(cluster: LocalCluster):
    web = {
        "name": "web",
        "image": "python:3.11",
        "command": ["python", "-m", "http.server", "8080", "--directory", "/site"],
        "ports": [{"name": "http", "containerPort": 8080}],
        "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
        "volumeMounts": [{"name": "site", "mountPath": "/site", "readOnly": True}],
    }
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "site"},
            "data": {"index.html": "hello from web", "greeting": "hi"},
        },
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "creds"},
            "stringData": {"token": "s3cret"},
        },
        pod("web", web, volumes=[{"name": "site", "configMap": {"name": "site"}}]),
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web"},
            "spec": {
                "selector": {"app": "web"},
                "ports": [{"name": "http", "port": 80, "targetPort": "http"}],
            },
        },
    )
    p = cluster.wait(lambda: (p := cluster.pod("web")) and ready(p) and p)
    assert isinstance(p, dict)
    ip = p["status"]["podIP"]
    assert ip.startswith(POD_CIDR.removesuffix("0.0/16")) and p["status"]["phase"] == "Running"
    assert httpx.get(f"http://{ip}:8080/").text == "hello from web"  # the pod IP is real
    cluster.apply(
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"name": "web-1", "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": [ip], "conditions": {"ready": True}}],
        }
    )
    # The host: through the loopback port recorded for the Service's port.
    services = cluster.state / "services.json"
    entry = cluster.wait(lambda: json.loads(services.read_text()).get("default/web"))
    assert isinstance(entry, dict)
    loopback = entry["ports"]["http"]["loopback"]
    assert f"127.0.0.1:{loopback}" in cluster.log()  # printed
    assert httpx.get(f"http://127.0.0.1:{loopback}/").text == "hello from web"
    cluster.apply(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "Ingress",
            "metadata": {"name": "web"},
            "spec": {
                "rules": [
                    {
                        "http": {
                            "paths": [
                                {
                                    "path": "/",
                                    "pathType": "Prefix",
                                    "backend": {
                                        "service": {"name": "web", "port": {"name": "http"}}
                                    },
                                }
                            ]
                        }
                    }
                ]
            },
        }
    )
    ingress = cluster.wait(lambda: json.loads(services.read_text())["ingresses"].get("default/web"))
    assert isinstance(ingress, dict) and ingress["backend"] == "web:80"
    assert httpx.get(f"http://127.0.0.1:{ingress['loopback']}/").text == "hello from web"

    # Another pod: by the Service's name through its ClusterIP; env from the
    # downward API, a ConfigMap and a Secret, `$(VAR)` expanded.
    script = (
        'echo "ip=$POD_IP name=$POD_NAME greeting=$GREETING token=$TOKEN msg=$MSG"; '
        'python -c "import urllib.request as u; '
        "print(u.urlopen('http://web/').read().decode())\"; "
        'python -c "import urllib.request as u; '
        "print(u.urlopen('http://web.default.svc.cluster.local/').read().decode())\""
    )
    client = {
        "name": "client",
        "image": "python:3.11",
        "command": ["sh", "-c", script],
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {
                "name": "GREETING",
                "valueFrom": {"configMapKeyRef": {"name": "site", "key": "greeting"}},
            },
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
            {"name": "MSG", "value": "$(GREETING) from $(POD_NAME)"},
        ],
    }
    cluster.apply(pod("client", client, restartPolicy="Never"))
    done = cluster.wait(
        lambda: (p := cluster.pod("client")) and p["status"].get("phase") == "Succeeded" and p
    )
    assert isinstance(done, dict)
    logs = cluster.kubectl("logs", "client")
    client_ip = done["status"]["podIP"]
    assert (
        f"ip={client_ip} name=client greeting=hi token=s3cret msg=hi from client\n"
        "hello from web\nhello from web\n"
    ) == logs


def test_liveness_restart_logs_and_graceful_delete(cluster: LocalCluster, tmp_path: Path):
    flag, stopped = tmp_path / "unhealthy", tmp_path / "prestop"
    app = {
        "name": "app",
        "image": "python:3.11",
        # Its hostname is the pod's; SIGTERM is answered by a clean exit.
        "command": [
            "python",
            "-c",
            "import signal, socket, sys, time\n"
            "print('run', socket.gethostname(), flush=True)\n"
            "signal.signal(signal.SIGTERM, lambda *_: sys.exit(print('got SIGTERM')))\n"
            "time.sleep(600)",
        ],
        "livenessProbe": {
            "exec": {"command": ["sh", "-c", f"test ! -e {flag}"]},
            "periodSeconds": 1,
            "failureThreshold": 2,
        },
        "lifecycle": {"preStop": {"exec": {"command": ["sh", "-c", f"echo ran > {stopped}"]}}},
    }
    cluster.apply(pod("flaky", app, terminationGracePeriodSeconds=30))
    cluster.wait(lambda: "run flaky" in cluster.kubectl("logs", "flaky", check=False))
    flag.touch()
    restarted = cluster.wait(
        lambda: (
            (p := cluster.pod("flaky"))
            and p["status"]["containerStatuses"][0]["restartCount"] == 1
            and p
        )
    )
    flag.unlink()
    assert isinstance(restarted, dict)
    # The liveness kill ran preStop and sent SIGTERM, as the kubelet does.
    assert cluster.kubectl("logs", "flaky", "--previous") == "run flaky\ngot SIGTERM\n"
    assert stopped.read_text() == "ran\n"
    stopped.unlink()
    # The new run has started (in the back-off, logs show the run that ended).
    cluster.wait(lambda: cluster.kubectl("logs", "flaky", check=False) == "run flaky\n")

    follow = subprocess.Popen(
        [kubectl_binary(), "--cache-dir", str(cluster.state / "kc"), "logs", "-f", "flaky"],
        env=dict(os.environ, KUBECONFIG=str(cluster.kubeconfig)),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        # Attached before the delete (kubectl starts slowly on a loaded machine).
        assert follow.stdout is not None
        first = follow.stdout.readline()
        assert first == "run flaky\n"
        # kubectl's delete waits until the object is gone: preStop, SIGTERM, then grace 0.
        started = time.monotonic()
        assert 'pod "flaky" deleted' in cluster.kubectl("delete", "pod", "flaky")
        assert time.monotonic() - started < 20  # it exited on SIGTERM, not at the deadline
        assert cluster.pod("flaky") is None
        assert stopped.read_text() == "ran\n"
        rest, _ = follow.communicate(timeout=10)
        assert first + rest == "run flaky\ngot SIGTERM\n"  # -f ended when the container did
    finally:
        follow.kill()


def job(name: str, script: str, **container: object) -> dict:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "main",
                            "image": "python:3.11",
                            "command": ["python", "-c", script],
                            "terminationMessagePath": "/dev/termination-log",
                            **container,
                        }
                    ],
                }
            },
        },
    }


def test_jobs_run_to_the_end_with_their_termination_messages(cluster: LocalCluster):
    """The Job controller and the kubelet together: a pod per Job, run to its
    exit; what it wrote at terminationMessagePath (or, failing with
    FallbackToLogsOnError, its log's end) in its status; the Job Complete or
    Failed."""
    cluster.apply(
        job("ok", "open('/dev/termination-log', 'w').write('{\"result\": 42}')"),
        job(
            "bad",
            "import sys; print('cannot reach the router'); sys.exit(3)",
            terminationMessagePolicy="FallbackToLogsOnError",
        ),
    )

    def ended(name: str) -> dict | None:
        found = cluster.get(f"jobs/{name}", api="/apis/batch/v1") or {}
        done = [c for c in found.get("status", {}).get("conditions", []) if c["status"] == "True"]
        return done[0] if done else None

    assert cluster.wait(lambda: ended("ok"), name="job ok")["type"] == "Complete"
    assert cluster.wait(lambda: ended("bad"), name="job bad")["type"] == "Failed"
    [ok] = cluster.pods("job-name=ok")
    terminated = ok["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (ok["status"]["phase"], terminated["message"]) == ("Succeeded", '{"result": 42}')
    [bad] = cluster.pods("job-name=bad")
    terminated = bad["status"]["containerStatuses"][0]["state"]["terminated"]
    assert bad["status"]["phase"] == "Failed" and terminated["exitCode"] == 3
    assert terminated["message"] == "cannot reach the router"
    cluster.kubectl("delete", "job", "ok", "bad")


def test_down_leaves_no_process_namespace_or_link(tmp_path: Path):
    bridge = f"tddown{os.getpid() % 10000}"
    try:
        cluster = cluster_up(tmp_path, bridge, DOWN_CIDR)
        sleeper = {"name": "s", "image": "python:3.11", "command": ["sleep", "600"]}
        cluster.apply(pod("sleeper", sleeper))
        running = cluster.wait(
            lambda: (p := cluster.pod("sleeper")) and p["status"].get("phase") == "Running" and p
        )
        assert isinstance(running, dict)
        pid = int(running["status"]["containerStatuses"][0]["containerID"].split("//")[1])
        os.kill(pid, 0)
        # Names carry the devcluster's pid: this cluster's, not the module's.
        suffix = f"{json.loads((tmp_path / 'cluster.json').read_text())['pid'] % 10000}x"
        assert any(n.startswith(NETNS_PREFIX + suffix) for n in namespaces())
        assert any(n.startswith(VETH_PREFIX + suffix) for n in links())
        cluster.close()
    finally:
        stopped = cluster_down(tmp_path)
    assert stopped.returncode == 0, stopped.stderr
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not [n for n in namespaces() if n.startswith(NETNS_PREFIX + suffix)]
    assert not [n for n in links() if n.startswith(VETH_PREFIX + suffix) or n == bridge]


def namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def links() -> list[str]:
    return os.listdir("/sys/class/net")


def test_commands_compose_as_kubernetes_does():
    env = {"A": "1", "B": "two"}
    assert expand("$(A)-$(B)-$(C)-$$(A)", env) == "1-two-$(C)-$(A)"
    assert image_repository("ghcr.io/tandem-serving/tandem:0.1") == "tandem-serving/tandem"
    assert image_repository("docker.io/library/redis:7.4@sha256:ab") == "library/redis"
    assert image_repository("redis") == "redis"
    # `args` alone go after the image's ENTRYPOINT; `command` replaces it.
    redis = {"name": "r", "image": "docker.io/library/redis:7", "args": ["--port", "$(A)"]}
    assert argv_of(redis, env) == ["redis-server", "--protected-mode", "no", "--port", "1"]
    tandem = {"name": "t", "image": "ghcr.io/tandem-serving/tandem:1"}
    assert argv_of(tandem, env) == ["tandem", "--help"]
    assert argv_of({**tandem, "command": ["python"], "args": ["-V"]}, env) == ["python", "-V"]
