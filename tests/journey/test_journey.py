"""The user's journey, end to end on one machine, as root: `tandem cluster up`,
the Helm chart rendered with the Helm SDK from helm/examples/local-cpu.yaml
and applied with the real `kubectl apply -f`, the operator reconciling as a
pod, Redis, the Mooncake master and store, the routers and the engines
running from the rendered pod specs, traffic through the router Service's
loopback port, `kubectl scale` of the decode pool up and back down under
streaming sessions, and the uninstall (`kubectl delete -f` of what was
applied, as `helm uninstall` does) and `tandem cluster down` leaving nothing.

In `make test`'s engine phase (also `make journey`, with its timings printed:
run with `-s`): three vLLM engines, about 3-8 minutes on 2 cores depending on
the load. As root, as CI runs: elsewhere `tandem cluster up` fails, and the
test with it, saying why.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from common.kube import LABEL_COMPONENT, LABEL_POOL
from common.model import resolve_model
from devcluster.kubelet.network import NETNS_PREFIX, VETH_PREFIX
from operators.manifests import GRPC_PORT, METRICS_PORT
from tests.helm import chart
from tests.helpers import engine_load
from tests.localcluster import LocalCluster, down, up

# Also `stack`: it starts engines, so `pytest -m "not stack"` leaves it out.
pytestmark = [pytest.mark.journey, pytest.mark.stack]

RELEASE = "tandem"
NAMESPACE = "default"
DECODE_POOL = f"{RELEASE}-decode"
PREFILL_POOL = f"{RELEASE}-prefill"
# Its own bridge and addresses: a user's cluster (tandem0, 10.250.0.0/16) and
# the kubelet tests (10.200-239.x) may run beside it.
BRIDGE = "tdjourney"
POD_CIDR = "10.240.0.0/16"
# Three engines, the store and two routers starting together on 2 cores.
INSTALL_DEADLINE_S = 900.0
SCALE_DEADLINE_S = 600.0
DRAIN_DEADLINE_S = 300.0
UNINSTALL_DEADLINE_S = 180.0
# Helm's InstallOrder (pkg/release/util/kind_sorter.go), the kinds the chart
# renders among them; other kinds (custom resources) go last. Uninstall
# deletes in the reverse order: the TandemDeployment first, the operator after.
HELM_INSTALL_ORDER = [
    "Namespace",
    "NetworkPolicy",
    "ResourceQuota",
    "LimitRange",
    "PodDisruptionBudget",
    "ServiceAccount",
    "Secret",
    "ConfigMap",
    "StorageClass",
    "PersistentVolume",
    "PersistentVolumeClaim",
    "CustomResourceDefinition",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "Service",
    "DaemonSet",
    "Pod",
    "ReplicaSet",
    "Deployment",
    "StatefulSet",
    "Job",
    "CronJob",
    "IngressClass",
    "Ingress",
]


def ready(pod: dict) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    terminating = pod["metadata"].get("deletionTimestamp") is not None
    return not terminating and any(
        c["type"] == "Ready" and c["status"] == "True" for c in conditions
    )


def pids(pod: dict) -> set[int]:
    return {
        int(s["containerID"].removeprefix("devcluster://"))
        for s in pod.get("status", {}).get("containerStatuses", [])
        if s.get("containerID", "").startswith("devcluster://")
    }


def alive(pid: int) -> bool:
    """Running; an exited process its parent has yet to reap is not."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def engine_requests(pod: dict) -> float:
    """Requests the engine pod has served, from its own metrics."""
    text = httpx.get(f"http://{pod['status']['podIP']}:{METRICS_PORT}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("tandem_engine_requests_total")
    )


def chat(url: str, session: str, messages: list[dict], stream: bool = False) -> httpx.Response:
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": messages,
        "max_tokens": 16,
        "temperature": 0,
    }
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return httpx.post(
        f"{url}/v1/chat/completions",
        json=body,
        headers={"x-session-id": session},
        timeout=300,
    )


def helm_order(doc: dict) -> int:
    kind = doc["kind"]
    return HELM_INSTALL_ORDER.index(kind) if kind in HELM_INSTALL_ORDER else len(HELM_INSTALL_ORDER)


def values(tmp_path: Path) -> dict:
    """local-cpu.yaml with its hostPaths on this machine: the model as
    `tandem model` prepared it, the store's disk tier under tmp."""
    model = resolve_model(None)
    v = chart.example("local-cpu")
    v["model"]["path"] = f"/models/{model.name}"
    v["model"]["volume"]["hostPath"] = str(model.parent)
    v["kvStore"]["disk"]["hostPath"] = str(tmp_path / "kv")
    return v


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    state = tmp_path / "cluster"
    try:
        running = up(state, BRIDGE, POD_CIDR)
        yield running
        running.close()
    finally:
        down(state)


def test_install_serve_scale_drain_uninstall(cluster: LocalCluster, tmp_path: Path) -> None:
    timings: dict[str, str] = {}

    def record(what: str, figure: str) -> None:
        timings[what] = figure
        print(f"\n[journey] {what}: {figure}", flush=True)

    rendered = chart.render(values(tmp_path), release=RELEASE, namespace=NAMESPACE)
    # Hooks (the chart's test pod) are not part of the release.
    docs = sorted(
        (d for d in rendered if "helm.sh/hook" not in d["metadata"].get("annotations", {})),
        key=helm_order,
    )
    manifest = tmp_path / "release.yaml"
    manifest.write_text(yaml.safe_dump_all(docs))
    uninstall = tmp_path / "uninstall.yaml"
    uninstall.write_text(yaml.safe_dump_all(docs[::-1]))

    # helm install: CRDs are the cluster's own (it starts with Tandem's).
    installed = time.monotonic()
    cluster.kubectl("apply", "-f", str(manifest))

    def td_ready() -> dict | None:
        td = cluster.get(f"tandemdeployments/{RELEASE}", api="/apis/tandem.dev/v1alpha1")
        status = (td or {}).get("status", {})
        return td if status.get("prefill") == "1/1" and status.get("decode") == "1/1" else None

    cluster.wait(td_ready, INSTALL_DEADLINE_S, "the TandemDeployment's pools ready")

    def all_ready() -> list[dict] | None:
        pods = cluster.pods(f"app.kubernetes.io/instance={RELEASE}")
        return pods if pods and all(ready(p) for p in pods) else None

    release_pods = cluster.wait(all_ready, INSTALL_DEADLINE_S, "every pod of the release Ready")
    assert isinstance(release_pods, list)
    components = {p["metadata"]["labels"].get(LABEL_COMPONENT) for p in release_pods}
    printed = cluster.kubectl("get", "td")
    assert "1/1" in printed, printed

    def router_url() -> str | None:
        entry = cluster.services().get(f"{NAMESPACE}/{RELEASE}-router")
        if not entry:
            return None
        (port,) = entry["ports"].values()
        url = f"http://127.0.0.1:{port['loopback']}"
        try:
            health = httpx.get(f"{url}/health", timeout=5)
        except httpx.HTTPError:
            return None
        return url if health.status_code == 200 else None

    url = cluster.wait(router_url, INSTALL_DEADLINE_S, "the router Service answering /health")
    assert isinstance(url, str)
    session = f"journey-{uuid.uuid4().hex}"
    messages = [
        {"role": "system", "content": "You are a helpful assistant. " * 20},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    first = chat(url, session, messages)
    assert first.status_code == 200, first.text
    record("helm install -> first answered request", f"{time.monotonic() - installed:.1f} s")
    answer = first.json()["choices"][0]["message"]["content"]
    assert answer
    messages += [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And of Italy?"},
    ]
    second = chat(url, session, messages)
    assert second.status_code == 200, second.text
    cached = (second.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert cached > 0, second.json()["usage"]
    print(f"\ncomponents running: {sorted(c for c in components if c)}")

    # Scale the decode pool up: a second pod, discovered and sent requests.
    decode_selector = f"{LABEL_POOL}={DECODE_POOL}"
    (old_decode,) = cluster.pods(decode_selector)
    scaled = time.monotonic()
    cluster.kubectl("scale", f"enginepool/{DECODE_POOL}", "--replicas", "2")

    def new_decode() -> dict | None:
        fresh = [
            p
            for p in cluster.pods(decode_selector)
            if p["metadata"]["name"] != old_decode["metadata"]["name"] and ready(p)
        ]
        return fresh[0] if fresh else None

    new = cluster.wait(new_decode, SCALE_DEADLINE_S, "a second decode pod Ready")
    assert isinstance(new, dict)
    new_address = f"{new['status']['podIP']}:{GRPC_PORT}"

    def routed_to_new() -> bool:
        # Fresh sessions with prompts of their own (a shared prefix would
        # rightly keep them on the pod that caches it) spread over the decode
        # pods; the routers learn of the new one from its EndpointSlice.
        tag = uuid.uuid4().hex
        prompt = [{"role": "user", "content": f"{tag}: name a colour."}]
        response = chat(url, f"spread-{tag}", prompt)
        assert response.status_code == 200, response.text
        return engine_requests(new) > 0

    cluster.wait(routed_to_new, SCALE_DEADLINE_S, "a request routed to the new decode pod")
    record(
        "kubectl scale up -> new pod's first routed request", f"{time.monotonic() - scaled:.1f} s"
    )
    health = httpx.get(f"{url}/health", timeout=5).json()
    assert new_address in health["pods"], health

    # Scale back to 1 while sessions stream: no request fails.
    outcomes: list[str] = []
    stop = threading.Event()

    def stream_session(index: int) -> None:
        history = [{"role": "user", "content": f"Count from {index} upwards, please."}]
        sid = f"drain-{index}-{uuid.uuid4().hex}"
        while not stop.is_set():
            try:
                response = chat(url, sid, history, stream=True)
                done = response.status_code == 200 and "data: [DONE]" in response.text
                outcomes.append("ok" if done else f"{response.status_code}: {response.text[-300:]}")
            except httpx.HTTPError as exc:
                outcomes.append(repr(exc))

    streams = [threading.Thread(target=stream_session, args=(i,)) for i in range(4)]
    for t in streams:
        t.start()
    try:
        cluster.wait(lambda: len(outcomes) >= 4, SCALE_DEADLINE_S, "the sessions streaming")
        decode_pids = {p["metadata"]["name"]: pids(p) for p in cluster.pods(decode_selector)}
        drained = time.monotonic()
        in_flight_at_start = len(outcomes)
        cluster.kubectl("scale", f"enginepool/{DECODE_POOL}", "--replicas", "1")
        remaining = cluster.wait(
            lambda: len(ps := cluster.pods(decode_selector)) == 1 and ready(ps[0]) and ps[0],
            DRAIN_DEADLINE_S,
            "the decode pool drained to one pod",
        )
        gone_after = time.monotonic() - drained
        assert isinstance(remaining, dict)
        (gone,) = set(decode_pids) - {remaining["metadata"]["name"]}
        cluster.wait(
            lambda: not any(alive(pid) for pid in decode_pids[gone]),
            60,
            "the drained pod's processes gone",
        )
        # A few more turns on the remaining pod, then stop.
        settled = len(outcomes)
        cluster.wait(lambda: len(outcomes) >= settled + 4, SCALE_DEADLINE_S, "turns after drain")
    finally:
        stop.set()
        for t in streams:
            t.join(timeout=300)
    failures = [o for o in outcomes if o != "ok"]
    record(
        "kubectl scale down -> pod gone",
        f"{gone_after:.1f} s ({len(outcomes) - in_flight_at_start} requests during and after, "
        f"{len(failures)} failed)",
    )
    assert not failures, failures
    (prefill,) = cluster.pods(f"{LABEL_POOL}={PREFILL_POOL}")
    prefill_address = f"{prefill['status']['podIP']}:{GRPC_PORT}"
    cluster.wait(
        lambda: engine_load(prefill_address).kv_cache_usage == 0.0,
        60,
        "no KV held by the prefill engine",
    )

    # helm uninstall: delete what was applied, in Helm's order; every pod's
    # processes go.
    all_pids = {pid for p in cluster.pods() for pid in pids(p)}
    assert all_pids
    uninstalled = time.monotonic()
    cluster.kubectl("delete", "-f", str(uninstall), "--wait=true", "--timeout=300s")

    def nothing_left() -> bool:
        if any(alive(pid) for pid in all_pids):
            return False
        left = cluster.kubectl(
            "get", "all,td,enginepools,configmaps,secrets", "-o", "name", check=False
        )
        return not [n for n in left.split() if RELEASE in n.split("/", 1)[1]]

    cluster.wait(nothing_left, UNINSTALL_DEADLINE_S, "no object or process of the release")
    record("helm uninstall -> last process gone", f"{time.monotonic() - uninstalled:.1f} s")

    # tandem cluster down: no process, network namespace or link stays.
    pid = json.loads((cluster.state / "cluster.json").read_text())["pid"]
    suffix = f"{pid % 10000}x"
    stopped = down(cluster.state)
    assert stopped.returncode == 0, stopped.stderr
    assert not alive(pid)
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [n for n in out.split() if n.startswith(NETNS_PREFIX + suffix)]
    assert not [
        n for n in os.listdir("/sys/class/net") if n.startswith(VETH_PREFIX + suffix) or n == BRIDGE
    ]
    print("\n".join(f"{k}: {v}" for k, v in timings.items()))
