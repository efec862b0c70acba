"""The Mooncake KV store: the master (Deployment, Service), one store client
per engine node (DaemonSet) and the engines' store config (ConfigMap) (pure)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from common.mooncake import (
    KvStoreSettings,
    client_command,
    engine_store_config,
    master_command,
)
from operators.manifests.meta import (
    Manifest,
    Owner,
    env_pod_ip,
    labels,
    meta,
    pull_secrets,
    selector,
    with_requests,
)
from operators.spec import TandemSpec

KVSTORE_MASTER_REQUESTS = {"cpu": "500m", "memory": "1Gi"}
KVSTORE_CLIENT_CPU = "1"


def kvstore_settings(td: str, spec: TandemSpec, host: str) -> KvStoreSettings:
    store = spec.kv_store
    return KvStoreSettings(
        host=host,
        pool_size=store.ram_pool,
        disk_size=store.disk.size,
        enable_disk=not store.disk.size.startswith("0"),
        disk_path=store.disk.host_path,
    )


def _mebibytes(size: str) -> int:
    """A Mooncake size ("32GB", binary units as Mooncake reads them) in MiB."""
    number, unit = int(size[:-2]), size[-2:]
    return number * {"KB": 1, "MB": 1 << 10, "GB": 1 << 20, "TB": 1 << 30}[unit] // 1024


def _replace_flag(argv: list[str], flag: str, value: str) -> list[str]:
    return [f"{flag}={value}" if a.startswith(flag + "=") else a for a in argv]


def kvstore_objects(td: str, namespace: str, spec: TandemSpec, owner: Owner) -> list[Manifest]:
    master_host = f"{td}-kvstore-master"
    image = spec.images.kv_store
    pull = spec.images.pull_policy
    master = master_command(kvstore_settings(td, spec, "0.0.0.0"))
    m_lbls = labels(td, "kvstore-master")
    s = kvstore_settings(td, spec, master_host)
    master_port_names = {
        "rpc": s.master_port,
        "metadata": s.metadata_port,
        "metrics": s.master_metrics_port,
    }
    out: list[Manifest] = [
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta(master_host, namespace, owner, m_lbls),
            "spec": {
                "replicas": 1,
                "strategy": {"type": "Recreate"},
                "selector": {"matchLabels": selector(m_lbls)},
                "template": {
                    "metadata": {"labels": m_lbls},
                    "spec": {
                        **pull_secrets(spec),
                        "containers": [
                            {
                                "name": "master",
                                "image": image,
                                "imagePullPolicy": pull,
                                "command": master.argv[:1],
                                "args": master.argv[1:],
                                "ports": [
                                    {"name": n, "containerPort": p}
                                    for n, p in master_port_names.items()
                                ],
                                "readinessProbe": {
                                    "tcpSocket": {"port": "rpc"},
                                    "periodSeconds": 2,
                                },
                                "livenessProbe": {
                                    "httpGet": {"path": "/metrics", "port": "metrics"},
                                    "periodSeconds": 10,
                                    "failureThreshold": 6,
                                },
                                "resources": with_requests(
                                    spec.kv_store.master_resources, KVSTORE_MASTER_REQUESTS
                                ),
                            }
                        ],
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta(master_host, namespace, owner, m_lbls),
            "spec": {
                "selector": selector(m_lbls),
                "ports": [
                    {"name": n, "port": p, "targetPort": n} for n, p in master_port_names.items()
                ],
            },
        },
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
    client_resources = with_requests(
        spec.kv_store.client_resources, {"cpu": KVSTORE_CLIENT_CPU, "memory": f"{pool_mi}Mi"}
    )
    client_resources.setdefault("limits", {}).setdefault(
        "memory", client_resources["requests"]["memory"]
    )
    out.append(
        {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": meta(f"{td}-kvstore-client", namespace, owner, c_lbls),
            "spec": {
                "selector": {"matchLabels": selector(c_lbls)},
                "template": {
                    "metadata": {"labels": c_lbls},
                    "spec": {
                        **store_client_placement(spec),
                        **pull_secrets(spec),
                        "containers": [
                            {
                                "name": "client",
                                "image": image,
                                "imagePullPolicy": pull,
                                "command": argv[:1],
                                "args": argv[1:],
                                "env": env_pod_ip()
                                + [{"name": k, "value": v} for k, v in sorted(client.env.items())],
                                "ports": [
                                    {"name": "rpc", "containerPort": s.client_port},
                                    {"name": "health", "containerPort": s.client_http_port},
                                ],
                                "readinessProbe": {
                                    "httpGet": {"path": "/health", "port": "health"},
                                    "periodSeconds": 5,
                                },
                                "livenessProbe": {
                                    "httpGet": {"path": "/health", "port": "health"},
                                    "periodSeconds": 10,
                                    "failureThreshold": 6,
                                },
                                "resources": client_resources,
                                "volumeMounts": [{"name": "disk", "mountPath": s.disk_path}],
                            }
                        ],
                        "volumes": [
                            {
                                "name": "disk",
                                "hostPath": {
                                    "path": spec.kv_store.disk.host_path,
                                    "type": "DirectoryOrCreate",
                                },
                            }
                        ],
                    },
                },
            },
        }
    )
    out.append(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": meta(f"{td}-kvstore", namespace, owner, labels(td, "kvstore-master")),
            "data": {
                "mooncake-engine.json": json.dumps(engine_store_config(s), indent=2, sort_keys=True)
            },
        }
    )
    return out


def store_client_placement(spec: TandemSpec) -> dict[str, Any]:
    """Where the store clients run: on every node any engine pool may use. The
    pools' node selectors are alternatives (one required node-affinity term
    each, which the scheduler ORs), inside the store's own nodeSelector; a pool
    without a selector may run anywhere, and so do the clients then."""
    out: dict[str, Any] = {}
    if spec.kv_store.node_selector:
        out["nodeSelector"] = dict(spec.kv_store.node_selector)
    selectors = [spec.pool(role).node_selector or {} for role in spec.roles]
    if selectors and all(selectors):
        terms: list[dict[str, Any]] = []
        for node_selector in selectors:
            term = {
                "matchExpressions": [
                    {"key": k, "operator": "In", "values": [v]}
                    for k, v in sorted(node_selector.items())
                ]
            }
            if term not in terms:
                terms.append(term)
        out["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}
            }
        }
    tolerations: list[Mapping[str, Any]] = []
    for role in spec.roles:
        tolerations += [t for t in spec.pool(role).tolerations or () if t not in tolerations]
    if tolerations:
        out["tolerations"] = tolerations
    return out
