"""TandemDeployment → Kubernetes objects (pure: dicts in, dicts out, no I/O).

`shared_objects` renders what the deployment needs once (router Deployment,
Service, optional Ingress, PodDisruptionBudget, managed Redis, the Mooncake
master and the per-node store clients, their config), `engine_pools` one
EnginePool per role, and `pool_workload` one pool's engines: a Deployment
when a replica is one pod, a LeaderWorkerSet running vLLM's Ray executor
when a replica spans `nodesPerReplica` nodes, plus a headless Service whose
EndpointSlices the router watches. Every object carries an owner reference
(the TandemDeployment, or for pool workloads the EnginePool) and Tandem's
labels; engine pods also carry `llm-d.ai/role`.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Any

from common.kube import (
    COMPONENT_ENGINE,
    LABEL_COMPONENT,
    LABEL_DEPLOYMENT,
    LABEL_POOL,
    LABEL_ROLE,
    PORT_GRPC,
    PORT_KV_EVENTS,
    PORT_KV_REPLAY,
)
from common.mooncake import (
    KvStoreSettings,
    client_command,
    engine_store_config,
    master_command,
)
from operators.spec import API_VERSION, ENGINE_ROLE, Spec, pools

Manifest = dict[str, Any]

LABEL_LLMD_ROLE = "llm-d.ai/role"
MANAGED_BY = "tandem-operator"
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"

ROUTER_PORT = 8000
GRPC_PORT = 50061
METRICS_PORT = 9061
NIXL_PORT = 5600
KV_EVENTS_PORT = 5557
KV_REPLAY_PORT = 5558
RAY_PORT = 6379
REDIS_PORT = 6379
KVSTORE_CONFIG_DIR = "/etc/tandem/kvstore"
# Seconds an engine pod keeps serving after it is told to stop, before
# SIGTERM: the time for EndpointSlice updates to reach every router replica.
PRESTOP_SECONDS = 5
# Ray's per-node dashboard agent: its /api/local_raylet_healthz says whether
# that node's raylet is up (ray[default]), the worker pods' probe.
RAY_AGENT_PORT = 52365
# Requests for containers whose spec gives none: the scheduler places no pod
# blind, and a busy node does not starve the router, Redis or the store master.
ROUTER_REQUESTS = {"cpu": "1", "memory": "1Gi"}
REDIS_REQUESTS = {"cpu": "250m", "memory": "512Mi"}
KVSTORE_MASTER_REQUESTS = {"cpu": "500m", "memory": "1Gi"}
KVSTORE_CLIENT_CPU = "1"
ENGINE_REQUESTS = {"cpu": "4", "memory": "16Gi"}


@dataclass(frozen=True)
class Owner:
    """Whose object this is: an ownerReference's fields."""

    kind: str
    name: str
    uid: str
    api_version: str = API_VERSION

    def ref(self) -> dict:
        return {"apiVersion": self.api_version, "kind": self.kind, "name": self.name,
                "uid": self.uid, "controller": True, "blockOwnerDeletion": True}


def labels(td: str, component: str, **extra: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "tandem",
        "app.kubernetes.io/instance": td,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        LABEL_COMPONENT: component,
        LABEL_DEPLOYMENT: td,
        **extra,
    }


def _meta(name: str, namespace: str, owner: Owner, lbls: dict[str, str]) -> dict:
    return {"name": name, "namespace": namespace, "labels": lbls,
            "ownerReferences": [owner.ref()]}


def _selector(lbls: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in lbls.items() if k in (LABEL_DEPLOYMENT, LABEL_COMPONENT, LABEL_ROLE)}


def pool_name(td: str, role: str) -> str:
    return f"{td}-{role}"


def pool_selector(td: str, role: str) -> dict[str, str]:
    """The labels that pick one pool's engine pods (Service, EndpointSlices, /scale)."""
    return {LABEL_DEPLOYMENT: td, LABEL_COMPONENT: COMPONENT_ENGINE, LABEL_ROLE: ENGINE_ROLE[role]}


def _env_pod_ip() -> list[dict]:
    return [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]


# ---- per-deployment objects -------------------------------------------------


def redis_url(td: str, spec: Spec) -> str | None:
    if not spec.get("router", {}).get("replicas", 1) > 1 and spec["redis"]["managed"]:
        return None  # one router replica keeps its state in memory
    if spec["redis"]["managed"]:
        return f"redis://{td}-redis:{REDIS_PORT}/0"
    return spec["redis"]["url"]


def kvstore_settings(td: str, spec: Spec, host: str) -> KvStoreSettings:
    store = spec["kvStore"]
    disk_size = store["disk"]["size"]
    return KvStoreSettings(host=host, pool_size=store["ramPool"], disk_size=disk_size,
                           enable_disk=not disk_size.startswith("0"),
                           disk_path=store["disk"]["hostPath"])


def with_requests(resources: dict | None, defaults: dict[str, str]) -> dict:
    """`resources` with a request for each of `defaults`' keys it lacks (its limit
    where it sets one: what Kubernetes would default the request to)."""
    out = json.loads(json.dumps(resources or {}))
    requests = out.setdefault("requests", {})
    for key, value in defaults.items():
        requests.setdefault(key, out.get("limits", {}).get(key, value))
    return out


def _mebibytes(size: str) -> int:
    """A Mooncake size ("32GB", binary units as Mooncake reads them) in MiB."""
    number, unit = int(size[:-2]), size[-2:]
    return number * {"KB": 1, "MB": 1 << 10, "GB": 1 << 20, "TB": 1 << 30}[unit] // 1024


def _replace_flag(argv: list[str], flag: str, value: str) -> list[str]:
    return [f"{flag}={value}" if a.startswith(flag + "=") else a for a in argv]


def shared_objects(td: str, namespace: str, spec: Spec, owner: Owner) -> list[Manifest]:
    out = _router(td, namespace, spec, owner)
    if spec["redis"]["managed"] and redis_url(td, spec):
        out += _redis(td, namespace, spec, owner)
    if spec["kvStore"]["enabled"]:
        out += _kvstore(td, namespace, spec, owner)
    return out


def _router(td: str, namespace: str, spec: Spec, owner: Owner) -> list[Manifest]:
    router = spec["router"]
    lbls = labels(td, "router")
    args = ["--host=0.0.0.0", f"--port={ROUTER_PORT}", "--discovery=kubernetes",
            f"--discovery-namespace={namespace}", f"--discovery-deployment={td}",
            f"--model={spec['model']['path']}", f"--policy={router['policy']}"]
    if spec["model"].get("servedName"):
        args.append(f"--served-model-name={spec['model']['servedName']}")
    url = redis_url(td, spec)
    if url:
        args.append(f"--redis-url={url}")
    env: list[dict] = []
    if router.get("apiKeySecretRef"):
        ref = router["apiKeySecretRef"]
        env.append({"name": "TANDEM_ROUTER_API_KEYS", "valueFrom": {
            "secretKeyRef": {"name": ref["name"], "key": ref.get("key", "api-keys")}}})
    container = {
        "name": "router",
        "image": spec["images"]["router"],
        "imagePullPolicy": spec["images"]["pullPolicy"],
        "command": ["python", "-m", "services.router"],
        "args": args + list(router.get("args", [])),
        "env": env,
        "ports": [{"name": "http", "containerPort": ROUTER_PORT}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"},
                           "periodSeconds": 2},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"},
                          "periodSeconds": 10, "failureThreshold": 6},
        # Keep answering while the Service stops sending here, then drain.
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SECONDS}}},
        "resources": with_requests(router.get("resources"), ROUTER_REQUESTS),
    }
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _meta(f"{td}-router", namespace, owner, lbls),
        "spec": {
            "replicas": router["replicas"],
            "selector": {"matchLabels": _selector(lbls)},
            "template": {
                "metadata": {"labels": lbls},
                "spec": {"serviceAccountName": f"{td}-router", "containers": [container],
                         "terminationGracePeriodSeconds": 60},
            },
        },
    }
    service = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": _meta(f"{td}-router", namespace, owner, lbls),
        "spec": {"selector": _selector(lbls),
                 "ports": [{"name": "http", "port": 80, "targetPort": "http"}]},
    }
    pdb = {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": _meta(f"{td}-router", namespace, owner, lbls),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _selector(lbls)}},
    }
    account = {
        "apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": _meta(f"{td}-router", namespace, owner, lbls),
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": _meta(f"{td}-router", namespace, owner, lbls),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": "tandem-router"},
        "subjects": [{"kind": "ServiceAccount", "name": f"{td}-router",
                      "namespace": namespace}],
    }
    out = [account, binding, deployment, service, pdb]
    ingress = router.get("ingress", {})
    if ingress.get("enabled"):
        rule: dict = {"http": {"paths": [{
            "path": "/", "pathType": "Prefix",
            "backend": {"service": {"name": f"{td}-router", "port": {"name": "http"}}}}]}}
        if ingress.get("host"):
            rule["host"] = ingress["host"]
        ing_spec: dict = {"rules": [rule]}
        if ingress.get("className"):
            ing_spec["ingressClassName"] = ingress["className"]
        if ingress.get("tlsSecretName"):
            ing_spec["tls"] = [{"hosts": [ingress["host"]],
                                "secretName": ingress["tlsSecretName"]}]
        out.append({"apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
                    "metadata": _meta(f"{td}-router", namespace, owner, lbls),
                    "spec": ing_spec})
    return out


def _redis(td: str, namespace: str, spec: Spec, owner: Owner) -> list[Manifest]:
    lbls = labels(td, "redis")
    container = {
        "name": "redis", "image": spec["images"]["redis"],
        "imagePullPolicy": spec["images"]["pullPolicy"],
        # Shared router state is soft state: no persistence.
        "args": ["--save", "", "--appendonly", "no"],
        "ports": [{"name": "redis", "containerPort": REDIS_PORT}],
        "readinessProbe": {"exec": {"command": ["redis-cli", "ping"]}, "periodSeconds": 2},
        "livenessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 10,
                          "failureThreshold": 3},
        "resources": with_requests(spec["redis"].get("resources"), REDIS_REQUESTS),
    }
    return [
        {"apiVersion": "apps/v1", "kind": "Deployment",
         "metadata": _meta(f"{td}-redis", namespace, owner, lbls),
         "spec": {"replicas": 1, "selector": {"matchLabels": _selector(lbls)},
                  "template": {"metadata": {"labels": lbls},
                               "spec": {"containers": [container]}}}},
        {"apiVersion": "v1", "kind": "Service",
         "metadata": _meta(f"{td}-redis", namespace, owner, lbls),
         "spec": {"selector": _selector(lbls),
                  "ports": [{"name": "redis", "port": REDIS_PORT, "targetPort": "redis"}]}},
    ]


def _kvstore(td: str, namespace: str, spec: Spec, owner: Owner) -> list[Manifest]:
    master_host = f"{td}-kvstore-master"
    image = spec["images"]["kvStore"]
    pull = spec["images"]["pullPolicy"]
    master = master_command(kvstore_settings(td, spec, "0.0.0.0"))
    m_lbls = labels(td, "kvstore-master")
    s = kvstore_settings(td, spec, master_host)
    master_port_names = {"rpc": s.master_port, "metadata": s.metadata_port,
                         "metrics": s.master_metrics_port}
    out: list[Manifest] = [
        {"apiVersion": "apps/v1", "kind": "Deployment",
         "metadata": _meta(master_host, namespace, owner, m_lbls),
         "spec": {"replicas": 1, "strategy": {"type": "Recreate"},
                  "selector": {"matchLabels": _selector(m_lbls)},
                  "template": {"metadata": {"labels": m_lbls}, "spec": {"containers": [{
                      "name": "master", "image": image, "imagePullPolicy": pull,
                      "command": master.argv[:1], "args": master.argv[1:],
                      "ports": [{"name": n, "containerPort": p}
                                for n, p in master_port_names.items()],
                      "readinessProbe": {"tcpSocket": {"port": "rpc"}, "periodSeconds": 2},
                      "livenessProbe": {"httpGet": {"path": "/metrics", "port": "metrics"},
                                        "periodSeconds": 10, "failureThreshold": 6},
                      "resources": with_requests(spec["kvStore"].get("masterResources"),
                                                 KVSTORE_MASTER_REQUESTS),
                  }]}}}},
        {"apiVersion": "v1", "kind": "Service",
         "metadata": _meta(master_host, namespace, owner, m_lbls),
         "spec": {"selector": _selector(m_lbls),
                  "ports": [{"name": n, "port": p, "targetPort": n}
                            for n, p in master_port_names.items()]}},
    ]
    # One pool owner per engine node: it advertises its pod IP to the master
    # and owns that node's RAM pool and disk tier.
    client = client_command(kvstore_settings(td, spec, "$(POD_IP)"))
    argv = _replace_flag(client.argv, "--master_server_address", s.master_address)
    argv = _replace_flag(argv, "--metadata_server", s.metadata_url)
    c_lbls = labels(td, "kvstore-client")
    # The pool owns the node's RAM pool and stages disk-tier reads in RAM:
    # ask for both up front so the node is not overcommitted under it.
    staging = _mebibytes(s.disk_staging_size) if s.enable_disk else 0
    pool_mi = _mebibytes(s.pool_size) + staging + 1024
    client_resources = with_requests(spec["kvStore"].get("clientResources"),
                                     {"cpu": KVSTORE_CLIENT_CPU, "memory": f"{pool_mi}Mi"})
    client_resources.setdefault("limits", {}).setdefault(
        "memory", client_resources["requests"]["memory"])
    out.append({
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": _meta(f"{td}-kvstore-client", namespace, owner, c_lbls),
        "spec": {"selector": {"matchLabels": _selector(c_lbls)},
                 "template": {"metadata": {"labels": c_lbls}, "spec": {
                     **store_client_placement(spec),
                     "containers": [{
                         "name": "client", "image": image, "imagePullPolicy": pull,
                         "command": argv[:1], "args": argv[1:],
                         "env": _env_pod_ip() + [{"name": k, "value": v}
                                                 for k, v in sorted(client.env.items())],
                         "ports": [{"name": "rpc", "containerPort": s.client_port},
                                   {"name": "health", "containerPort": s.client_http_port}],
                         "readinessProbe": {"httpGet": {"path": "/health", "port": "health"},
                                            "periodSeconds": 5},
                         "livenessProbe": {"httpGet": {"path": "/health", "port": "health"},
                                           "periodSeconds": 10, "failureThreshold": 6},
                         "resources": client_resources,
                         "volumeMounts": [{"name": "disk", "mountPath": s.disk_path}],
                     }],
                     "volumes": [{"name": "disk", "hostPath": {
                         "path": spec["kvStore"]["disk"]["hostPath"],
                         "type": "DirectoryOrCreate"}}],
                 }}},
    })
    out.append({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": _meta(f"{td}-kvstore", namespace, owner, labels(td, "kvstore-master")),
        "data": {"mooncake-engine.json": json.dumps(engine_store_config(s), indent=2,
                                                    sort_keys=True)},
    })
    return out


def store_client_placement(spec: Spec) -> dict:
    """Where the store clients run: on every node any engine pool may use. The
    pools' node selectors are alternatives (one required node-affinity term
    each, which the scheduler ORs), inside the store's own nodeSelector; a pool
    without a selector may run anywhere, and so do the clients then."""
    out: dict = {}
    if spec["kvStore"].get("nodeSelector"):
        out["nodeSelector"] = dict(spec["kvStore"]["nodeSelector"])
    selectors = [spec[role].get("nodeSelector") or {} for role in pools(spec)]
    if selectors and all(selectors):
        terms: list[dict] = []
        for selector in selectors:
            term = {"matchExpressions": [{"key": k, "operator": "In", "values": [v]}
                                         for k, v in sorted(selector.items())]}
            if term not in terms:
                terms.append(term)
        out["affinity"] = {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}
    tolerations: list[dict] = []
    for role in pools(spec):
        tolerations += [t for t in spec[role].get("tolerations", []) if t not in tolerations]
    if tolerations:
        out["tolerations"] = tolerations
    return out


# ---- pools ------------------------------------------------------------------


def engine_pools(td: str, namespace: str, spec: Spec, owner: Owner) -> list[Manifest]:
    """One EnginePool per role; `spec.replicas` seeds it (see reconcile for who owns it)."""
    out = []
    for role in pools(spec):
        pool = spec[role]
        out.append({
            "apiVersion": API_VERSION, "kind": "EnginePool",
            "metadata": _meta(pool_name(td, role), namespace, owner,
                              labels(td, "engine-pool", **{LABEL_ROLE: ENGINE_ROLE[role]})),
            "spec": {"deployment": td, "role": ENGINE_ROLE[role], "replicas": pool["replicas"],
                     "minReplicas": pool["minReplicas"], "maxReplicas": pool["maxReplicas"]},
        })
    return out


def engine_argv(td: str, spec: Spec, role: str, ray: bool = False) -> list[str]:
    """The engine host's command line for one pool (`$(POD_IP)` expanded by the kubelet)."""
    pool = spec[role]
    model = spec["model"]
    par = pool["parallelism"]
    argv = ["python", "-m", "services.engine", f"--role={ENGINE_ROLE[role]}",
            "--host=$(POD_IP)", f"--grpc-port={GRPC_PORT}", f"--metrics-port={METRICS_PORT}",
            f"--nixl-port={NIXL_PORT}", f"--model={model['path']}",
            f"--served-model-name={model.get('servedName') or model['path']}",
            f"--dtype={model['dtype']}",
            f"--tensor-parallel-size={par['tensor']}",
            f"--pipeline-parallel-size={par['pipeline']}",
            f"--data-parallel-size={par['data']}",
            f"--prefill-context-parallel-size={par['prefillContext']}",
            f"--decode-context-parallel-size={par['decodeContext']}",
            # Drain within the pod's grace period, leaving time to exit.
            f"--shutdown-grace-s={max(1, pool['terminationGracePeriodSeconds'] - 10)}",
            "--kv-events-config=" + json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
                "endpoint": f"tcp://*:{KV_EVENTS_PORT}",
                "replay_endpoint": f"tcp://*:{KV_REPLAY_PORT}"}, separators=(",", ":"))]
    if model.get("maxModelLen"):
        argv.append(f"--max-model-len={model['maxModelLen']}")
    if par["expert"]:
        argv.append("--enable-expert-parallel")
    if spec["kvStore"]["enabled"]:
        argv.append(f"--kv-store-config={KVSTORE_CONFIG_DIR}/mooncake-engine.json")
    if ray:
        argv.append("--distributed-executor-backend=ray")
    return argv + list(pool.get("engineArgs", []))


def ray_leader_script(engine: list[str], port: int = RAY_PORT) -> str:
    """vLLM's LWS recipe, leader side: start Ray's head, wait for the whole
    group ($LWS_GROUP_SIZE nodes), then run the engine on the Ray executor."""
    wait = ("import os, ray, time\n"
            "ray.init(address='auto')\n"
            "size = int(os.environ.get('LWS_GROUP_SIZE', '1'))\n"
            "while sum(n['Alive'] for n in ray.nodes()) < size:\n"
            "    time.sleep(1)\n"
            "print(f'ray group ready: {size} nodes', flush=True)\n")
    return (f"ray start --head --port={port} --node-ip-address=$(POD_IP) --disable-usage-stats"
            f" && python -c {shlex.quote(wait)} && exec {shlex.join(engine)}")


def ray_worker_script(port: int = RAY_PORT) -> str:
    """Worker side: join the leader's Ray cluster (retrying until its head is up) and stay."""
    return (f"until ray start --address=$(LWS_LEADER_ADDRESS):{port} "
            f"--node-ip-address=$(POD_IP) --disable-usage-stats --block; do sleep 2; done")


def _engine_container(td: str, spec: Spec, role: str, argv: list[str] | None,
                      script: str | None) -> dict:
    pool = spec[role]
    container: dict = {
        "name": "engine",
        "image": spec["images"]["engine"],
        "imagePullPolicy": spec["images"]["pullPolicy"],
        "env": _env_pod_ip() + list(pool.get("env", [])),
        "ports": [{"name": PORT_GRPC, "containerPort": GRPC_PORT},
                  {"name": "metrics", "containerPort": METRICS_PORT},
                  {"name": "nixl", "containerPort": NIXL_PORT},
                  {"name": PORT_KV_EVENTS, "containerPort": KV_EVENTS_PORT},
                  {"name": PORT_KV_REPLAY, "containerPort": KV_REPLAY_PORT}],
        "resources": _resources(pool),
        # The router sees the endpoint terminating and stops sending first;
        # SIGTERM then makes the engine drain (services/engine/server.py).
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SECONDS}}},
        # NCCL, vLLM's workers and Ray's object store share tensors through
        # /dev/shm; a container's default 64 MiB is far too small.
        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
    }
    if pool["rdma"]:
        # RDMA (UCX under NIXL) pins the KV buffers it registers with the NIC.
        container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    if argv is not None:
        container["command"], container["args"] = argv[:3], argv[3:]
    else:
        container["command"], container["args"] = ["sh", "-c"], [script]
    container["readinessProbe"] = {"grpc": {"port": GRPC_PORT}, "periodSeconds": 2}
    container["livenessProbe"] = {"httpGet": {"path": "/health", "port": "metrics"},
                                  "periodSeconds": 10, "failureThreshold": 6}
    # Loading weights and compiling (and, in a group, waiting for the workers
    # to join Ray) may take long; liveness waits for it.
    container["startupProbe"] = {"grpc": {"port": GRPC_PORT}, "periodSeconds": 5,
                                 "failureThreshold": 360}
    if spec["kvStore"]["enabled"]:
        container["volumeMounts"].append({"name": "kvstore", "mountPath": KVSTORE_CONFIG_DIR,
                                          "readOnly": True})
    if spec["model"].get("volume"):
        container["volumeMounts"].append(
            {"name": "model", "mountPath": "/models", "readOnly": True})
    return container


def _ray_worker_container(td: str, spec: Spec, role: str) -> dict:
    """A group's non-leader pod: a Ray node holding its GPUs for the leader's engine."""
    container = _engine_container(td, spec, role, None, ray_worker_script())
    container["name"] = "ray-worker"
    container.pop("lifecycle")
    container["ports"] = [{"name": "ray-agent", "containerPort": RAY_AGENT_PORT}]
    raylet = {"httpGet": {"path": "/api/local_raylet_healthz", "port": "ray-agent"}}
    container["readinessProbe"] = {**raylet, "periodSeconds": 5}
    container["livenessProbe"] = {**raylet, "periodSeconds": 10, "failureThreshold": 6}
    # It keeps retrying until the leader's Ray head is up (ray_worker_script).
    container["startupProbe"] = {**raylet, "periodSeconds": 5, "failureThreshold": 120}
    return container


def _resources(pool: dict) -> dict:
    resources = with_requests(pool.get("resources"), ENGINE_REQUESTS)
    if pool["gpusPerPod"]:
        for key in ("limits", "requests"):
            resources.setdefault(key, {})["nvidia.com/gpu"] = str(pool["gpusPerPod"])
    return resources


def _pod_spec(td: str, spec: Spec, role: str, containers: list[dict]) -> dict:
    pool = spec[role]
    # Memory-backed: it counts against the container's memory limit.
    volumes: list[dict] = [{"name": "shm", "emptyDir": {"medium": "Memory",
                                                        "sizeLimit": pool["shmSize"]}}]
    if spec["kvStore"]["enabled"]:
        volumes.append({"name": "kvstore", "configMap": {"name": f"{td}-kvstore"}})
    vol = spec["model"].get("volume") or {}
    if vol.get("persistentVolumeClaim"):
        volumes.append({"name": "model", "persistentVolumeClaim": {
            "claimName": vol["persistentVolumeClaim"], "readOnly": True}})
    elif vol.get("hostPath"):
        volumes.append({"name": "model", "hostPath": {"path": vol["hostPath"]}})
    pod: dict = {"containers": containers,
                 "terminationGracePeriodSeconds": pool["terminationGracePeriodSeconds"],
                 "volumes": volumes}
    if pool.get("nodeSelector"):
        pod["nodeSelector"] = pool["nodeSelector"]
    if pool.get("tolerations"):
        pod["tolerations"] = pool["tolerations"]
    return pod


def pool_workload(
    td: str, namespace: str, spec: Spec, role: str, replicas: int, owner: Owner
) -> list[Manifest]:
    """One pool's engines (Deployment or LeaderWorkerSet) and its headless Service."""
    pool = spec[role]
    engine_role = ENGINE_ROLE[role]
    lbls = labels(td, COMPONENT_ENGINE, **{LABEL_ROLE: engine_role, LABEL_LLMD_ROLE: engine_role,
                                   LABEL_POOL: pool_name(td, role)})
    name = pool_name(td, role)
    selector = pool_selector(td, role)
    service = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": _meta(name, namespace, owner, lbls),
        "spec": {"clusterIP": "None", "selector": selector,
                 # Endpoints stay listed while terminating: the router needs to
                 # see them go `terminating` to stop new work but let streams end.
                 "publishNotReadyAddresses": False,
                 "ports": [{"name": PORT_GRPC, "port": GRPC_PORT, "targetPort": PORT_GRPC},
                           {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics"},
                           {"name": PORT_KV_EVENTS, "port": KV_EVENTS_PORT,
                            "targetPort": PORT_KV_EVENTS},
                           {"name": PORT_KV_REPLAY, "port": KV_REPLAY_PORT,
                            "targetPort": PORT_KV_REPLAY}]},
    }
    if pool["nodesPerReplica"] == 1:
        container = _engine_container(td, spec, role, engine_argv(td, spec, role), None)
        workload = {
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": _meta(name, namespace, owner, lbls),
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": selector},
                # Never start a second model load beside the first on the same
                # GPUs; never take an engine down before its replacement is up.
                "strategy": {"type": "RollingUpdate",
                             "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                "template": {"metadata": {"labels": lbls},
                             "spec": _pod_spec(td, spec, role, [container])},
            },
        }
        return [workload, service]
    leader = _engine_container(td, spec, role, None,
                               ray_leader_script(engine_argv(td, spec, role, ray=True)))
    worker = _ray_worker_container(td, spec, role)
    worker_labels = {**lbls, LABEL_COMPONENT: "engine-worker"}
    workload = {
        "apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
        "metadata": _meta(name, namespace, owner, lbls),
        "spec": {
            "replicas": replicas,
            # The leader is Ready only once its workers joined Ray and the
            # engine serves; workers start as soon as the leader pod exists.
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": pool["nodesPerReplica"],
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": {"metadata": {"labels": lbls},
                                   "spec": _pod_spec(td, spec, role, [leader])},
                "workerTemplate": {"metadata": {"labels": worker_labels},
                                   "spec": _pod_spec(td, spec, role, [worker])},
            },
        },
    }
    return [workload, service]
