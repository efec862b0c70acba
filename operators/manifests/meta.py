"""What every rendered object shares: ports, labels, owner references,
metadata and resource requests (pure)."""

from __future__ import annotations

import hashlib
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
from common.model_source import HF, MOUNT, PVC
from common.tls import GrpcClientTlsSettings
from operators.spec import API_VERSION, ENGINE_ROLE, ProbesSpec, TandemSpec

Manifest = dict[str, Any]

LABEL_LLMD_ROLE = "llm-d.ai/role"
MANAGED_BY = "tandem-operator"
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
# A label value's limit, and a Job's name's (its pods carry it as `job-name`).
DNS_LABEL_MAX = 63

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
MODEL_MOUNT = MOUNT
# The grpcTls Secret, mounted whole (no subPath): a renewed Secret then
# reaches the files in place, and both sides reread them.
GRPC_TLS_DIR = "/etc/tandem/grpc-tls"


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


def dns_label(name: str) -> str:
    """`name` as a DNS label and label value (63 characters at most): a longer
    one is cut and ends in a hash of the whole, as Kubernetes shortens the
    names it generates, so that two long names sharing a prefix stay apart."""
    if len(name) <= DNS_LABEL_MAX:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[: DNS_LABEL_MAX - len(digest) - 1].rstrip('-.')}-{digest}"


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


def pod_metadata(
    own_labels: Mapping[str, str],
    own_annotations: Mapping[str, str] | None = None,
    extra_labels: Mapping[str, str] | None = None,
    extra_annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A pod template's metadata: the spec's extra labels and annotations
    under the operator's own, which win (selectors and PodGroups rely on them)."""
    out: dict[str, Any] = {"labels": {**(extra_labels or {}), **own_labels}}
    annotations = {**(extra_annotations or {}), **(own_annotations or {})}
    if annotations:
        out["annotations"] = annotations
    return out


def pull_secrets(spec: TandemSpec) -> dict[str, Any]:
    """The pod spec fields that name the image pull Secrets, if any."""
    secrets = spec.images.pull_secrets
    return {"imagePullSecrets": [dict(s) for s in secrets]} if secrets else {}


PROBE_HANDLERS = ("exec", "grpc", "httpGet", "tcpSocket")
PROBE_KEYS = {"readiness": "readinessProbe", "liveness": "livenessProbe", "startup": "startupProbe"}


def override_probes(container: dict[str, Any], probes: ProbesSpec | None) -> None:
    """Each probe of `container` with the fields `probes` gives replaced; a
    handler given (httpGet, exec ...) replaces the operator's handler."""
    if probes is None:
        return
    for field, key in PROBE_KEYS.items():
        given = getattr(probes, field)
        if not given:
            continue
        ours = container.get(key, {})
        if any(h in given for h in PROBE_HANDLERS):
            ours = {k: v for k, v in ours.items() if k not in PROBE_HANDLERS}
        container[key] = {**ours, **json.loads(json.dumps(given))}


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
    that reads the model there (engines: weights; routers: the tokenizer),
    or None when the model comes from elsewhere (a hub id vLLM downloads, a
    path in the image): an hf:// source's cache, a pvc:// source's claim,
    else `model.volume`."""
    model = spec.model
    origin = model.origin
    claim = (
        model.cache.persistent_volume_claim
        if origin.kind == HF and model.cache is not None
        else origin.claim
        if origin.kind == PVC
        else model.volume.persistent_volume_claim
        if model.volume is not None
        else None
    )
    if claim:
        source: dict[str, Any] = {"persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
    elif model.volume is not None and model.volume.host_path:
        source = {"hostPath": {"path": model.volume.host_path}}
    else:
        return None
    return {"name": "model", **source}, {
        "name": "model",
        "mountPath": MODEL_MOUNT,
        "readOnly": True,
    }


def grpc_tls(spec: TandemSpec) -> GrpcClientTlsSettings | None:
    """The mTLS flags of the router and the engines (the engines take all but
    the server name), or None when the link is plaintext."""
    tls = spec.grpc_tls
    if tls is None:
        return None
    return GrpcClientTlsSettings(
        grpc_tls_cert=f"{GRPC_TLS_DIR}/tls.crt",
        grpc_tls_key=f"{GRPC_TLS_DIR}/tls.key",
        grpc_tls_ca=f"{GRPC_TLS_DIR}/ca.crt",
        grpc_tls_server_name=tls.server_name,
    )


def grpc_tls_volume(spec: TandemSpec) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The grpcTls Secret's volume and its read-only mount, or None."""
    if spec.grpc_tls is None:
        return None
    return {"name": "grpc-tls", "secret": {"secretName": spec.grpc_tls.secret_name}}, {
        "name": "grpc-tls",
        "mountPath": GRPC_TLS_DIR,
        "readOnly": True,
    }
