"""The user's journey, end to end on one machine, as root: `tandem cluster up`,
a Hugging Face Hub mirror in the cluster (devcluster/hubmirror.py, serving
the prepared model as the Hub would: an air-gapped cluster's mirror), the
Helm chart rendered with the Helm SDK from helm/examples/local-cpu.yaml with
the model as `hf://` from that mirror and applied with the real `kubectl
apply -f`, the operator reconciling as a pod, its download Job filling the
chart's model cache claim before any engine starts, Redis, the Mooncake
master and store, the routers and the engines (the cache mounted read-only)
running from the rendered pod specs, traffic through the router Service's
loopback port, a TandemProfile of the decode pool (the operator's profile
Job: its own router and the real `tandem profile`, the result written to a
ConfigMap and named in the deployment), `kubectl scale` of the decode pool
up and back down under streaming sessions, and the uninstall (`kubectl
delete -f` of what was applied, as `helm uninstall` does, keeping the
claim) and `tandem cluster down` leaving nothing.

In `make test`'s engine phase (also `make journey`, with its timings printed:
run with `-s`): three vLLM engines, about 3-8 minutes on 2 cores depending on
the load. As root, as CI runs: elsewhere `tandem cluster up` fails, and the
test with it, saying why.
"""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from bench.harness import cluster_down
from common.kube import LABEL_COMPONENT, LABEL_POOL
from common.model import resolve_model
from devcluster.client import LocalCluster
from devcluster.hubmirror import mirror_objects
from devcluster.kubelet.network import NETNS_PREFIX, VETH_PREFIX
from operators.manifests import GRPC_PORT, METRICS_PORT, download_job_name
from operators.planner.profiles import profile_from_configmap
from tests.helm import chart
from tests.helpers import engine_load
from tests.localcluster import cluster_fixture

# Also `stack`: it starts engines, so `pytest -m "not stack"` leaves it out.
pytestmark = [pytest.mark.journey, pytest.mark.stack]

RELEASE = "tandem"
NAMESPACE = "default"
DECODE_POOL = f"{RELEASE}-decode"
PREFILL_POOL = f"{RELEASE}-prefill"
# Its own bridge and addresses: a user's cluster (tandem0, 10.250.0.0/16) and
# the kubelet tests (10.200-239.x) may run beside it.
BRIDGE = "tdjourney"
cluster = cluster_fixture(BRIDGE, "10.240.0.0/16")
TDS = "/apis/tandem.dev/v1alpha1"
# The model's id on the Hub, as the mirror serves the prepared folder.
HUB_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
MIRROR = "http://hub-mirror:8080"
# One short level of the decode pool: the Job's router, then 6 s of sessions.
PROFILE = {
    "apiVersion": "tandem.dev/v1alpha1",
    "kind": "TandemProfile",
    "metadata": {"name": "journey-decode"},
    "spec": {
        "deployment": RELEASE,
        "role": "decode",
        "concurrencies": [1],
        "levelSeconds": 6,
        "apply": True,
        # Small and quick: two sessions, no think time, short answers.
        "args": ["--sessions=2", "--think-scale=0", "--max-tokens-cap=16"],
    },
}
# Three engines, the store and two routers starting together on 2 cores.
INSTALL_DEADLINE_S = 900.0
SCALE_DEADLINE_S = 600.0
PROFILE_DEADLINE_S = 600.0
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
    """local-cpu.yaml with the model from the Hub mirror into a claim the
    chart creates, the store's disk tier under tmp."""
    v = chart.example("local-cpu")
    v["model"] |= {
        "source": f"hf://{HUB_REPO}",
        "hubEndpoint": MIRROR,
        "cache": {"create": True, "size": "2Gi"},
        "volume": {"hostPath": ""},
    }
    v["kvStore"]["disk"]["hostPath"] = str(tmp_path / "kv")
    return v


def condition(obj: dict | None, kind: str) -> dict:
    conditions = (obj or {}).get("status", {}).get("conditions", [])
    return next((c for c in conditions if c["type"] == kind), {})


def seconds(start: str, end: str) -> float:
    """Between two of the API server's timestamps."""
    fmt = "%Y-%m-%dT%H:%M:%SZ"
    return time.mktime(time.strptime(end, fmt)) - time.mktime(time.strptime(start, fmt))


def test_install_serve_scale_drain_uninstall(cluster: LocalCluster, tmp_path: Path) -> None:
    timings: dict[str, str] = {}

    def record(what: str, figure: str) -> None:
        timings[what] = figure
        print(f"\n[journey] {what}: {figure}", flush=True)

    # The cluster's Hub mirror, there before the release (its own start
    # hashes the weights once).
    model = resolve_model(None)
    mirrored = time.monotonic()
    cluster.apply(*mirror_objects({HUB_REPO: model}))
    cluster.wait(
        lambda: [p for p in cluster.pods("app.kubernetes.io/name=hub-mirror") if ready(p)],
        INSTALL_DEADLINE_S,
        "the Hub mirror Ready",
    )
    record("hub mirror applied -> Ready", f"{time.monotonic() - mirrored:.1f} s")

    rendered = chart.render(values(tmp_path), release=RELEASE, namespace=NAMESPACE)
    # Hooks (the chart's test pod) are not part of the release.
    docs = sorted(
        (d for d in rendered if "helm.sh/hook" not in d["metadata"].get("annotations", {})),
        key=helm_order,
    )
    manifest = tmp_path / "release.yaml"
    manifest.write_text(yaml.safe_dump_all(docs))
    # helm uninstall keeps what the chart marks so (the model cache).
    uninstall = tmp_path / "uninstall.yaml"
    uninstall.write_text(
        yaml.safe_dump_all(
            d
            for d in docs[::-1]
            if d["metadata"].get("annotations", {}).get("helm.sh/resource-policy") != "keep"
        )
    )

    # helm install: CRDs are the cluster's own (it starts with Tandem's).
    installed = time.monotonic()
    cluster.kubectl("apply", "-f", str(manifest))

    # The download Job fills the claim before any engine starts.
    def td_condition(kind: str) -> dict:
        return condition(cluster.get(f"tandemdeployments/{RELEASE}", api=TDS), kind)

    cluster.wait(
        lambda: td_condition("ModelReady").get("status") == "True",
        INSTALL_DEADLINE_S,
        "the model downloaded (ModelReady)",
    )
    job = cluster.get(
        f"jobs/{download_job_name(RELEASE, f'hf://{HUB_REPO}', MIRROR)}", api="/apis/batch/v1"
    )
    assert job is not None
    record(
        "model download Job",
        f"{seconds(job['status']['startTime'], job['status']['completionTime']):.0f} s "
        f"(install -> ModelReady {time.monotonic() - installed:.1f} s)",
    )
    cached = cluster.state / "claims" / NAMESPACE / f"{RELEASE}-model-cache" / "hf" / HUB_REPO
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert filecmp.cmp(cached / "main" / name, model / name, shallow=False), name

    def td_ready() -> dict | None:
        td = cluster.get(f"tandemdeployments/{RELEASE}", api=TDS)
        status = (td or {}).get("status", {})
        return td if status.get("prefill") == "1/1" and status.get("decode") == "1/1" else None

    cluster.wait(td_ready, INSTALL_DEADLINE_S, "the TandemDeployment's pools ready")

    def all_ready() -> list[dict] | None:
        # The download Job's pod has done its work: Succeeded, never Ready.
        pods = [
            p
            for p in cluster.pods(f"app.kubernetes.io/instance={RELEASE}")
            if p.get("status", {}).get("phase") != "Succeeded"
        ]
        return pods if pods and all(ready(p) for p in pods) else None

    release_pods = cluster.wait(all_ready, INSTALL_DEADLINE_S, "every pod of the release Ready")
    assert isinstance(release_pods, list)
    components = {p["metadata"]["labels"].get(LABEL_COMPONENT) for p in release_pods}
    printed = cluster.kubectl("get", "td")
    assert "1/1" in printed, printed

    def router_url() -> str | None:
        url = cluster.service_url(f"{RELEASE}-router")
        if url is None:
            return None
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

    # Profile the decode pool as the operator does it: a Job of its own.
    profiled = time.monotonic()
    cluster.apply(PROFILE)

    def profile_phase() -> str:
        found = cluster.get("tandemprofiles/journey-decode", api=TDS) or {}
        return found.get("status", {}).get("phase", "")

    cluster.wait(
        lambda: profile_phase() in ("Succeeded", "Failed"), PROFILE_DEADLINE_S, "the profile's end"
    )
    found = cluster.get("tandemprofiles/journey-decode", api=TDS)
    assert profile_phase() == "Succeeded", (
        condition(found, "Profiled"),
        cluster.kubectl("logs", "job/journey-decode-profile", check=False)[-3000:],
    )
    status = (found or {})["status"]
    assert status["configMap"] == f"{RELEASE}-decode-profile" and status["points"] == 1
    profile = profile_from_configmap(cluster.get(f"configmaps/{RELEASE}-decode-profile") or {})
    assert profile.role == "decode" and profile.source == "measured"
    [point] = profile.points
    assert point.concurrency == 1 and point.output_tokens_per_s > 0
    td = cluster.get(f"tandemdeployments/{RELEASE}", api=TDS) or {}
    assert td["spec"]["scaling"]["profiles"]["decode"] == f"{RELEASE}-decode-profile"
    assert td["status"]["profiles"]["decode"]["tandemProfile"] == "journey-decode"
    cluster.wait(
        lambda: td_condition("ProfileStale").get("reason") == "Fresh",
        120,
        "ProfileStale=False (profiled on what runs)",
    )
    record(
        "TandemProfile -> Succeeded",
        f"{time.monotonic() - profiled:.1f} s ({point.output_tokens_per_s:.1f} output tok/s "
        f"at concurrency 1)",
    )

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
    # The mirror is the cluster's, not the release's.
    all_pids = {
        pid
        for p in cluster.pods()
        if not p["metadata"]["name"].startswith("hub-mirror")
        for pid in pids(p)
    }
    assert all_pids
    uninstalled = time.monotonic()
    cluster.kubectl("delete", "tandemprofile", "journey-decode")
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
    stopped = cluster_down(cluster.state)
    assert stopped.returncode == 0, stopped.stderr
    assert not alive(pid)
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [n for n in out.split() if n.startswith(NETNS_PREFIX + suffix)]
    assert not [
        n for n in os.listdir("/sys/class/net") if n.startswith(VETH_PREFIX + suffix) or n == BRIDGE
    ]
    print("\n".join(f"{k}: {v}" for k, v in timings.items()))
