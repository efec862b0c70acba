"""The router: its Deployment, Service, PodDisruptionBudget, ServiceAccount
and RoleBinding (it watches EndpointSlices), and an optional Ingress (pure)."""

from __future__ import annotations

from typing import Any

from common.router import DiscoverySettings, RouterCommand, RouterLaunchSettings
from common.settings import to_argv
from operators.manifests.meta import (
    ENGINE_STARTUP_PERIODS,
    PRESTOP_SECONDS,
    ROUTER_PORT,
    Manifest,
    Owner,
    grpc_tls,
    grpc_tls_volume,
    labels,
    meta,
    model_volume,
    override_probes,
    pod_metadata,
    pull_secrets,
    selector,
    with_requests,
)
from operators.manifests.redis import redis_url
from operators.spec import TandemSpec

# Requests when the spec gives none: the scheduler places no pod blind, and a
# busy node does not starve the router.
ROUTER_REQUESTS = {"cpu": "1", "memory": "1Gi"}


def router_objects(td: str, namespace: str, spec: TandemSpec, owner: Owner) -> list[Manifest]:
    router = spec.router
    lbls = labels(td, "router")
    url = redis_url(td, spec)
    command = RouterCommand(
        RouterLaunchSettings(
            host="0.0.0.0",
            port=ROUTER_PORT,
            model=spec.model.origin.model_path,
            served_model_name=spec.model.served_name or None,
        ),
        DiscoverySettings(
            discovery="kubernetes", discovery_namespace=namespace, discovery_deployment=td
        ),
        # The routing settings sit beside the policies (services/router/routing),
        # which the operator may not import: the router's parser checks these
        # (tests/operators/test_service_commands.py).
        (
            f"--policy={router.policy}",
            *([f"--redis-url={url}"] if url else []),
            *(to_argv(tls, joined=True) if (tls := grpc_tls(spec)) else []),
        ),
    )
    env: list[dict[str, Any]] = []
    ref = router.api_key_secret_ref
    if ref is not None:
        env.append(
            {
                "name": "TANDEM_ROUTER_API_KEYS",
                "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}},
            }
        )
    container = {
        "name": "router",
        "image": spec.images.router,
        "imagePullPolicy": spec.images.pull_policy,
        "command": command.argv()[:3],
        "args": command.argv(joined=True)[3:] + list(router.args or ()),
        "env": env,
        "ports": [{"name": "http", "containerPort": ROUTER_PORT}],
        # Ready while some engine can serve; alive while the process answers
        # HTTP, engines or not. The router listens only once an engine has
        # answered (it asks them the model), so startup waits as long as the
        # engines' own startup probes do.
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 2},
        "startupProbe": {
            "httpGet": {"path": "/live", "port": "http"},
            "periodSeconds": 5,
            "failureThreshold": ENGINE_STARTUP_PERIODS,
        },
        "livenessProbe": {
            "httpGet": {"path": "/live", "port": "http"},
            "periodSeconds": 10,
            "failureThreshold": 6,
        },
        # Keep answering while the Service stops sending here, then drain.
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SECONDS}}},
        "resources": with_requests(router.resources, ROUTER_REQUESTS),
    }
    override_probes(container, router.probes)
    pod: dict[str, Any] = {
        "serviceAccountName": f"{td}-router",
        "containers": [container],
        "terminationGracePeriodSeconds": 60,
        **pull_secrets(spec),
    }
    if router.affinity:
        pod["affinity"] = dict(router.affinity)
    if router.priority_class_name:
        pod["priorityClassName"] = router.priority_class_name
    # The model (the router tokenizes with its own tokenizer, read where the
    # engines read the weights) and the mTLS Secret.
    volumes = [v for v in (model_volume(spec), grpc_tls_volume(spec)) if v is not None]
    if volumes:
        container["volumeMounts"] = [mount for _, mount in volumes]
        pod["volumes"] = [volume for volume, _ in volumes]
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(f"{td}-router", namespace, owner, lbls),
        "spec": {
            "replicas": router.replicas,
            "selector": {"matchLabels": selector(lbls)},
            "template": {
                "metadata": pod_metadata(
                    lbls, extra_labels=router.pod_labels, extra_annotations=router.pod_annotations
                ),
                "spec": pod,
            },
        },
    }
    service: Manifest = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(f"{td}-router", namespace, owner, lbls),
        "spec": {
            "type": router.service.type,
            "selector": selector(lbls),
            "ports": [{"name": "http", "port": 80, "targetPort": "http"}],
        },
    }
    if router.service.annotations:
        service["metadata"]["annotations"] = dict(router.service.annotations)
    pdb = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": meta(f"{td}-router", namespace, owner, lbls),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(lbls)}},
    }
    account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": meta(f"{td}-router", namespace, owner, lbls),
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": meta(f"{td}-router", namespace, owner, lbls),
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": "tandem-router",
        },
        "subjects": [{"kind": "ServiceAccount", "name": f"{td}-router", "namespace": namespace}],
    }
    out: list[Manifest] = [account, binding, deployment, service, pdb]
    ingress = router.ingress
    if ingress.enabled:
        http = {
            "paths": [
                {
                    "path": "/",
                    "pathType": "Prefix",
                    "backend": {"service": {"name": f"{td}-router", "port": {"name": "http"}}},
                }
            ]
        }
        hosts = ingress.all_hosts
        # No host: one rule for every host name the Ingress is reached by.
        rules = [{"host": host, "http": http} for host in hosts] or [{"http": http}]
        ing_spec: dict[str, Any] = {"rules": rules}
        if ingress.class_name:
            ing_spec["ingressClassName"] = ingress.class_name
        if ingress.tls_secret_name:
            ing_spec["tls"] = [{"hosts": hosts, "secretName": ingress.tls_secret_name}]
        ing_meta = meta(f"{td}-router", namespace, owner, lbls)
        if ingress.annotations:
            ing_meta["annotations"] = dict(ingress.annotations)
        out.append(
            {
                "apiVersion": "networking.k8s.io/v1",
                "kind": "Ingress",
                "metadata": ing_meta,
                "spec": ing_spec,
            }
        )
    return out
