"""The pure builders: every rendered object validates against the real Kubernetes
schemas (kubernetes-validate, strict) or, for custom resources, its CRD."""

from __future__ import annotations

import json

import kubernetes_validate
import pytest

from devcluster import schema as crd
from operators import manifests
from operators.spec import crd_schema, parse, problems, with_defaults
from tests.helpers import assert_spec_refused
from tests.operators import lws_schema

OWNER = manifests.Owner("TandemDeployment", "demo", "uid-td")
POOL_OWNER = manifests.Owner("EnginePool", "demo-decode", "uid-pool")


def spec(**overrides) -> dict:
    base = {
        "model": {"path": "/models/llama", "servedName": "llama", "maxModelLen": 32768},
        "prefill": {
            "replicas": 2,
            "parallelism": {"tensor": 2},
            "gpusPerPod": 2,
            "engineArgs": ["--long-prefill-token-threshold=2048"],
        },
        "decode": {"replicas": 4},
        "router": {
            "ingress": {"enabled": True, "host": "llm.example.com", "tlsSecretName": "llm-tls"},
            "apiKeySecretRef": {"name": "keys"},
        },
    }
    base.update(overrides)
    return with_defaults(base)


HF_MODEL = {"source": "hf://Qwen/Qwen3-8B@9c1d2a7", "cache": {"persistentVolumeClaim": "weights"}}


def everything(s: dict) -> list[dict]:
    out = manifests.shared_objects("demo", "prod", parse(s), OWNER)
    if (job := manifests.model_download_job("demo", "prod", parse(s), OWNER)) is not None:
        out.append(job)
    out += manifests.engine_pools("demo", "prod", parse(s), OWNER)
    for role in ("prefill", "decode"):
        out += manifests.pool_workload(
            "demo", "prod", parse(s), role, s[role]["replicas"], POOL_OWNER
        )
    return out


def test_the_spec_itself_validates_against_the_crd():
    body = {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "TandemDeployment",
        "metadata": {"name": "demo"},
        "spec": spec(),
    }
    _, dropped, errors = crd.admit(crd_schema("tandemdeployments"), body)
    assert errors == [] and dropped == []


def test_every_object_validates_and_is_owned():
    objs = everything(spec())
    kinds = sorted(o["kind"] for o in objs)
    assert kinds == sorted(
        [
            "ServiceAccount",
            "RoleBinding",
            "Deployment",
            "Service",
            "PodDisruptionBudget",
            "Ingress",
            "Deployment",
            "Service",
            "Deployment",
            "Service",
            "DaemonSet",
            "ConfigMap",
            "EnginePool",
            "EnginePool",
            "Deployment",
            "Service",
            "Deployment",
            "Service",
        ]
    )
    for obj in objs:
        assert obj["metadata"]["ownerReferences"][0]["uid"] in ("uid-td", "uid-pool")
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "tandem-operator"
        if obj["kind"] == "EnginePool":
            _, _, errors = crd.admit(crd_schema("enginepools"), obj)
            assert errors == []
        else:
            kubernetes_validate.validate(obj, "1.32.0", strict=True)


def test_engine_pods_carry_roles_probes_prestop_and_grace():
    s = spec()
    deploy, service = manifests.pool_workload("demo", "prod", parse(s), "prefill", 2, POOL_OWNER)
    pod = deploy["spec"]["template"]
    assert pod["metadata"]["labels"]["llm-d.ai/role"] == "prefill"
    assert pod["metadata"]["labels"]["tandem.dev/role"] == "prefill"
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == deploy["spec"]["selector"]["matchLabels"]
    container = pod["spec"]["containers"][0]
    assert container["lifecycle"]["preStop"] == {"sleep": {"seconds": 5}}
    assert pod["spec"]["terminationGracePeriodSeconds"] == 120
    argv = container["command"] + container["args"]
    assert "--shutdown-grace-s=110" in argv  # drains inside the grace period
    assert "--tensor-parallel-size=2" in argv and "--role=prefill" in argv
    assert "--long-prefill-token-threshold=2048" in argv
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert deploy["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_kv_store_clients_point_at_the_master_service():
    objs = manifests.shared_objects("demo", "prod", parse(spec()), OWNER)
    ds = next(o for o in objs if o["kind"] == "DaemonSet")
    args = ds["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--master_server_address=demo-kvstore-master:51100" in args
    assert "--host=$(POD_IP)" in args
    config = json.loads(
        next(o for o in objs if o["kind"] == "ConfigMap")["data"]["mooncake-engine.json"]
    )
    assert config["master_server_address"] == "demo-kvstore-master:51100"


def test_multi_node_pools_render_a_leader_worker_set_on_ray():
    s = spec(
        decode={
            "replicas": 2,
            "nodesPerReplica": 2,
            "gpusPerPod": 8,
            "parallelism": {"tensor": 8, "pipeline": 2},
        }
    )
    assert problems(parse(s)) == []
    lws, _ = manifests.pool_workload("demo", "prod", parse(s), "decode", 2, POOL_OWNER)
    assert lws["kind"] == "LeaderWorkerSet" and lws["spec"]["startupPolicy"] == "LeaderCreated"
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2
    leader = group["leaderTemplate"]["spec"]["containers"][0]["args"][0]
    assert "ray start --head" in leader and "--distributed-executor-backend=ray" in leader
    assert "--pipeline-parallel-size=2" in leader
    worker = group["workerTemplate"]["spec"]["containers"][0]["args"][0]
    assert "ray start --address=$(LWS_LEADER_ADDRESS):6379" in worker


def multi_node_lws() -> dict:
    s = spec(
        decode={
            "replicas": 2,
            "nodesPerReplica": 2,
            "gpusPerPod": 8,
            "parallelism": {"tensor": 8, "pipeline": 2},
        }
    )
    return manifests.pool_workload("demo", "prod", parse(s), "decode", 2, POOL_OWNER)[0]


def test_the_leader_worker_set_validates_against_the_lws_api():
    lws = multi_node_lws()
    assert (lws["apiVersion"], lws["kind"]) == (lws_schema.API_VERSION, lws_schema.KIND)
    _, dropped, errors = crd.admit(lws_schema.SCHEMA, lws)
    assert dropped == [] and errors == []
    for side in ("leaderTemplate", "workerTemplate"):
        template = lws["spec"]["leaderWorkerTemplate"][side]
        kubernetes_validate.validate(
            {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": side.lower()},
                "template": template,
            },
            "1.32.0",
            strict=True,
        )


@pytest.mark.parametrize(
    "path,value,expect",
    [
        (("startupPolicy",), "LeaderStarted", "error"),
        (("leaderWorkerTemplate", "size"), 0, "error"),
        (("leaderWorkerTemplate", "restartPolicy"), "Always", "error"),
        (("leaderWorkerTemplate", "groupSize"), 2, "dropped"),
    ],
)
def test_the_lws_schema_refuses_what_lws_would(path, value, expect):
    lws = multi_node_lws()
    node = lws["spec"]
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    _, dropped, errors = crd.admit(lws_schema.SCHEMA, lws)
    assert errors if expect == "error" else dropped, (dropped, errors)


@pytest.mark.parametrize(
    "change,fragment",
    [
        ({"prefill": {"replicas": 5, "maxReplicas": 2}}, "prefill.replicas (5)"),
        ({"decode": {"minReplicas": 3, "maxReplicas": 2}}, "decode.minReplicas (3) exceeds"),
        ({"redis": {"managed": False}}, "redis.url must name the external Redis"),
        (
            {"scaling": {"gpuBudget": 1}, "prefill": {"minReplicas": 1, "gpusPerPod": 2}},
            "below the 2 GPUs",
        ),
        (
            {"decode": {"nodesPerReplica": 2, "gpusPerPod": 4, "parallelism": {"tensor": 4}}},
            "needs parallelism.tensor x parallelism.pipeline = 8",
        ),
        ({"model": {"path": "/m", "source": "/m"}}, "model takes path or source"),
        ({"model": {"source": "hf://Qwen/Qwen3-8B"}}, "needs model.cache.persistentVolumeClaim"),
        (
            {"model": {"source": "pvc://weights/m", "volume": {"hostPath": "/w"}}},
            "model.volume goes with model.path",
        ),
    ],
)
def test_problems_say_what_to_fix_and_the_crd_agrees(change, fragment):
    s = spec(**change)
    assert_spec_refused(s, fragment)


def test_the_operator_role_covers_every_kind_it_writes():
    import yaml

    from operators.kube import PLURALS
    from tests.kube.plugin import REPO

    docs = list(yaml.safe_load_all((REPO / "operators/rbac/operator.yaml").read_text()))
    for doc in docs + list(yaml.safe_load_all((REPO / "operators/rbac/router.yaml").read_text())):
        kubernetes_validate.validate(doc, "1.32.0", strict=True)
    rules = next(d for d in docs if d["kind"] == "ClusterRole")["rules"]

    def allowed(group: str, resource: str, verb: str) -> bool:
        return any(
            group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"]
            for r in rules
        )

    s = spec(
        model=HF_MODEL,
        decode={"replicas": 1, "nodesPerReplica": 2, "gpusPerPod": 1, "parallelism": {"tensor": 2}},
    )
    assert any(obj["kind"] == "Job" for obj in everything(s))
    for obj in everything(s):
        group = obj["apiVersion"].rpartition("/")[0]
        for verb in ("get", "create", "update", "watch"):
            assert allowed(group, PLURALS[obj["kind"]], verb), (obj["kind"], verb)
    assert allowed("tandem.dev", "enginepools/scale", "patch")
    assert allowed("", "pods", "patch")  # deletion costs


def _store_clients(s: dict) -> dict:
    objs = manifests.shared_objects("demo", "prod", parse(s), OWNER)
    return next(o for o in objs if o["kind"] == "DaemonSet")["spec"]["template"]["spec"]


def _schedules_on(pod: dict, node_labels: dict[str, str]) -> bool:
    """Whether the scheduler may place `pod` on a node with these labels (nodeSelector
    AND required node affinity, whose terms are ORed and expressions ANDed)."""
    if any(node_labels.get(k) != v for k, v in (pod.get("nodeSelector") or {}).items()):
        return False
    required = (
        pod.get("affinity", {})
        .get("nodeAffinity", {})
        .get("requiredDuringSchedulingIgnoredDuringExecution")
    )
    if not required:
        return True
    return any(
        all(
            e["operator"] == "In" and node_labels.get(e["key"]) in e["values"]
            for e in term["matchExpressions"]
        )
        for term in required["nodeSelectorTerms"]
    )


def test_store_clients_run_on_every_pools_nodes_not_only_the_last_pools():
    """The store DaemonSet must reach the nodes of every pool: the pools' node
    selectors are alternatives (a node of either pool), never one dict where the
    last pool's value for a shared key overwrites the first's."""
    gpu = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    s = spec(
        prefill={"nodeSelector": {"gpu": "h100", "zone": "a"}, "tolerations": gpu},
        decode={"nodeSelector": {"gpu": "l40s"}, "tolerations": gpu},
    )
    pod = _store_clients(s)
    kubernetes_validate.validate(
        {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": "t"},
            "template": {"spec": pod},
        },
        "1.32.0",
        strict=True,
    )
    assert _schedules_on(pod, {"gpu": "h100", "zone": "a"})  # a prefill node
    assert _schedules_on(pod, {"gpu": "l40s"})  # a decode node
    assert not _schedules_on(pod, {"gpu": "h100", "zone": "b"})  # neither pool's
    assert not _schedules_on(pod, {})
    assert pod["tolerations"] == gpu  # each toleration once


def test_store_clients_keep_their_own_node_selector_beside_the_pools():
    s = spec(
        prefill={"nodeSelector": {"gpu": "h100"}},
        decode={"nodeSelector": {"gpu": "l40s"}},
        kvStore={"nodeSelector": {"tandem.dev/kv-store": "yes"}},
    )
    pod = _store_clients(s)
    assert _schedules_on(pod, {"gpu": "h100", "tandem.dev/kv-store": "yes"})
    assert not _schedules_on(pod, {"gpu": "h100"})


def test_store_clients_go_everywhere_when_a_pool_may_run_anywhere():
    pod = _store_clients(spec(prefill={"nodeSelector": {"gpu": "h100"}}))
    assert _schedules_on(pod, {"gpu": "h100"}) and _schedules_on(pod, {"gpu": "l40s"})


def _pod_templates(obj: dict) -> list[dict]:
    if obj["kind"] in ("Deployment", "DaemonSet"):
        return [obj["spec"]["template"]]
    if obj["kind"] == "LeaderWorkerSet":
        group = obj["spec"]["leaderWorkerTemplate"]
        return [group["leaderTemplate"], group["workerTemplate"]]
    return []


def decode_on(nodes: int) -> dict:
    """One decode replica of 4 GPUs per node over ``nodes`` nodes (2: a LeaderWorkerSet)."""
    return {
        "replicas": 1,
        "nodesPerReplica": nodes,
        "gpusPerPod": 4,
        "parallelism": {"tensor": 4 * nodes},
    }


@pytest.mark.parametrize("nodes", [1, 2])
def test_every_container_has_requests_and_probes(nodes):
    s = spec(decode=decode_on(nodes), router={"replicas": 2})  # two routers: a managed Redis too
    templates = [t for o in everything(s) for t in _pod_templates(o)]
    names = {c["name"] for t in templates for c in t["spec"]["containers"]}
    assert {"router", "redis", "master", "client", "engine"} <= names
    assert ("ray-worker" in names) == (nodes > 1)
    for template in templates:
        for c in template["spec"]["containers"]:
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), c["name"]
            assert "readinessProbe" in c and "livenessProbe" in c, c["name"]
            named = {p["name"] for p in c.get("ports", [])}
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                port = next(iter(c.get(probe, {}).values()), {}).get("port")
                assert not isinstance(port, str) or port in named, (c["name"], probe)


@pytest.mark.parametrize("nodes", [1, 2])
def test_the_pool_service_leaves_a_leaderworkerset_its_own_name(nodes):
    s = spec(decode=decode_on(nodes))
    objs = manifests.pool_workload("demo", "prod", parse(s), "decode", 1, POOL_OWNER)
    [workload] = [o for o in objs if o["kind"] != "Service"]
    [service] = [o for o in objs if o["kind"] == "Service"]
    clash = service["metadata"]["name"] == workload["metadata"]["name"]
    assert clash == (workload["kind"] == "Deployment"), (workload["kind"], service["metadata"])


def test_router_liveness_does_not_depend_on_engines():
    # /health is 503 while no engine can serve: as liveness it would restart
    # routers that wait for engines still loading, which restarting cannot help.
    [router] = [
        c
        for o in everything(spec())
        for t in _pod_templates(o)
        for c in t["spec"]["containers"]
        if c["name"] == "router"
    ]
    assert router["readinessProbe"]["httpGet"]["path"] == "/health"
    for probe in ("livenessProbe", "startupProbe"):
        assert router[probe]["httpGet"]["path"] == "/live", probe
    startup = router["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 30 * 60


def test_store_client_asks_for_its_ram_pool():
    s = spec(kvStore={"ramPool": "32GB", "disk": {"size": "100GB"}})
    client = _store_clients(s)["containers"][0]
    # 32 GiB pool + 1280 MiB disk staging + 1 GiB for the process itself.
    assert client["resources"]["requests"]["memory"] == f"{32 * 1024 + 1280 + 1024}Mi"
    assert client["resources"]["limits"]["memory"] == client["resources"]["requests"]["memory"]
    own = {"requests": {"cpu": "2", "memory": "40Gi"}, "limits": {"memory": "48Gi"}}
    client = _store_clients(spec(kvStore={"clientResources": own}))["containers"][0]
    assert client["resources"] == own


@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize("rdma", [False, True])
def test_engine_pods_get_shared_memory_and_ipc_lock_only_with_rdma(nodes, rdma):
    s = spec(
        prefill={
            "replicas": 1,
            "nodesPerReplica": nodes,
            "gpusPerPod": 8,
            "parallelism": {"tensor": 8 * nodes},
            "shmSize": "20Gi",
            "rdma": rdma,
        }
    )
    workload, _ = manifests.pool_workload("demo", "prod", parse(s), "prefill", 1, POOL_OWNER)
    for template in _pod_templates(workload):
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        assert volumes["shm"] == {
            "name": "shm",
            "emptyDir": {"medium": "Memory", "sizeLimit": "20Gi"},
        }
        container = template["spec"]["containers"][0]
        assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        added = container.get("securityContext", {}).get("capabilities", {}).get("add", [])
        assert added == (["IPC_LOCK"] if rdma else [])
        kubernetes_validate.validate(
            {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": "t"},
                "template": template,
            },
            "1.32.0",
            strict=True,
        )


def test_given_limits_become_the_requests_kubernetes_would_default():
    s = spec(decode={"resources": {"limits": {"cpu": "8", "memory": "80Gi"}}})
    deploy, _ = manifests.pool_workload("demo", "prod", parse(s), "decode", 1, POOL_OWNER)
    requests = deploy["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]
    assert requests == {"cpu": "8", "memory": "80Gi", "nvidia.com/gpu": "1"}


@pytest.mark.parametrize(
    "volume, source",
    [
        ({"hostPath": "/srv/models"}, {"hostPath": {"path": "/srv/models"}}),
        (
            {"persistentVolumeClaim": "weights"},
            {"persistentVolumeClaim": {"claimName": "weights", "readOnly": True}},
        ),
    ],
)
def test_routers_mount_the_model_volume_for_its_tokenizer(volume, source):
    # The router loads the tokenizer from model.path: without the volume a
    # path under /models does not exist in its pod and it exits at start.
    mount = {"name": "model", "mountPath": "/models", "readOnly": True}
    seen = set()
    for obj in everything(spec(model={"path": "/models/llama", "volume": volume})):
        for template in _pod_templates(obj):
            for c in template["spec"]["containers"]:
                if c["name"] in ("router", "engine"):
                    seen.add(c["name"])
                    assert mount in c["volumeMounts"], c["name"]
                    assert {"name": "model", **source} in template["spec"]["volumes"]
    assert seen == {"router", "engine"}
    # A hub id: nothing to mount.
    for obj in everything(spec()):
        for template in _pod_templates(obj):
            if template["spec"]["containers"][0]["name"] == "router":
                assert "volumes" not in template["spec"]


def test_grpc_tls_mounts_the_secret_in_routers_and_engines_and_passes_the_flags():
    tls = {"secretName": "demo-grpc-tls", "serverName": "demo-engine"}
    volume = {"name": "grpc-tls", "secret": {"secretName": "demo-grpc-tls"}}
    mount = {"name": "grpc-tls", "mountPath": "/etc/tandem/grpc-tls", "readOnly": True}
    seen = set()
    for obj in everything(spec(grpcTls=tls)):
        for template in _pod_templates(obj):
            for c in template["spec"]["containers"]:
                if c["name"] not in ("router", "engine"):
                    continue
                seen.add(c["name"])
                assert mount in c["volumeMounts"]
                assert volume in template["spec"]["volumes"]
                flags = [a for a in c["args"] if a.startswith("--grpc-tls-")]
                assert flags[:3] == [
                    "--grpc-tls-cert=/etc/tandem/grpc-tls/tls.crt",
                    "--grpc-tls-key=/etc/tandem/grpc-tls/tls.key",
                    "--grpc-tls-ca=/etc/tandem/grpc-tls/ca.crt",
                ]
                # Only the router dials, so only it checks the engines' name.
                server_name = ["--grpc-tls-server-name=demo-engine"]
                assert flags[3:] == (server_name if c["name"] == "router" else [])
                if c["name"] == "engine":
                    assert "grpc" not in c["readinessProbe"]
                    assert "common.grpc_health" in c["readinessProbe"]["exec"]["command"][2]
    assert seen == {"router", "engine"}
    # Off: plaintext, the kubelet's own gRPC probe, no Secret.
    for obj in everything(spec()):
        for template in _pod_templates(obj):
            for c in template["spec"]["containers"]:
                assert not any(a.startswith("--grpc-tls") for a in c.get("args", []))
                if c["name"] == "engine":
                    assert c["readinessProbe"]["grpc"] == {"port": manifests.GRPC_PORT}


def test_grpc_tls_needs_the_secret_and_the_server_name():
    for missing in ("secretName", "serverName"):
        tls = {"secretName": "s", "serverName": "n"}
        del tls[missing]
        body = {
            "apiVersion": "tandem.dev/v1alpha1",
            "kind": "TandemDeployment",
            "metadata": {"name": "demo"},
            "spec": spec(grpcTls=tls),
        }
        _, _, errors = crd.admit(crd_schema("tandemdeployments"), body)
        assert any(missing in e for e in errors), errors


def test_an_hf_source_is_downloaded_by_a_job_into_the_cache_engines_read():
    objs = everything(spec(model={**HF_MODEL, "hfTokenSecretRef": {"name": "hf-token"}}))
    [job] = [o for o in objs if o["kind"] == "Job"]
    pod = job["spec"]["template"]["spec"]
    assert (job["spec"]["backoffLimit"], pod["restartPolicy"]) == (3, "Never")
    [download] = pod["containers"]
    assert download["command"] == [
        "python",
        "-m",
        "common.model_source",
        "hf://Qwen/Qwen3-8B@9c1d2a7",
    ]
    # The Job alone writes the cache; engines and routers read it.
    assert download["volumeMounts"] == [{"name": "model", "mountPath": "/models"}]
    assert pod["volumes"] == [{"name": "model", "persistentVolumeClaim": {"claimName": "weights"}}]
    token = {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}}
    assert {"name": "HF_TOKEN", "valueFrom": token} in download["env"]
    seen = set()
    for obj in objs:
        for template in _pod_templates(obj):
            for c in template["spec"]["containers"]:
                if c["name"] not in ("router", "engine"):
                    continue
                seen.add(c["name"])
                assert {"name": "model", "mountPath": "/models", "readOnly": True} in c[
                    "volumeMounts"
                ]
                assert "--model=/models/hf/Qwen/Qwen3-8B/9c1d2a7" in c["args"]
                if c["name"] == "engine":
                    assert "--served-model-name=Qwen/Qwen3-8B" in c["args"]
    assert seen == {"router", "engine"}
    # A new revision is a new Job: a Job's pod template cannot change.
    other = spec(model={**HF_MODEL, "source": "hf://Qwen/Qwen3-8B@main"})
    assert (
        manifests.model_download_job("demo", "prod", parse(other), OWNER)["metadata"]["name"]
        != job["metadata"]["name"]
    )


def test_the_download_job_fetches_from_the_hub_endpoint_when_one_is_named():
    def download_env(model: dict) -> list[dict]:
        job = manifests.model_download_job("demo", "prod", parse(spec(model=model)), OWNER)
        return job["spec"]["template"]["spec"]["containers"][0]["env"]

    mirror = "http://hub-mirror.models.svc:8080"
    assert {"name": "HF_ENDPOINT", "value": mirror} in download_env(
        {**HF_MODEL, "hubEndpoint": mirror}
    )
    # Unset: huggingface_hub's own default, the public Hub.
    assert "HF_ENDPOINT" not in {e["name"] for e in download_env(HF_MODEL)}
    # Another mirror is another Job: a failed download retries from the new one.
    named = [
        manifests.model_download_job("demo", "prod", parse(spec(model=m)), OWNER)["metadata"][
            "name"
        ]
        for m in (HF_MODEL, {**HF_MODEL, "hubEndpoint": mirror})
    ]
    assert named[0] != named[1]
    _, _, errors = crd.admit(
        crd_schema("tandemdeployments"),
        {
            "apiVersion": "tandem.dev/v1alpha1",
            "kind": "TandemDeployment",
            "metadata": {"name": "demo"},
            "spec": spec(model={**HF_MODEL, "hubEndpoint": "hub-mirror:8080"}),
        },
    )
    assert any("hubEndpoint" in e for e in errors), errors


def test_a_pvc_source_mounts_the_claim_and_downloads_nothing():
    objs = everything(spec(model={"source": "pvc://weights/llama-3.1-8b"}))
    assert not [o for o in objs if o["kind"] == "Job"]
    engine = next(
        o for o in objs if o["metadata"]["name"] == "demo-decode" and o["kind"] == "Deployment"
    )
    pod = engine["spec"]["template"]["spec"]
    assert {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "weights", "readOnly": True},
    } in pod["volumes"]
    assert "--model=/models/llama-3.1-8b" in pod["containers"][0]["args"]


def test_a_pool_may_spread_over_nodes_and_name_its_scheduler():
    objs = everything(
        spec(decode={"replicas": 4, "spreadAcrossNodes": True, "schedulerName": "volcano"})
    )
    by_name = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Deployment"}
    decode = by_name["demo-decode"]["spec"]["template"]
    assert decode["spec"]["schedulerName"] == "volcano"
    [spread] = decode["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["maxSkew"] == 1
    # It counts the pool's own engine pods, and only them.
    assert spread["labelSelector"]["matchLabels"].items() <= decode["metadata"]["labels"].items()
    assert spread["labelSelector"]["matchLabels"] == manifests.pool_selector("demo", "decode")
    prefill = by_name["demo-prefill"]["spec"]["template"]["spec"]
    assert "topologySpreadConstraints" not in prefill and "schedulerName" not in prefill


def test_a_pool_in_a_pod_group_puts_every_engine_pod_in_it():
    multi = {
        "replicas": 1,
        "nodesPerReplica": 2,
        "gpusPerPod": 8,
        "parallelism": {"tensor": 8, "pipeline": 2},
        "schedulerName": "volcano",
        "podGroup": "demo-decode",
    }
    objs = everything(spec(decode=multi, prefill={"replicas": 1, "podGroup": "demo-prefill"}))
    lws = next(o for o in objs if o["kind"] == "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    prefill = next(
        o for o in objs if o["metadata"]["name"] == "demo-prefill" and o["kind"] == "Deployment"
    )
    templates = [
        ("demo-decode", lws["leaderTemplate"]),
        ("demo-decode", lws["workerTemplate"]),
        ("demo-prefill", prefill["spec"]["template"]),
    ]
    for group, template in templates:
        # Volcano reads the annotation, coscheduling the label.
        assert template["metadata"]["annotations"] == {"scheduling.k8s.io/group-name": group}
        assert template["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == group
    # The pool's own objects do not carry it (a Service or the LWS is no member).
    assert "scheduling.x-k8s.io/pod-group" not in prefill["metadata"]["labels"]
    # None by default.
    plain = next(
        o
        for o in everything(spec())
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "demo-decode"
    )
    assert "annotations" not in plain["spec"]["template"]["metadata"]


POD_OPTIONS = {
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h200"]}]}
                ]
            }
        }
    },
    "priorityClassName": "inference-high",
    "podAnnotations": {"example.com/team": "llm", "scheduling.k8s.io/group-name": "not-mine"},
    "podLabels": {"team": "llm", "app.kubernetes.io/component": "not-mine"},
}


def test_a_pools_pod_options_reach_every_engine_pod_and_ours_win():
    multi = {
        "replicas": 1,
        "nodesPerReplica": 2,
        "gpusPerPod": 8,
        "parallelism": {"tensor": 8, "pipeline": 2},
        "podGroup": "demo-decode",
        "acceleratorResource": "amd.com/gpu",
        "runtimeClassName": "rocm",
        "volumes": [{"name": "scratch", "emptyDir": {}}],
        "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
        "initContainers": [{"name": "warm", "image": "busybox:1.36", "command": ["true"]}],
        "probes": {
            "readiness": {"periodSeconds": 7},
            "startup": {"httpGet": {"path": "/health", "port": "metrics"}, "failureThreshold": 9},
        },
        **POD_OPTIONS,
    }
    objs = everything(spec(decode=multi))
    lws = next(o for o in objs if o["kind"] == "LeaderWorkerSet")
    group = lws["spec"]["leaderWorkerTemplate"]
    for side in ("leaderTemplate", "workerTemplate"):
        template = group[side]
        kubernetes_validate.validate(
            {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": "t"},
                "template": template,
            },
            "1.32.0",
            strict=True,
        )
        pod, meta = template["spec"], template["metadata"]
        assert pod["affinity"] == POD_OPTIONS["affinity"]
        assert (pod["priorityClassName"], pod["runtimeClassName"]) == ("inference-high", "rocm")
        assert pod["initContainers"][0]["name"] == "warm"
        assert {"name": "scratch", "emptyDir": {}} in pod["volumes"]
        [container] = pod["containers"]
        assert {"name": "scratch", "mountPath": "/scratch"} in container["volumeMounts"]
        assert container["resources"]["limits"]["amd.com/gpu"] == "8"
        assert "nvidia.com/gpu" not in container["resources"]["limits"]
        # Extra labels and annotations join; the operator's selector and group keys stay its own.
        assert meta["labels"]["team"] == "llm"
        assert meta["labels"]["app.kubernetes.io/component"] in ("engine", "engine-worker")
        assert meta["annotations"]["example.com/team"] == "llm"
        assert meta["annotations"]["scheduling.k8s.io/group-name"] == "demo-decode"
    leader = group["leaderTemplate"]["spec"]["containers"][0]
    # A given field replaces ours; a given handler replaces our handler.
    assert leader["readinessProbe"]["periodSeconds"] == 7
    assert "grpc" in leader["readinessProbe"]
    assert leader["startupProbe"] == {
        "httpGet": {"path": "/health", "port": "metrics"},
        "periodSeconds": 5,
        "failureThreshold": 9,
    }
    # A Ray worker keeps its raylet probes.
    worker = group["workerTemplate"]["spec"]["containers"][0]
    assert worker["startupProbe"]["httpGet"]["path"] == "/api/local_raylet_healthz"


def test_pull_secrets_reach_every_pod_the_operator_runs():
    s = spec(
        model=HF_MODEL,
        images={"pullSecrets": [{"name": "regcred"}]},
        router={"replicas": 2},
    )
    pods = [
        o["spec"]["template"]["spec"]
        for o in everything(s)
        if o["kind"] in ("Deployment", "DaemonSet", "Job")
    ]
    # router, redis, KV master, store clients, download Job, two pools
    assert len(pods) == 7
    assert all(p["imagePullSecrets"] == [{"name": "regcred"}] for p in pods)
    # None: the pods name no Secret.
    plain = [o for o in everything(spec()) if o["kind"] in ("Deployment", "DaemonSet")]
    assert plain and not any("imagePullSecrets" in o["spec"]["template"]["spec"] for o in plain)


def test_router_service_ingress_and_pod_options():
    router = {
        "service": {
            "type": "LoadBalancer",
            "annotations": {"service.beta.kubernetes.io/aws-load-balancer-internal": "true"},
        },
        "ingress": {
            "enabled": True,
            "host": "llm.example.com",
            "hosts": ["llm.internal", "llm.example.com"],
            "tlsSecretName": "llm-tls",
            "annotations": {"nginx.ingress.kubernetes.io/proxy-read-timeout": "3600"},
        },
        "probes": {"liveness": {"failureThreshold": 12}},
        **POD_OPTIONS,
    }
    objs = everything(spec(router=router))
    for obj in objs:
        if obj["kind"] not in ("EnginePool",):
            kubernetes_validate.validate(obj, "1.32.0", strict=True)
    service = next(
        o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == "demo-router"
    )
    assert service["spec"]["type"] == "LoadBalancer"
    assert service["metadata"]["annotations"] == router["service"]["annotations"]
    ingress = next(o for o in objs if o["kind"] == "Ingress")
    assert [r["host"] for r in ingress["spec"]["rules"]] == ["llm.example.com", "llm.internal"]
    assert ingress["spec"]["tls"] == [
        {"hosts": ["llm.example.com", "llm.internal"], "secretName": "llm-tls"}
    ]
    assert ingress["metadata"]["annotations"] == router["ingress"]["annotations"]
    deployment = next(
        o for o in objs if o["metadata"]["name"] == "demo-router" and o["kind"] == "Deployment"
    )
    template = deployment["spec"]["template"]
    assert template["spec"]["affinity"] == POD_OPTIONS["affinity"]
    assert template["spec"]["priorityClassName"] == "inference-high"
    assert template["metadata"]["labels"]["team"] == "llm"
    assert template["metadata"]["labels"]["app.kubernetes.io/component"] == "router"
    probe = template["spec"]["containers"][0]["livenessProbe"]
    assert probe == {
        "httpGet": {"path": "/live", "port": "http"},
        "periodSeconds": 10,
        "failureThreshold": 12,
    }
    # Defaults: a ClusterIP Service, no annotations, one rule per host or one without.
    plain = everything(spec(router={"ingress": {"enabled": True}}))
    service = next(
        o for o in plain if o["kind"] == "Service" and o["metadata"]["name"] == "demo-router"
    )
    assert service["spec"]["type"] == "ClusterIP" and "annotations" not in service["metadata"]
    assert "host" not in next(o for o in plain if o["kind"] == "Ingress")["spec"]["rules"][0]
