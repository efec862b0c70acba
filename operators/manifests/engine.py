"""One engine pool: its EnginePool, its engines and its headless Service
(pure). A replica of one pod is a Deployment; a replica spanning
`nodesPerReplica` nodes is a LeaderWorkerSet group running vLLM's Ray
executor (`workload_kind` decides, once, for every caller)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

from common.engine import EngineCommand, EngineHostSettings, VllmSettings, kv_events_config
from common.kube import (
    COMPONENT_ENGINE,
    LABEL_COMPONENT,
    LABEL_POOL,
    LABEL_ROLE,
    PORT_GRPC,
    PORT_KV_EVENTS,
    PORT_KV_REPLAY,
)
from common.roles import Role
from common.settings import to_argv
from common.tls import GrpcTlsSettings
from operators.manifests.meta import (
    ENGINE_STARTUP_PERIODS,
    GRPC_PORT,
    KV_EVENTS_PORT,
    KV_REPLAY_PORT,
    KVSTORE_CONFIG_DIR,
    LABEL_LLMD_ROLE,
    METRICS_PORT,
    NIXL_PORT,
    PRESTOP_SECONDS,
    RAY_PORT,
    Manifest,
    Owner,
    env_pod_ip,
    grpc_tls,
    grpc_tls_volume,
    labels,
    meta,
    model_volume,
    override_probes,
    pod_metadata,
    pool_name,
    pool_selector,
    pull_secrets,
    with_requests,
)
from operators.spec import API_VERSION, ENGINE_ROLE, PoolSpec, TandemSpec

# Ray's per-node dashboard agent: its /api/local_raylet_healthz says whether
# that node's raylet is up (ray[default]), the worker pods' probe.
RAY_AGENT_PORT = 52365
ENGINE_REQUESTS = {"cpu": "4", "memory": "16Gi"}


@dataclass(frozen=True)
class WorkloadKind:
    """What runs a pool's engines."""

    api_version: str
    kind: str


DEPLOYMENT = WorkloadKind("apps/v1", "Deployment")
LEADER_WORKER_SET = WorkloadKind("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")


def workload_kind(pool: PoolSpec) -> WorkloadKind:
    """A Deployment when a replica is one pod, a LeaderWorkerSet when it spans nodes."""
    return LEADER_WORKER_SET if pool.nodes_per_replica > 1 else DEPLOYMENT


def engine_pools(td: str, namespace: str, spec: TandemSpec, owner: Owner) -> list[Manifest]:
    """One EnginePool per role; `spec.replicas` seeds it (see reconcile for who owns it)."""
    out = []
    for role in spec.roles:
        pool = spec.pool(role)
        out.append(
            {
                "apiVersion": API_VERSION,
                "kind": "EnginePool",
                "metadata": meta(
                    pool_name(td, role),
                    namespace,
                    owner,
                    labels(td, "engine-pool", **{LABEL_ROLE: ENGINE_ROLE[role]}),
                ),
                "spec": {
                    "deployment": td,
                    "role": ENGINE_ROLE[role],
                    "replicas": pool.replicas,
                    "minReplicas": pool.min_replicas,
                    "maxReplicas": pool.max_replicas,
                },
            }
        )
    return out


# What an engine pod always says, even at the engine's defaults.
ENGINE_ALWAYS = (
    "shutdown_grace_s",
    "model",
    "served_model_name",
    "dtype",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "prefill_context_parallel_size",
    "decode_context_parallel_size",
)


def engine_command(td: str, spec: TandemSpec, role: str, ray: bool = False) -> EngineCommand:
    """The engine host's command for one pool (`$(POD_IP)` expanded by the kubelet)."""
    pool = spec.pool(role)
    model = spec.model
    par = pool.parallelism
    tls = grpc_tls(spec)
    host = EngineHostSettings(
        role=Role(ENGINE_ROLE[role]),
        host="$(POD_IP)",
        grpc_port=GRPC_PORT,
        metrics_port=METRICS_PORT,
        nixl_port=NIXL_PORT,
        kv_store_config=(
            f"{KVSTORE_CONFIG_DIR}/mooncake-engine.json" if spec.kv_store.enabled else None
        ),
        # Drain within the pod's grace period, leaving time to exit.
        shutdown_grace_s=max(1, pool.termination_grace_period_seconds - 10),
        # The server side: its certificate and the CA; clients are not dialled.
        tls=(
            GrpcTlsSettings(tls.grpc_tls_cert, tls.grpc_tls_key, tls.grpc_tls_ca)
            if tls is not None
            else GrpcTlsSettings()
        ),
    )
    vllm = VllmSettings(
        model=model.origin.model_path,
        served_model_name=model.served,
        dtype=model.dtype,
        tensor_parallel_size=par.tensor,
        pipeline_parallel_size=par.pipeline,
        data_parallel_size=par.data,
        prefill_context_parallel_size=par.prefill_context,
        decode_context_parallel_size=par.decode_context,
        kv_events_config=kv_events_config(KV_EVENTS_PORT, KV_REPLAY_PORT),
        max_model_len=model.max_model_len or None,
        enable_expert_parallel=par.expert,
        distributed_executor_backend="ray" if ray else None,
    )
    return EngineCommand(host, vllm, tuple(pool.engine_args or ()))


def engine_argv(td: str, spec: TandemSpec, role: str, ray: bool = False) -> list[str]:
    return engine_command(td, spec, role, ray).argv(joined=True, always=ENGINE_ALWAYS)


def ray_leader_script(engine: list[str], port: int = RAY_PORT) -> str:
    """vLLM's LWS recipe, leader side: start Ray's head, wait for the whole
    group ($LWS_GROUP_SIZE nodes), then run the engine on the Ray executor."""
    wait = (
        "import os, ray, time\n"
        "ray.init(address='auto')\n"
        "size = int(os.environ.get('LWS_GROUP_SIZE', '1'))\n"
        "while sum(n['Alive'] for n in ray.nodes()) < size:\n"
        "    time.sleep(1)\n"
        "print(f'ray group ready: {size} nodes', flush=True)\n"
    )
    return (
        f"ray start --head --port={port} --node-ip-address=$(POD_IP) --disable-usage-stats"
        f" && python -c {shlex.quote(wait)} && exec {shlex.join(engine)}"
    )


def ray_worker_script(port: int = RAY_PORT) -> str:
    """Worker side: join the leader's Ray cluster (retrying until its head is up) and stay."""
    return (
        f"until ray start --address=$(LWS_LEADER_ADDRESS):{port} "
        f"--node-ip-address=$(POD_IP) --disable-usage-stats --block; do sleep 2; done"
    )


def _engine_container(
    td: str, spec: TandemSpec, role: str, argv: list[str] | None, script: str | None
) -> dict[str, Any]:
    pool = spec.pool(role)
    container: dict[str, Any] = {
        "name": "engine",
        "image": spec.images.engine,
        "imagePullPolicy": spec.images.pull_policy,
        "env": env_pod_ip() + list(pool.env or ()),
        "ports": [
            {"name": PORT_GRPC, "containerPort": GRPC_PORT},
            {"name": "metrics", "containerPort": METRICS_PORT},
            {"name": "nixl", "containerPort": NIXL_PORT},
            {"name": PORT_KV_EVENTS, "containerPort": KV_EVENTS_PORT},
            {"name": PORT_KV_REPLAY, "containerPort": KV_REPLAY_PORT},
        ],
        "resources": _resources(pool),
        # The router sees the endpoint terminating and stops sending first;
        # SIGTERM then makes the engine drain (services/engine/server.py).
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SECONDS}}},
        # NCCL, vLLM's workers and Ray's object store share tensors through
        # /dev/shm; a container's default 64 MiB is far too small.
        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
    }
    if pool.rdma:
        # RDMA (UCX under NIXL) pins the KV buffers it registers with the NIC.
        container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    if argv is not None:
        container["command"], container["args"] = argv[:3], argv[3:]
    else:
        container["command"], container["args"] = ["sh", "-c"], [script]
    serving, period = _serving_probe(spec)
    container["readinessProbe"] = {**serving, "periodSeconds": period}
    container["livenessProbe"] = {
        "httpGet": {"path": "/health", "port": "metrics"},
        "periodSeconds": 10,
        "failureThreshold": 6,
    }
    # Liveness waits for the engine's startup (see ENGINE_STARTUP_PERIODS).
    container["startupProbe"] = {
        **serving,
        "periodSeconds": 5,
        "failureThreshold": ENGINE_STARTUP_PERIODS,
    }
    # The engine's probes only: a Ray worker's replace them all (_ray_worker_container).
    override_probes(container, pool.probes)
    if spec.kv_store.enabled:
        container["volumeMounts"].append(
            {"name": "kvstore", "mountPath": KVSTORE_CONFIG_DIR, "readOnly": True}
        )
    if (model := model_volume(spec)) is not None:
        container["volumeMounts"].append(model[1])
    if (tls_volume := grpc_tls_volume(spec)) is not None:
        container["volumeMounts"].append(tls_volume[1])
    container["volumeMounts"] += [dict(m) for m in pool.volume_mounts or ()]
    return container


def _serving_probe(spec: TandemSpec) -> tuple[dict[str, Any], int]:
    """How the kubelet asks whether the engine serves (grpc.health.v1), and
    how often. Its own gRPC probe speaks plaintext only: under mTLS the engine
    refuses it, so a probe command in the pod asks over mTLS instead (a Python
    process each time: every 5 s rather than 2)."""
    tls = grpc_tls(spec)
    if tls is None:
        return {"grpc": {"port": GRPC_PORT}}, 2
    argv = ["python", "-m", "common.grpc_health", f"--address=$POD_IP:{GRPC_PORT}"]
    argv += to_argv(tls, joined=True)
    # $POD_IP from the container's environment: probes get no $(VAR) expansion.
    script = " ".join(a if a.startswith("--address") else shlex.quote(a) for a in argv)
    return {"exec": {"command": ["sh", "-c", script]}, "timeoutSeconds": 5}, 5


def _ray_worker_container(td: str, spec: TandemSpec, role: str) -> dict[str, Any]:
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


def _resources(pool: PoolSpec) -> dict[str, Any]:
    resources = with_requests(pool.resources, ENGINE_REQUESTS)
    if pool.gpus_per_pod:
        for key in ("limits", "requests"):
            resources.setdefault(key, {})[pool.accelerator_resource] = str(pool.gpus_per_pod)
    return resources


# How a pod names the PodGroup it joins: Volcano reads the annotation, the
# scheduler-plugins coscheduling plugin the label; each ignores the other.
VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
COSCHEDULING_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"


def _pod_metadata(labels: dict[str, str], pool: PoolSpec) -> dict[str, Any]:
    """An engine pod template's metadata: its labels, the pool's PodGroup if
    it has one, and the pool's extra labels and annotations."""
    own_labels, own_annotations = labels, {}
    if pool.pod_group:
        own_labels = {**labels, COSCHEDULING_GROUP_LABEL: pool.pod_group}
        own_annotations = {VOLCANO_GROUP_ANNOTATION: pool.pod_group}
    return pod_metadata(own_labels, own_annotations, pool.pod_labels, pool.pod_annotations)


def _pod_spec(
    td: str, spec: TandemSpec, role: str, containers: list[dict[str, Any]]
) -> dict[str, Any]:
    pool = spec.pool(role)
    # Memory-backed: it counts against the container's memory limit.
    volumes: list[dict[str, Any]] = [
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": pool.shm_size}}
    ]
    if spec.kv_store.enabled:
        volumes.append({"name": "kvstore", "configMap": {"name": f"{td}-kvstore"}})
    if (model := model_volume(spec)) is not None:
        volumes.append(model[0])
    if (tls_volume := grpc_tls_volume(spec)) is not None:
        volumes.append(tls_volume[0])
    volumes += [dict(v) for v in pool.volumes or ()]
    pod: dict[str, Any] = {
        "containers": containers,
        "terminationGracePeriodSeconds": pool.termination_grace_period_seconds,
        "volumes": volumes,
        **pull_secrets(spec),
    }
    if pool.init_containers:
        pod["initContainers"] = [dict(c) for c in pool.init_containers]
    if pool.affinity:
        pod["affinity"] = dict(pool.affinity)
    if pool.priority_class_name:
        pod["priorityClassName"] = pool.priority_class_name
    if pool.runtime_class_name:
        pod["runtimeClassName"] = pool.runtime_class_name
    if pool.node_selector:
        pod["nodeSelector"] = dict(pool.node_selector)
    if pool.tolerations:
        pod["tolerations"] = [dict(t) for t in pool.tolerations]
    if pool.scheduler_name:
        pod["schedulerName"] = pool.scheduler_name
    if pool.spread_across_nodes:
        # Best effort: a pool larger than the nodes it may use still starts.
        pod["topologySpreadConstraints"] = [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": pool_selector(td, role)},
            }
        ]
    return pod


def pool_workload(
    td: str, namespace: str, spec: TandemSpec, role: str, replicas: int, owner: Owner
) -> list[Manifest]:
    """One pool's engines (Deployment or LeaderWorkerSet) and its headless Service."""
    pool = spec.pool(role)
    engine_role = ENGINE_ROLE[role]
    lbls = labels(
        td,
        COMPONENT_ENGINE,
        **{LABEL_ROLE: engine_role, LABEL_LLMD_ROLE: engine_role, LABEL_POOL: pool_name(td, role)},
    )
    name = pool_name(td, role)
    pods = pool_selector(td, role)
    kind = workload_kind(pool)
    # A LeaderWorkerSet makes the headless Service named after it (publishing
    # not-ready pods) only if none exists, and its leader address resolves
    # through it before the leader is Ready — which waits for its workers to
    # join through that address. The router's Service must not take the name.
    service_name = name if kind == DEPLOYMENT else f"{name}-engines"
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(service_name, namespace, owner, lbls),
        "spec": {
            "clusterIP": "None",
            "selector": pods,
            # Endpoints stay listed while terminating: the router needs to
            # see them go `terminating` to stop new work but let streams end.
            "publishNotReadyAddresses": False,
            "ports": [
                {"name": PORT_GRPC, "port": GRPC_PORT, "targetPort": PORT_GRPC},
                {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics"},
                {"name": PORT_KV_EVENTS, "port": KV_EVENTS_PORT, "targetPort": PORT_KV_EVENTS},
                {"name": PORT_KV_REPLAY, "port": KV_REPLAY_PORT, "targetPort": PORT_KV_REPLAY},
            ],
        },
    }
    head = {
        "apiVersion": kind.api_version,
        "kind": kind.kind,
        "metadata": meta(name, namespace, owner, lbls),
    }
    if kind == DEPLOYMENT:
        container = _engine_container(td, spec, role, engine_argv(td, spec, role), None)
        workload = {
            **head,
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": pods},
                # Never start a second model load beside the first on the same
                # GPUs; never take an engine down before its replacement is up.
                "strategy": {
                    "type": "RollingUpdate",
                    "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
                },
                "template": {
                    "metadata": _pod_metadata(lbls, pool),
                    "spec": _pod_spec(td, spec, role, [container]),
                },
            },
        }
        return [workload, service]
    leader = _engine_container(
        td, spec, role, None, ray_leader_script(engine_argv(td, spec, role, ray=True))
    )
    worker = _ray_worker_container(td, spec, role)
    worker_labels = {**lbls, LABEL_COMPONENT: "engine-worker"}
    workload = {
        **head,
        "spec": {
            "replicas": replicas,
            # The leader is Ready only once its workers joined Ray and the
            # engine serves; workers start as soon as the leader pod exists.
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": pool.nodes_per_replica,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": {
                    "metadata": _pod_metadata(lbls, pool),
                    "spec": _pod_spec(td, spec, role, [leader]),
                },
                "workerTemplate": {
                    "metadata": _pod_metadata(worker_labels, pool),
                    "spec": _pod_spec(td, spec, role, [worker]),
                },
            },
        },
    }
    return [workload, service]
