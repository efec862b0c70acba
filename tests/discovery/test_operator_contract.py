"""What the operator renders and what the router reads agree: the router
accepts the flags of the operator's router Deployment, an EndpointSlice of each
pool's headless Service (built as Kubernetes' EndpointSlice controller builds
it: the Service's labels, its port names with the pods' port numbers) matches
the router's selector and names engines of the pool's role, and the router's
RBAC role lets it list and watch EndpointSlices."""

from __future__ import annotations

from pathlib import Path

import yaml

from common.kube import engine_selector
from devcluster.store import Store
from operators import manifests
from operators.spec import ENGINE_ROLE, parse, with_defaults
from services.router.config import parse_settings
from services.router.discovery import slice_endpoints
from tests.discovery.slices import endpoint

REPO = Path(__file__).resolve().parents[2]
OWNER = manifests.Owner("TandemDeployment", "demo", "uid-td")


def rendered() -> list[dict]:
    spec = with_defaults(
        {
            "model": {"path": "/models/llama", "servedName": "llama"},
            "prefill": {"replicas": 1},
            "decode": {"replicas": 2},
        }
    )
    out = manifests.shared_objects("demo", "prod", parse(spec), OWNER)
    for role in ("prefill", "decode"):
        out += manifests.pool_workload("demo", "prod", parse(spec), role, 1, OWNER)
    return out


def test_the_router_accepts_the_operators_flags():
    [router] = [
        o
        for o in rendered()
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "demo-router"
    ]
    container = router["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["python", "-m", "services.router"]
    settings = parse_settings(container["args"])
    assert settings.discovery.kubernetes
    assert settings.discovery.discovery_deployment == "demo"
    assert settings.discovery.discovery_namespace == "prod"


def test_pool_endpoint_slices_match_the_routers_selector_and_name_the_pools_role():
    objs = rendered()
    matches, _ = Store.matchers(engine_selector("demo"), None)
    for role in ("prefill", "decode"):
        name = manifests.pool_name("demo", role)
        service = next(o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == name)
        deployment = next(
            o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == name
        )
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        container_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        endpoint_slice = {
            "metadata": {
                "name": f"{name}-abcde",
                "labels": {**service["metadata"]["labels"], "kubernetes.io/service-name": name},
            },
            "ports": [
                {"name": p["name"], "port": container_ports[p["targetPort"]]}
                for p in service["spec"]["ports"]
            ],
            "endpoints": [endpoint("10.1.2.3", f"{name}-0")],
        }
        assert matches(endpoint_slice["metadata"]["labels"])
        [ep] = slice_endpoints(endpoint_slice)
        assert ep.spec.role == ENGINE_ROLE[role]
        assert ep.spec.name == f"10.1.2.3:{manifests.GRPC_PORT}"
        assert ep.spec.kv_events == f"tcp://10.1.2.3:{manifests.KV_EVENTS_PORT}"
        assert ep.spec.kv_events_replay == f"tcp://10.1.2.3:{manifests.KV_REPLAY_PORT}"
    # Other components' Services never match.
    others = [
        o
        for o in objs
        if o["kind"] == "Service" and o["metadata"]["labels"][manifests.LABEL_COMPONENT] != "engine"
    ]
    assert others and not any(matches(o["metadata"]["labels"]) for o in others)


def test_the_routers_role_lets_it_list_and_watch_endpoint_slices():
    [role] = [d for d in yaml.safe_load_all((REPO / "operators/rbac/router.yaml").read_text()) if d]
    assert any(
        "discovery.k8s.io" in rule["apiGroups"]
        and "endpointslices" in rule["resources"]
        and {"list", "watch"} <= set(rule["verbs"])
        for rule in role["rules"]
    )


def test_the_engine_host_accepts_the_operators_engine_flags():
    from services.engine.config import parse_settings as engine_settings

    # Without the KV store: with it, the engine reads the store's config file at start.
    spec = with_defaults(
        {
            "model": {"path": "/models/llama", "servedName": "llama"},
            "prefill": {"replicas": 1},
            "decode": {"replicas": 1},
            "kvStore": {"enabled": False},
        }
    )
    for role in ("prefill", "decode"):
        argv = manifests.engine_argv("demo", parse(spec), role)
        assert argv[:3] == ["python", "-m", "services.engine"]
        settings = engine_settings(argv[3:])
        assert settings.role == ENGINE_ROLE[role]
        assert settings.shutdown_grace_s == spec[role]["terminationGracePeriodSeconds"] - 10
