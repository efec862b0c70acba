"""Values a platform team looks for (as production-stack and llm-d name them):
pull secrets, pod options of the engine pools and the router, probes, the
router's Service and Ingress, an HTTPRoute, extra objects and further models.

The chart passes pod options to the TandemDeployment; the operator renders the
pods. So each test renders the chart with Helm, hands its TandemDeployments to
the operator's own builders (operators/manifests) and checks the pods those
write, validated by the Kubernetes schemas like every rendered object.
"""

from __future__ import annotations

import helm_python as helm
import pytest

from operators import manifests
from operators.spec import parse
from tests.helm.cases import CASES
from tests.helm.chart import NAMESPACE, by_kind, notes, one, pod_templates, problems, render

OWNER = manifests.Owner("TandemDeployment", "tandem", "uid-td")


def operator_objects(docs: list[dict]) -> list[dict]:
    """What the operator writes for every TandemDeployment the chart rendered."""
    out: list[dict] = []
    for td in by_kind(docs, "TandemDeployment"):
        name, spec = td["metadata"]["name"], parse(td["spec"])
        out += manifests.shared_objects(name, NAMESPACE, spec, OWNER)
        if (job := manifests.model_download_job(name, NAMESPACE, spec, OWNER)) is not None:
            out.append(job)
        for role in spec.roles:
            out += manifests.pool_workload(name, NAMESPACE, spec, role, 1, OWNER)
    return out


def valid(objects: list[dict]) -> list[dict]:
    """`objects`, each and each pod template checked by the Kubernetes schemas."""
    found = [p for obj in objects for p in problems(obj)]
    for obj in objects:
        for i, template in enumerate(pod_templates(obj)):
            pod_template = {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": f"{obj['metadata']['name']}-{i}"},
                "template": template,
            }
            found += problems(pod_template)
    assert not found, "\n".join(found)
    return objects


def workload(objects: list[dict], name: str) -> dict:
    [found] = [
        o
        for o in objects
        if o["metadata"]["name"] == name and o["kind"] in ("Deployment", "LeaderWorkerSet")
    ]
    return found


def test_pool_pod_options_reach_every_engine_pod():
    values = CASES["feature-pod-options"]
    objects = valid(operator_objects(render(values)))
    prefill = pod_templates(workload(objects, "tandem-prefill"))
    decode = pod_templates(workload(objects, "tandem-decode"))
    assert len(prefill) == 1 and len(decode) == 2  # a LeaderWorkerSet: leader and workers
    [template] = prefill
    pod, given = template["spec"], values["prefill"]
    assert pod["affinity"] == given["affinity"]
    assert (pod["priorityClassName"], pod["runtimeClassName"]) == ("inference-high", "rocm")
    assert pod["initContainers"] == given["initContainers"]
    assert given["volumes"][0] in pod["volumes"]
    [engine] = pod["containers"]
    assert given["volumeMounts"][0] in engine["volumeMounts"]
    assert engine["resources"]["limits"]["amd.com/gpu"] == "1"
    assert "nvidia.com/gpu" not in engine["resources"]["limits"]
    # A probe keeps the operator's handler and fields the values leave alone.
    assert engine["startupProbe"]["failureThreshold"] == 720
    assert "grpc" in engine["startupProbe"] and engine["startupProbe"]["periodSeconds"] == 5
    assert engine["livenessProbe"]["timeoutSeconds"] == 5
    assert template["metadata"]["annotations"] == {"example.com/cost-center": "llm"}
    assert template["metadata"]["labels"]["team"] == "llm"
    for template in decode:
        [container] = template["spec"]["containers"]
        assert container["resources"]["limits"]["habana.ai/gaudi"] == "8"
        assert {"name": "scratch", "mountPath": "/scratch"} in container["volumeMounts"]
        assert template["metadata"]["labels"]["team"] == "llm"
    # Unset: none of them, and nvidia.com/gpu.
    plain = pod_templates(workload(operator_objects(render({})), "tandem-decode"))[0]["spec"]
    assert not {"affinity", "priorityClassName", "runtimeClassName", "initContainers"} & set(plain)
    assert plain["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_pull_secrets_reach_the_charts_pods_and_every_pod_the_operator_runs():
    values = {**CASES["feature-pod-options"], **CASES["feature-model-hf-cache"]}
    docs = render(values)
    pods = [t["spec"] for obj in docs + operator_objects(docs) for t in pod_templates(obj)]
    # the chart's operator and test pod; router, Redis, KV master and clients,
    # download Job, prefill, decode leader and workers
    assert len(pods) == 10
    assert all(p.get("imagePullSecrets") == [{"name": "regcred"}] for p in pods)
    plain = render({})
    assert not any(
        "imagePullSecrets" in t["spec"]
        for obj in plain + operator_objects(plain)
        for t in pod_templates(obj)
    )


def test_router_service_ingress_probes_and_pod_options():
    values = CASES["feature-router-options"]["router"]
    objects = valid(operator_objects(render(CASES["feature-router-options"])))
    service = one([o for o in objects if o["metadata"]["name"] == "tandem-router"], "Service")
    assert service["spec"]["type"] == "LoadBalancer"
    assert service["metadata"]["annotations"] == values["service"]["annotations"]
    ingress = one(objects, "Ingress")
    assert [r["host"] for r in ingress["spec"]["rules"]] == values["ingress"]["hosts"]
    assert ingress["spec"]["tls"] == [
        {"hosts": values["ingress"]["hosts"], "secretName": "llm-tls"}
    ]
    assert ingress["metadata"]["annotations"] == values["ingress"]["annotations"]
    [template] = pod_templates(workload(objects, "tandem-router"))
    assert template["spec"]["affinity"] == values["affinity"]
    assert template["spec"]["priorityClassName"] == "inference-high"
    assert template["metadata"]["annotations"] == values["podAnnotations"]
    assert template["metadata"]["labels"]["team"] == "llm"
    readiness = template["spec"]["containers"][0]["readinessProbe"]
    assert readiness == {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5}
    # The default Service is ClusterIP, unannotated.
    plain = one(
        [o for o in operator_objects(render({})) if o["metadata"]["name"] == "tandem-router"],
        "Service",
    )
    assert plain["spec"]["type"] == "ClusterIP" and "annotations" not in plain["metadata"]


@pytest.mark.parametrize(
    "case,backend",
    [
        ("http-route", {"kind": "Service", "name": "tandem-router", "port": 80}),
        (
            "http-route-inference-pool",
            {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "tandem"},
        ),
    ],
)
def test_http_route_sends_the_gateways_requests_to_the_router_or_the_inference_pool(case, backend):
    docs = render(CASES[f"feature-{case}"])
    route = one(docs, "HTTPRoute")
    assert problems(route) == []
    [rule] = route["spec"]["rules"]
    assert rule["backendRefs"] == [backend]
    assert route["spec"]["parentRefs"] == CASES[f"feature-{case}"]["httpRoute"]["parentRefs"]
    if backend["kind"] == "Service":
        # The router Service the operator creates, on the port the route names.
        service = one(
            [o for o in operator_objects(docs) if o["metadata"]["name"] == backend["name"]],
            "Service",
        )
        assert service["spec"]["ports"][0]["port"] == backend["port"]
        assert rule["timeouts"] == {"request": "3600s"}
        assert route["spec"]["hostnames"] == ["llm.example.com"]
    else:
        assert one(docs, "InferencePool")["metadata"]["name"] == backend["name"]
        assert "timeouts" not in rule and "hostnames" not in route["spec"]
    assert not by_kind(render({}), "HTTPRoute")


def test_extra_objects_render_as_written_and_strings_through_tpl():
    docs = render(CASES["feature-extra-objects"])
    config = one(docs, "ConfigMap", "tandem-notes")
    assert config["data"] == {"model": "Qwen/Qwen3-8B"}
    assert one(docs, "ServiceAccount", "tandem-batch")["metadata"]["namespace"] == NAMESPACE


def test_extra_models_each_get_a_tandem_deployment_merged_over_the_release():
    values = CASES["feature-extra-models"]
    docs = render(values)
    tds = {td["metadata"]["name"]: td["spec"] for td in by_kind(docs, "TandemDeployment")}
    assert sorted(tds) == ["tandem", "tandem-coder", "tandem-embed"]
    main, coder, embed = tds["tandem"], tds["tandem-coder"], tds["tandem-embed"]
    # What an entry gives replaces the release's; the rest is the release's.
    assert coder["model"]["path"] == "Qwen/Qwen2.5-Coder-7B-Instruct"
    assert "source" not in coder["model"] and coder["model"]["servedName"] == "coder"
    assert (coder["decode"]["replicas"], coder["router"]["replicas"]) == (2, 1)
    assert coder["prefill"] == main["prefill"] and coder["images"] == main["images"]
    assert embed["prefill"]["gpusPerPod"] == 0 and embed["kvStore"]["enabled"] is False
    # Per model: the cache claim the chart creates, the API key Secret, autoscalers.
    claims = {c["metadata"]["name"] for c in by_kind(docs, "PersistentVolumeClaim")}
    assert claims == {"tandem-model-cache", "tandem-coder-model-cache", "tandem-embed-model-cache"}
    assert embed["model"]["cache"] == {"persistentVolumeClaim": "tandem-embed-model-cache"}
    secrets = {s["metadata"]["name"] for s in by_kind(docs, "Secret")}
    assert secrets == {"tandem-api-keys", "tandem-coder-api-keys", "tandem-embed-api-keys"}
    assert coder["router"]["apiKeySecretRef"]["name"] == "tandem-coder-api-keys"
    targets = {o["spec"]["scaleTargetRef"]["name"] for o in by_kind(docs, "ScaledObject")}
    assert targets == {"tandem-decode", "tandem-coder-decode", "tandem-embed-decode"}
    # Not shared by two models on one node: the KV disk tier's folder; an Ingress host.
    assert coder["kvStore"]["disk"]["hostPath"] == "/var/lib/tandem/kv-coder"
    assert "ingress" not in coder["router"]
    assert embed["router"]["ingress"] == {"enabled": True, "host": "embed.example.com"}
    # Each TandemDeployment is one the operator renders valid objects from.
    objects = valid(operator_objects(docs))
    routers = {o["metadata"]["name"] for o in objects if o["kind"] == "Service"} & {
        "tandem-router",
        "tandem-coder-router",
        "tandem-embed-router",
    }
    assert len(routers) == 3


@pytest.mark.parametrize(
    "values,message",
    [
        (
            {"extraModels": [{"name": "a-rather-long-name-x"}]},
            "longer than 40 characters",
        ),
        (
            {
                "redis": {"managed": False, "url": "redis://r:6379"},
                "extraModels": [{"name": "coder"}],
            },
            "extraModels need redis.managed",
        ),
    ],
)
def test_extra_models_the_chart_cannot_serve_are_refused(values, message):
    with pytest.raises(helm.HelmError) as refused:
        render(values, release="a-release-named-at-length")
    assert message in str(refused.value)


def test_notes_name_each_further_models_deployment_and_router():
    text = notes(CASES["feature-extra-models"])
    for name in ("coder", "embed"):
        assert f"kubectl -n {NAMESPACE} get td tandem-{name} -w" in text
        assert f"svc/tandem-{name}-router 8001:80" in text
    assert "extraModels" not in notes({})


def test_a_token_in_values_becomes_the_secret_the_download_job_reads():
    docs = render(CASES["feature-model-hf-token-value"])
    secret = one(docs, "Secret", "tandem-hf-token")
    assert secret["stringData"] == {"HF_TOKEN": "hf_0123456789abcdef"}
    ref = one(docs, "TandemDeployment")["spec"]["model"]["hfTokenSecretRef"]
    assert ref == {"name": "tandem-hf-token", "key": "HF_TOKEN"}
    [job] = [o for o in valid(operator_objects(docs)) if o["kind"] == "Job"]
    env = {e["name"]: e for e in pod_templates(job)[0]["spec"]["containers"][0]["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == ref
    # A Secret of yours: the chart writes none.
    docs = render(CASES["feature-model-hf-cache"])
    assert not by_kind(docs, "Secret")
    assert one(docs, "TandemDeployment")["spec"]["model"]["hfTokenSecretRef"]["name"] == "hf-token"
