"""What every rendered object shares: ports, labels, owner references,
metadata and resource requests (pure)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from common.kube import (
    COMPONENT_ENGINE,
    LABEL_COMPONENT,
    LABEL_DEPLOYMENT,
    LABEL_ROLE,
)
from operators.spec import API_VERSION, ENGINE_ROLE, TandemSpec

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
# Startup probes at 5 s: loading weights and compiling (and, in a group,
# waiting for the workers to join Ray) may take up to half an hour.
ENGINE_STARTUP_PERIODS = 360
REDIS_PORT = 6379
KVSTORE_CONFIG_DIR = "/etc/tandem/kvstore"
# Seconds a pod keeps serving after it is told to stop, before SIGTERM: the
# time for EndpointSlice updates to reach every router replica.
PRESTOP_SECONDS = 5
MODEL_MOUNT = "/models"


@dataclass(frozen=True)
class Owner:
    """Whose object this is: an ownerReference's fields."""

    kind: str
    name: str
    uid: str
    api_version: str = API_VERSION

    def ref(self) -> dict[str, Any]:
        return {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def labels(td: str, component: str, **extra: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "tandem",
        "app.kubernetes.io/instance": td,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        LABEL_COMPONENT: component,
        LABEL_DEPLOYMENT: td,
        **extra,
    }


def meta(name: str, namespace: str, owner: Owner, lbls: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": lbls, "ownerReferences": [owner.ref()]}


def selector(lbls: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in lbls.items() if k in (LABEL_DEPLOYMENT, LABEL_COMPONENT, LABEL_ROLE)}


def pool_name(td: str, role: str) -> str:
    return f"{td}-{role}"


def pool_selector(td: str, role: str) -> dict[str, str]:
    """The labels that pick one pool's engine pods (Service, EndpointSlices, /scale)."""
    return {LABEL_DEPLOYMENT: td, LABEL_COMPONENT: COMPONENT_ENGINE, LABEL_ROLE: ENGINE_ROLE[role]}


def env_pod_ip() -> list[dict[str, Any]]:
    return [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]


def with_requests(resources: Mapping[str, Any] | None, defaults: dict[str, str]) -> dict[str, Any]:
    """`resources` with a request for each of `defaults`' keys it lacks (its limit
    where it sets one: what Kubernetes would default the request to)."""
    out: dict[str, Any] = json.loads(json.dumps(resources or {}))
    requests = out.setdefault("requests", {})
    for key, value in defaults.items():
        requests.setdefault(key, out.get("limits", {}).get(key, value))
    return out


def model_volume(spec: TandemSpec) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The model's volume and its read-only mount at /models, for every pod
    that reads `model.path` there (engines: weights; routers: the tokenizer),
    or None when the model comes from elsewhere (a hub id)."""
    vol = spec.model.volume
    if vol is not None and vol.persistent_volume_claim:
        source: dict[str, Any] = {
            "persistentVolumeClaim": {"claimName": vol.persistent_volume_claim, "readOnly": True}
        }
    elif vol is not None and vol.host_path:
        source = {"hostPath": {"path": vol.host_path}}
    else:
        return None
    return {"name": "model", **source}, {
        "name": "model",
        "mountPath": MODEL_MOUNT,
        "readOnly": True,
    }
