"""TandemDeployment → Kubernetes objects (pure: a TandemSpec in, dicts out, no I/O).

One module per component: `router`, `redis`, `kvstore` (the Mooncake master,
the per-node store clients and their config) and `engine` (one EnginePool
per role and each pool's engines: a Deployment when a replica is one pod, a
LeaderWorkerSet running vLLM's Ray executor when a replica spans
`nodesPerReplica` nodes, plus a headless Service whose EndpointSlices the
router watches), `model` (the Job that downloads an hf:// model into its
cache before engines start); `meta` holds what they share. Every object carries an owner
reference to the TandemDeployment (pool workloads too, so that deleting an
EnginePool leaves its engines running) and Tandem's labels; engine pods also
carry `llm-d.ai/role`.
"""

from __future__ import annotations

from common.kube import LABEL_COMPONENT, LABEL_DEPLOYMENT
from operators.manifests.engine import (
    DEPLOYMENT,
    LEADER_WORKER_SET,
    RAY_AGENT_PORT,
    WorkloadKind,
    engine_argv,
    engine_pools,
    pool_workload,
    ray_leader_script,
    ray_worker_script,
    workload_kind,
)
from operators.manifests.kvstore import kvstore_objects, kvstore_settings, store_client_placement
from operators.manifests.meta import (
    DELETION_COST,
    GRPC_PORT,
    KV_EVENTS_PORT,
    KV_REPLAY_PORT,
    MANAGED_BY,
    METRICS_PORT,
    NIXL_PORT,
    RAY_PORT,
    ROUTER_PORT,
    Manifest,
    Owner,
    labels,
    pool_name,
    pool_selector,
)
from operators.manifests.model import download_job_name, model_download_job
from operators.manifests.redis import redis_objects, redis_url
from operators.manifests.router import router_objects
from operators.spec import TandemSpec

__all__ = [
    "DELETION_COST",
    "DEPLOYMENT",
    "GRPC_PORT",
    "KV_EVENTS_PORT",
    "KV_REPLAY_PORT",
    "LABEL_COMPONENT",
    "LABEL_DEPLOYMENT",
    "LEADER_WORKER_SET",
    "MANAGED_BY",
    "METRICS_PORT",
    "NIXL_PORT",
    "RAY_AGENT_PORT",
    "RAY_PORT",
    "ROUTER_PORT",
    "Manifest",
    "Owner",
    "WorkloadKind",
    "download_job_name",
    "engine_argv",
    "engine_pools",
    "kvstore_settings",
    "labels",
    "model_download_job",
    "pool_name",
    "pool_selector",
    "pool_workload",
    "ray_leader_script",
    "ray_worker_script",
    "redis_url",
    "shared_objects",
    "store_client_placement",
    "workload_kind",
]


def shared_objects(td: str, namespace: str, spec: TandemSpec, owner: Owner) -> list[Manifest]:
    """What the deployment needs once: the router, managed Redis when the
    routers share state, the KV store when it is enabled."""
    out = router_objects(td, namespace, spec, owner)
    if spec.redis.managed and redis_url(td, spec):
        out += redis_objects(td, namespace, spec, owner)
    if spec.kv_store.enabled:
        out += kvstore_objects(td, namespace, spec, owner)
    return out
