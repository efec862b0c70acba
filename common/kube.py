"""What the operator writes and the router reads on Kubernetes: the labels
that pick a TandemDeployment's engine pods, the names of their Service ports,
and a client to the API server."""

from __future__ import annotations

import os
from pathlib import Path

from kubernetes_asyncio import client, config

LABEL_DEPLOYMENT = "tandem.dev/deployment"
LABEL_ROLE = "tandem.dev/role"
LABEL_POOL = "tandem.dev/pool"  # the engine pool (router request classes name pools)
LABEL_COMPONENT = "app.kubernetes.io/component"
COMPONENT_ENGINE = "engine"

# Ports of a pool's headless Service, as its EndpointSlices name them.
PORT_GRPC = "grpc"
PORT_KV_EVENTS = "kv-events"
PORT_KV_REPLAY = "kv-replay"

_SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def engine_selector(deployment: str) -> str:
    """Label selector of every engine pool of one TandemDeployment (its pods,
    its pools' Services and their EndpointSlices, which inherit the Service's labels)."""
    return f"{LABEL_DEPLOYMENT}={deployment},{LABEL_COMPONENT}={COMPONENT_ENGINE}"


def in_cluster() -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))


def own_namespace() -> str:
    """The namespace of the pod this runs in; "default" outside a cluster."""
    if _SERVICE_ACCOUNT_NAMESPACE.is_file():
        return _SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    return "default"


async def api_client(kubeconfig: str | None = None) -> client.ApiClient:
    """In the cluster (and no kubeconfig named): the pod's service account;
    otherwise a kubeconfig (None: $KUBECONFIG or ~/.kube/config)."""
    if kubeconfig is None and in_cluster():
        config.load_incluster_config()
        return client.ApiClient()
    return await config.new_client_from_config(config_file=kubeconfig)
