"""Managed Redis, the state several router replicas share (pure)."""

from __future__ import annotations

from operators.manifests.meta import (
    REDIS_PORT,
    Manifest,
    Owner,
    labels,
    meta,
    pull_secrets,
    selector,
    with_requests,
)
from operators.spec import TandemSpec

REDIS_REQUESTS = {"cpu": "250m", "memory": "512Mi"}


def redis_url(td: str, spec: TandemSpec) -> str | None:
    """The Redis the routers share, or None for one router replica (it keeps
    its state in memory)."""
    if spec.router.replicas <= 1 and spec.redis.managed:
        return None
    if spec.redis.managed:
        return f"redis://{td}-redis:{REDIS_PORT}/0"
    return spec.redis.url


def redis_objects(td: str, namespace: str, spec: TandemSpec, owner: Owner) -> list[Manifest]:
    lbls = labels(td, "redis")
    container = {
        "name": "redis",
        "image": spec.images.redis,
        "imagePullPolicy": spec.images.pull_policy,
        # Shared router state is soft state: no persistence.
        "args": ["--save", "", "--appendonly", "no"],
        "ports": [{"name": "redis", "containerPort": REDIS_PORT}],
        "readinessProbe": {"exec": {"command": ["redis-cli", "ping"]}, "periodSeconds": 2},
        "livenessProbe": {
            "tcpSocket": {"port": "redis"},
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
        "resources": with_requests(spec.redis.resources, REDIS_REQUESTS),
    }
    return [
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta(f"{td}-redis", namespace, owner, lbls),
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": selector(lbls)},
                "template": {
                    "metadata": {"labels": lbls},
                    "spec": {**pull_secrets(spec), "containers": [container]},
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta(f"{td}-redis", namespace, owner, lbls),
            "spec": {
                "selector": selector(lbls),
                "ports": [{"name": "redis", "port": REDIS_PORT, "targetPort": "redis"}],
            },
        },
    ]
