"""The one Node every pod is bound to.

Created when the controllers start, Ready, with this machine's CPUs and
memory as capacity. GPU requests are not honoured by the local cluster (the
kubelet runs engines on CPU), so the node advertises plenty of
`nvidia.com/gpu` for pods that ask for GPUs to fit.
"""

from __future__ import annotations

import os

from devcluster import semantics
from devcluster.controllers.base import NODE_NAME, NODES
from devcluster.store import ApiError, Store

ADVERTISED_GPUS = "64"


def node_object() -> dict:
    cpus = str(os.cpu_count() or 1)
    memory = f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') // 1024}Ki"
    resources = {"cpu": cpus, "memory": memory, "nvidia.com/gpu": ADVERTISED_GPUS, "pods": "110"}
    now = semantics.now_rfc3339()
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": NODE_NAME,
            "labels": {
                "kubernetes.io/hostname": NODE_NAME,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
            },
        },
        "spec": {},
        "status": {
            "capacity": resources,
            "allocatable": resources,
            "addresses": [
                {"type": "InternalIP", "address": "127.0.0.1"},
                {"type": "Hostname", "address": NODE_NAME},
            ],
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "devcluster node is ready",
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": now,
                }
            ],
        },
    }


def ensure_node(store: Store) -> dict:
    kind = store.kinds[NODES]
    try:
        return store.get(kind, None, NODE_NAME)
    except ApiError as exc:
        if exc.status != 404:
            raise
    return store.create(kind, None, node_object())
