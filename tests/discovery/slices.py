"""EndpointSlices as Kubernetes' EndpointSlice controller writes them for the
operator's headless pool Services: the Service's labels, one port list per
slice, one endpoint per pod with its conditions."""

from __future__ import annotations

import sys
from pathlib import Path

from common.kube import (
    COMPONENT_ENGINE,
    LABEL_COMPONENT,
    LABEL_DEPLOYMENT,
    LABEL_ROLE,
    PORT_GRPC,
    PORT_KV_EVENTS,
    PORT_KV_REPLAY,
)


def endpoint(ip: str, pod: str, state: str = "ready") -> dict:
    """state: ready, terminating (serving while it drains) or unready."""
    conditions = {
        "ready": {"ready": True, "serving": True, "terminating": False},
        "terminating": {"ready": False, "serving": True, "terminating": True},
        "unready": {"ready": False, "serving": False, "terminating": False},
    }[state]
    return {
        "addresses": [ip],
        "conditions": conditions,
        "targetRef": {"kind": "Pod", "name": pod, "namespace": "default"},
    }


def endpoint_slice(
    name: str,
    role: str,
    grpc_port: int,
    endpoints: list[dict],
    deployment: str = "demo",
    kv_events_port: int | None = None,
    kv_replay_port: int | None = None,
    namespace: str = "default",
) -> dict:
    ports = [{"name": PORT_GRPC, "port": grpc_port, "protocol": "TCP"}]
    if kv_events_port:
        ports.append({"name": PORT_KV_EVENTS, "port": kv_events_port, "protocol": "TCP"})
    if kv_replay_port:
        ports.append({"name": PORT_KV_REPLAY, "port": kv_replay_port, "protocol": "TCP"})
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {
                LABEL_DEPLOYMENT: deployment,
                LABEL_COMPONENT: COMPONENT_ENGINE,
                LABEL_ROLE: role,
                "kubernetes.io/service-name": f"{deployment}-{role}",
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
            },
        },
        "addressType": "IPv4",
        "ports": ports,
        "endpoints": endpoints,
    }


class Slices:
    """Writes EndpointSlices into the fake API server (devcluster/) as the
    EndpointSlice controller would: create or replace, delete."""

    def __init__(self, kube_api) -> None:
        self._api = kube_api

    def _kind(self):
        return self._api.store.kind("discovery.k8s.io", "v1", "endpointslices")

    def put(self, endpoint_slice: dict) -> None:
        meta = endpoint_slice["metadata"]

        def write() -> None:
            store, kind = self._api.store, self._kind()
            if (kind.key, meta["namespace"], meta["name"]) in store.objects or any(
                o["metadata"]["name"] == meta["name"] for o in store.list(kind, meta["namespace"])
            ):
                store.replace(kind, meta["namespace"], meta["name"], endpoint_slice)
            else:
                store.create(kind, meta["namespace"], endpoint_slice)

        self._api.call(write)

    def delete(self, name: str, namespace: str = "default") -> None:
        self._api.call(lambda: self._api.store.delete(self._kind(), namespace, name))


def discovery_router_argv(host: str, port: int, kubeconfig: Path, *flags: str) -> list[str]:
    """A router that finds the `demo` deployment's pools in namespace default
    through the fake API server, plus the test's own flags."""
    return [
        sys.executable,
        "-m",
        "services.router",
        "--host",
        host,
        "--port",
        str(port),
        "--discovery",
        "kubernetes",
        "--kubeconfig",
        str(kubeconfig),
        "--discovery-namespace",
        "default",
        "--discovery-deployment",
        "demo",
        *flags,
    ]
