"""The chart rendered by Helm's own library, every object validated by real schemas.

No mocks: Helm's Go SDK renders (helm-python-sdk), kubernetes-validate holds
the Kubernetes OpenAPI schemas, custom resources are admitted against their
CRDs with CEL rules evaluated (devcluster/schema.py): the chart's own, and
other projects' kinds (LeaderWorkerSet, InferencePool, ServiceMonitor,
PodMonitor) as tests/helm/foreign_schemas.py writes them from their API docs.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import tarfile

import helm_python as helm
import pytest
import yaml

from operators import manifests
from operators.controller import foreign_autoscaler
from operators.manifests import GRPC_PORT, ROUTER_PORT
from operators.spec import API_VERSION, CRD_DIR, parse
from tandem import profile
from tests.helm.cases import CASES, EXAMPLE_NAMES
from tests.helm.chart import (
    CHART_DIR,
    EXAMPLES,
    NAMESPACE,
    RELEASE,
    REPO,
    by_kind,
    chart,
    chart_crds,
    notes,
    one,
    problems,
    render,
)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_rendered_object_is_valid(case):
    docs = render(CASES[case])
    found = [p for doc in docs for p in problems(doc)]
    assert not found, "\n".join(found)
    # Every object names its namespace but the cluster-scoped ones.
    for doc in docs:
        cluster_scoped = doc["kind"] in ("ClusterRole", "ClusterRoleBinding")
        assert ("namespace" in doc["metadata"]) != cluster_scoped, doc["metadata"]["name"]
        if not cluster_scoped:
            assert doc["metadata"]["namespace"] == NAMESPACE


def test_default_values_install_operator_and_one_tandem_deployment():
    docs = render({})
    kinds = sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs)
    assert kinds == [
        "ClusterRole/tandem-operator",
        "ClusterRole/tandem-operator-cluster",
        "ClusterRole/tandem-router",
        "ClusterRoleBinding/tandem-operator-cluster",
        "Deployment/tandem-operator",
        "Pod/tandem-test-chat",
        "RoleBinding/tandem-operator",
        "Service/tandem-operator",
        "ServiceAccount/tandem-operator",
        "TandemDeployment/tandem",
    ]
    td = one(docs, "TandemDeployment")
    assert td["spec"]["model"]["path"] == chart().values["model"]["path"]
    for role in ("prefill", "decode"):
        assert td["spec"][role]["gpusPerPod"] == 1
    # The operator watches the release's namespace only.
    args = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--namespace={NAMESPACE}" in args


def test_the_chart_ships_the_operators_crds():
    assert os.readlink(CHART_DIR / "crds") == "../../operators/crds"
    shipped = {c["name"]: c["data"] for c in chart().crds}
    own = {f"crds/{p.name}": p.read_text() for p in sorted(CRD_DIR.glob("*.yaml"))}
    assert shipped == own
    assert sorted(c["metadata"]["name"] for c in chart_crds()) == [
        "enginepools.tandem.dev",
        "tandemdeployments.tandem.dev",
        "tandemprofiles.tandem.dev",
    ]


def test_the_operators_rbac_is_operators_rbac():
    for name in ("operator.yaml", "router.yaml"):
        link = CHART_DIR / "files" / "rbac" / name
        assert os.readlink(link) == f"../../../../operators/rbac/{name}"
    own_text = (REPO / "operators" / "rbac" / "operator.yaml").read_text()
    own = [d for d in yaml.safe_load_all(own_text) if d and d["kind"] == "ClusterRole"]
    rendered = one(render({}), "ClusterRole", f"{RELEASE}-operator")
    assert rendered["rules"] == own[0]["rules"]
    router = yaml.safe_load((REPO / "operators" / "rbac" / "router.yaml").read_text())
    assert one(render({}), "ClusterRole", "tandem-router")["rules"] == router["rules"]


def test_the_packaged_chart_carries_the_crds_as_files(tmp_path):
    archive = helm.package(CHART_DIR, destination=tmp_path)
    with tarfile.open(archive) as tar:
        crds = {m.name: m for m in tar.getmembers() if "/crds/" in m.name}
        assert sorted(crds) == [
            "tandem/crds/enginepools.yaml",
            "tandem/crds/tandemdeployments.yaml",
            "tandem/crds/tandemprofiles.yaml",
        ]
        assert all(m.isfile() for m in crds.values())
    with helm.Chart.load(archive) as packaged:
        assert packaged.crds == chart().crds
        assert packaged.render({}, name=RELEASE, namespace=NAMESPACE) == chart().render(
            {}, name=RELEASE, namespace=NAMESPACE
        )


def test_examples_render_what_they_say():
    one_node = one(
        render(yaml.safe_load((EXAMPLES / "one-node-8gpu-1p1d-tp4.yaml").read_text())),
        "TandemDeployment",
    )["spec"]
    for role in ("prefill", "decode"):
        assert (
            one_node[role]["replicas"],
            one_node[role]["gpusPerPod"],
            one_node[role]["parallelism"]["tensor"],
        ) == (1, 4, 4)
    assert one_node["prefill"]["gpusPerPod"] + one_node["decode"]["gpusPerPod"] == 8
    two = render(yaml.safe_load((EXAMPLES / "two-nodes.yaml").read_text()))
    spec = one(two, "TandemDeployment")["spec"]
    assert spec["prefill"]["nodeSelector"] != spec["decode"]["nodeSelector"]
    assert spec["prefill"]["resources"]["requests"]["rdma/ib"] == "1"
    assert spec["router"]["ingress"]["host"] == "llm.example.com"
    assert spec["scaling"] == {
        "mode": "Recommend",
        "gpuBudget": 16,
        "profiles": {"prefill": "llama-70b-prefill-tp4", "decode": "llama-70b-decode-tp4"},
        "slo": {"ttftP90Ms": 2000, "itlP90Ms": 50},
    }
    lws = one(
        render(yaml.safe_load((EXAMPLES / "multinode-lws.yaml").read_text())), "TandemDeployment"
    )["spec"]
    assert lws["decode"]["nodesPerReplica"] == 2
    models = render(yaml.safe_load((EXAMPLES / "two-models.yaml").read_text()))
    hosts = {
        td["metadata"]["name"]: (
            td["spec"]["model"]["path"],
            td["spec"]["router"]["ingress"]["host"],
        )
        for td in by_kind(models, "TandemDeployment")
    }
    assert hosts == {
        "tandem": ("Qwen/Qwen3-8B", "qwen.llm.example.com"),
        "tandem-coder": ("Qwen/Qwen2.5-Coder-7B-Instruct", "coder.llm.example.com"),
    }


def profile_commands(text: str) -> list[argparse.Namespace]:
    """The `tandem profile` commands a values file's comments give, as that command parses them."""
    joined = re.sub(r"\\\n#\s*", " ", text)
    return [
        profile.build_parser().parse_args(shlex.split(line)[2:])
        for line in re.findall(r"^#\s+(tandem profile .*)$", joined, re.M)
    ]


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_an_example_that_scales_names_each_pools_profile_and_how_to_take_it(name):
    """Recommend and Auto need every pool's profile (else ProfileUnusable at once): an
    example that turns them on names each, with the `tandem profile` command that
    writes that ConfigMap."""
    text = (EXAMPLES / f"{name}.yaml").read_text()
    spec = one(render(yaml.safe_load(text)), "TandemDeployment", RELEASE)["spec"]
    if spec["scaling"]["mode"] == "Off":
        return
    named = spec["scaling"].get("profiles", {})
    commands = {(c.role, c.name) for c in profile_commands(text)}
    for role in ("prefill", "decode", "aggregated"):
        if role in spec:
            assert named.get(role), f"{name}: scaling.profiles.{role} is not set"
            assert (role, named[role]) in commands, f"{name}: no tandem profile for {role}"


def test_monitoring_renders_a_monitor_per_component_and_the_dashboard():
    docs = render(CASES["feature-monitoring"])
    monitors = {
        d["metadata"]["name"]: d
        for d in by_kind(docs, "ServiceMonitor") + by_kind(docs, "PodMonitor")
    }
    assert sorted(monitors) == [
        "tandem-engines",
        "tandem-kvstore-master",
        "tandem-operator",
        "tandem-router",
    ]
    for monitor in monitors.values():
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    engines = monitors["tandem-engines"]["spec"]["podMetricsEndpoints"][0]
    assert (engines["interval"], engines["scrapeTimeout"]) == ("5s", "4s")
    router = monitors["tandem-router"]["spec"]["endpoints"][0]
    assert (router["port"], router["interval"], router["scrapeTimeout"]) == ("http", "15s", "10s")
    dashboard = one(docs, "ConfigMap", "tandem-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    assert not by_kind(render({}), "ServiceMonitor")  # off by default


def test_network_policies_deny_by_default_and_open_the_request_path():
    docs = render(CASES["feature-network-policy-restricted"])
    policies = {d["metadata"]["name"]: d["spec"] for d in by_kind(docs, "NetworkPolicy")}
    assert sorted(policies) == [
        "tandem-default-deny",
        "tandem-engines",
        "tandem-kvstore-clients",
        "tandem-kvstore-master",
        "tandem-operator",
        "tandem-redis",
        "tandem-router",
    ]
    assert "ingress" not in policies["tandem-default-deny"]
    router_from = policies["tandem-router"]["ingress"][0]["from"]
    assert router_from[0] == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}
    }
    # Open to anyone unless routerFrom says otherwise.
    open_docs = render(CASES["feature-network-policy"])
    open_router = one(open_docs, "NetworkPolicy", "tandem-router")["spec"]["ingress"]
    assert open_router == [{"ports": [{"port": "http"}]}]


@pytest.mark.parametrize(
    "selects,port,protocol",
    [("router", ROUTER_PORT, "http"), ("engines", GRPC_PORT, "kubernetes.io/h2c")],
)
def test_inference_pool_selects_router_or_engines(selects, port, protocol):
    case = "feature-inference-pool" if selects == "router" else "feature-inference-pool-engines"
    pool = one(render(CASES[case]), "InferencePool")["spec"]
    assert pool["targetPorts"] == [{"number": port}]
    assert pool["appProtocol"] == protocol
    component = "router" if selects == "router" else "engine"
    assert pool["selector"]["matchLabels"] == {
        "tandem.dev/deployment": RELEASE,
        "app.kubernetes.io/component": component,
    }
    assert pool["endpointPickerRef"]["name"] == "tandem-epp"


def test_external_redis_and_api_keys_reach_the_tandem_deployment():
    spec = one(render(CASES["feature-external-redis"]), "TandemDeployment")["spec"]
    assert spec["redis"] == {"managed": False, "url": "rediss://redis.cache.svc:6380/0"}
    docs = render(CASES["feature-api-keys"])
    secret = one(docs, "Secret")
    assert secret["stringData"] == {"api-keys": "sk-test-0001,sk-test-0002"}
    ref = one(docs, "TandemDeployment")["spec"]["router"]["apiKeySecretRef"]
    assert ref == {"name": secret["metadata"]["name"], "key": "api-keys"}
    test_pod = one(docs, "Pod")["spec"]["containers"][0]
    assert test_pod["env"][0]["valueFrom"]["secretKeyRef"] == ref
    existing = render({"router": {"apiKeys": {"existingSecret": "mine"}}})
    assert not by_kind(existing, "Secret")
    assert one(existing, "TandemDeployment")["spec"]["router"]["apiKeySecretRef"]["name"] == "mine"


def test_scaling_and_an_aggregated_pool_pass_through_as_the_values_say():
    values = CASES["feature-scaling-every-key"]
    spec = one(render(values), "TandemDeployment")["spec"]
    assert spec["scaling"] == values["scaling"]
    assert "aggregated" not in spec  # `aggregated: {}`: no pool
    values = CASES["feature-aggregated-pool"]
    spec = one(render(values), "TandemDeployment")["spec"]
    pool = values["aggregated"]
    rdma = chart().values["rdma"]
    assert spec["aggregated"] == {
        **pool,
        "rdma": True,
        "resources": {
            "requests": {**pool["resources"]["requests"], **rdma["resources"]},
            "limits": {**pool["resources"]["limits"], **rdma["resources"]},
        },
    }
    assert spec["scaling"] == {"mode": "Off", "profiles": {"aggregated": "qwen-aggregated"}}
    assert "1 prefill,\n1 decode and 1 aggregated engine replica(s)" in notes(values)
    assert "1 prefill,\n1 decode engine replica(s)" in notes({})


def test_watch_all_namespaces_binds_the_operator_cluster_wide():
    docs = render(CASES["feature-watch-all-namespaces"])
    assert not by_kind(docs, "RoleBinding")
    assert {b["metadata"]["name"] for b in by_kind(docs, "ClusterRoleBinding")} == {
        "tandem-operator",
        "tandem-operator-cluster",
    }
    args = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not any(a.startswith("--namespace") for a in args)


@pytest.mark.parametrize(
    "values,field",
    [
        ({"model": {"path": ""}}, "/model/path"),
        ({"model": {"dtype": "int3"}}, "/model/dtype"),
        ({"prefill": {"gpusPerPod": -1}}, "/prefill/gpusPerPod"),
        ({"decode": {"nodesPerReplica": 0}}, "/decode/nodesPerReplica"),
        ({"decode": {"parallelism": {"tensor": "4"}}}, "/decode/parallelism/tensor"),
        ({"prefill": {"engineArgs": ["gpu-memory-utilization=0.9"]}}, "/prefill/engineArgs/0"),
        ({"router": {"policy": "random"}}, "/router/policy"),
        ({"router": {"replicas": 0}}, "/router/replicas"),
        ({"router": {"apiKeys": {"keys": ["short"]}}}, "/router/apiKeys/keys/0"),
        (
            {"router": {"ingress": {"enabled": True, "tlsSecretName": "tls"}}},
            "/router/ingress/host",
        ),
        ({"images": {"tandem": {"tag": "latest"}}}, "/images/tandem/tag"),
        ({"images": {"engine": {"repository": ""}}}, "/images/engine/repository"),
        ({"redis": {"managed": False}}, "/redis/url"),
        ({"redis": {"url": "http://redis:6379"}}, "/redis/url"),
        ({"kvStore": {"ramPool": "32G"}}, "/kvStore/ramPool"),
        ({"kvStore": {"disk": {"hostPath": "relative/dir"}}}, "/kvStore/disk/hostPath"),
        ({"scaling": {"mode": "auto"}}, "/scaling/mode"),
        ({"scaling": {"headroom": 0.5}}, "/scaling/headroom"),
        ({"scaling": {"slo": {"ttftP90Ms": 0}}}, "/scaling/slo/ttftP90Ms"),
        ({"scaling": {"capacity": {"layers": 80}}}, "/scaling/capacity"),
        ({"scaling": {"profiles": {"decode": ""}}}, "/scaling/profiles/decode"),
        ({"aggregated": {"replicaz": 1}}, "additional properties 'replicaz'"),
        ({"monitoring": {"interval": "15"}}, "/monitoring/interval"),
        ({"monitoring": {"router": {"scrapeTimeout": "soon"}}}, "/monitoring/router/scrapeTimeout"),
        ({"inferencePool": {"enabled": True}}, "/inferencePool/endpointPicker/name"),
        ({"inferencePool": {"selects": "gateway"}}, "/inferencePool/selects"),
        ({"model": {"volume": {"hostPath": "/w", "persistentVolumeClaim": "w"}}}, "/model/volume"),
        ({"operator": {"replicas": -1}}, "/operator/replicas"),
        ({"prefill": {"replica": 3}}, "additional properties 'replica'"),
        ({"model": {"source": "s3://bucket/llama"}}, "/model/source"),
        ({"model": {"source": "hf://Qwen/Qwen3-8B"}}, "/model/cache"),  # nowhere to download
        (
            {"model": {"cache": {"existingClaim": "w", "create": True}}},
            "/model/cache",
        ),
        ({"model": {"cache": {"accessModes": ["ReadWriteAll"]}}}, "/model/cache/accessModes"),
        ({"model": {"hfToken": {"secretKey": ""}}}, "/model/hfToken/secretKey"),
        ({"model": {"downloadBackoffLimit": -1}}, "/model/downloadBackoffLimit"),
        ({"model": {"hubEndpoint": "hub-mirror:8080"}}, "/model/hubEndpoint"),
        ({"decode": {"spreadAcrossNodes": "yes"}}, "/decode/spreadAcrossNodes"),
        ({"grpcTls": {"enabled": "yes"}}, "/grpcTls/enabled"),
        ({"grpcTls": {"serverName": "Engines_1"}}, "/grpcTls/serverName"),
        (
            {"grpcTls": {"certManager": {"issuerRef": {"kind": "Signer"}}}},
            "/grpcTls/certManager/issuerRef/kind",
        ),
        ({"grpcTls": {"certManager": {"duration": "90 days"}}}, "/grpcTls/certManager/duration"),
        ({"grpcTls": {"existingSecrets": "x"}}, "additional properties 'existingSecrets'"),
        ({"autoscaling": {"decode": {"type": "vpa"}}}, "/autoscaling/decode/type"),
        ({"podGroups": {"type": "kueue"}}, "/podGroups/type"),
        ({"decode": {"podGroup": "mine"}}, "additional properties 'podGroup'"),
        ({"autoscaling": {"prefill": {"type": "hpa"}}}, "/autoscaling/prefill/metrics"),
        ({"autoscaling": {"decode": {"type": "keda"}}}, "/autoscaling/decode/triggers"),
        (
            {"autoscaling": {"decode": {"type": "keda", "triggers": [{"type": "cpu"}]}}}
            | {"scaling": {"mode": "Auto"}},
            "/autoscaling/decode/type",  # two writers of one pool's size
        ),
        (
            {"autoscaling": {"decode": {"type": "hpa", "minReplicas": 0, "metrics": [{}]}}},
            "/autoscaling/decode/minReplicas",
        ),
        ({"images": {"pullSecrets": ["regcred"]}}, "/images/pullSecrets/0"),
        ({"model": {"hfToken": {"token": "my token"}}}, "/model/hfToken/token"),
        ({"model": {"hfToken": {"token": "hf_x", "existingSecret": "s"}}}, "/model/hfToken"),
        ({"prefill": {"acceleratorResource": "gpu count"}}, "/prefill/acceleratorResource"),
        ({"decode": {"volumes": [{"emptyDir": {}}]}}, "/decode/volumes/0"),
        ({"decode": {"volumeMounts": [{"name": "s"}]}}, "/decode/volumeMounts/0"),
        ({"prefill": {"initContainers": [{"name": "w"}]}}, "/prefill/initContainers/0"),
        ({"prefill": {"probes": {"ready": {}}}}, "additional properties 'ready'"),
        ({"decode": {"podLabels": {"team": 1}}}, "/decode/podLabels/team"),
        ({"router": {"service": {"type": "ExternalName"}}}, "/router/service/type"),
        ({"router": {"probes": {"startup": "fast"}}}, "/router/probes/startup"),
        ({"router": {"ingress": {"hosts": "llm.example.com"}}}, "/router/ingress/hosts"),
        ({"httpRoute": {"enabled": True}}, "/httpRoute/parentRefs"),
        ({"httpRoute": {"requestTimeoutSeconds": -1}}, "/httpRoute/requestTimeoutSeconds"),
        ({"extraObjects": [3]}, "/extraObjects/0"),
        ({"extraModels": [{"model": {"path": "x"}}]}, "/extraModels/0"),
        ({"extraModels": [{"name": "Coder"}]}, "/extraModels/0/name"),
        ({"extraModels": [{"name": "c", "images": {}}]}, "additional properties 'images'"),
        ({"extraModels": [{"name": "c", "decode": {"replica": 2}}]}, "/extraModels/0/decode"),
    ],
)
def test_invalid_values_fail_naming_the_field(values, field):
    with pytest.raises(helm.HelmValuesError) as refused:
        render(values)
    assert field in str(refused.value), str(refused.value)


@pytest.mark.parametrize(
    "values,rule",
    [
        ({"decode": {"replicas": 9, "maxReplicas": 8}}, "replicas must lie between"),
        (
            {"prefill": {"minReplicas": 3, "maxReplicas": 2, "replicas": 2}},
            "minReplicas must not exceed maxReplicas",
        ),
        (
            {"decode": {"nodesPerReplica": 2, "gpusPerPod": 8, "parallelism": {"tensor": 8}}},
            "a multi-node replica",
        ),
        ({"scaling": {"gpuBudget": 1}}, "scaling.gpuBudget is below"),
        (
            {"scaling": {"slo": {"itlP90Ms": 50, "interactivityP90": 20}}},
            "not both",
        ),
        (
            {"model": {"maxModelLen": 8192}, "scaling": {"slo": {"longestContextTokens": 32768}}},
            "longestContextTokens exceeds model.maxModelLen",
        ),
        (
            {"scaling": {"upCooldownSeconds": 900}},
            "downCooldownSeconds must be at least",
        ),
    ],
)
def test_cross_field_rules_are_refused_by_the_crd(values, rule):
    """What one field cannot say alone the CRD's CEL rules say: the API server refuses
    the TandemDeployment at `helm install` with the rule's message."""
    td = one(render(values), "TandemDeployment")
    found = problems(td)
    assert any(rule in p for p in found), found


@pytest.mark.parametrize("values_file", [None, *EXAMPLE_NAMES])
def test_helm_lint_strict_finds_nothing_but_the_missing_icon(values_file):
    values = yaml.safe_load((EXAMPLES / f"{values_file}.yaml").read_text()) if values_file else None
    report = helm.lint(CHART_DIR, values, strict=True, kube_version="v1.30.0")
    assert report["errors"] == []
    assert [(m["severity"], m["error"]) for m in report["messages"]] == [(1, "icon is recommended")]


def test_notes_tell_how_to_send_the_first_request():
    text = notes({})
    assert "kubectl -n serving get td tandem -w" in text
    assert "port-forward svc/tandem-router 8000:80" in text
    assert '"model": "Qwen/Qwen3-8B"' in text
    router = {**CASES["feature-ingress-tls"]["router"], **CASES["feature-api-keys"]["router"]}
    text = notes({"router": router})
    assert "export TANDEM_URL=https://llm.example.com" in text
    assert "Authorization: Bearer $TANDEM_API_KEY" in text
    assert "get secret tandem-api-keys" in text


@pytest.mark.parametrize("case", sorted(CASES))
def test_notes_scale_command_is_one_the_enginepool_admits(case):
    """The NOTES' `kubectl scale` changes the decode pool to a size its EnginePool's
    CEL rule admits, or says why the pool cannot be scaled."""
    values = chart().merge_values(CASES[case])
    decode = values["decode"]
    text = notes(CASES[case])
    found = re.search(r"scale enginepool/tandem-decode --replicas (\d+)", text)
    if found is None:
        assert decode["minReplicas"] == decode["maxReplicas"], text
        assert f"fixed at {decode['replicas']} replica(s)" in text
        return
    to = int(found[1])
    assert to != decode["replicas"], f"{case}: --replicas {to} changes nothing"
    if values["scaling"]["mode"] == "Auto":
        assert "holds only until its next decision" in text
    pool = {
        "apiVersion": API_VERSION,
        "kind": "EnginePool",
        "metadata": {"name": f"{RELEASE}-decode", "namespace": NAMESPACE},
        "spec": {
            "deployment": RELEASE,
            "role": "decode",
            "replicas": to,
            "minReplicas": decode["minReplicas"],
            "maxReplicas": decode["maxReplicas"],
        },
    }
    assert problems(pool) == []


def test_grpc_tls_issues_one_certificate_both_sides_mount_and_names_it_in_the_spec():
    """With cert-manager and no issuer given, the chart makes the release's
    CA and a certificate for the name the routers check; the TandemDeployment
    names that Secret, which the operator mounts into routers and engines."""
    docs = render(CASES["feature-grpc-tls"])
    spec = one(docs, "TandemDeployment")["spec"]
    assert spec["grpcTls"] == {"secretName": "tandem-grpc-tls", "serverName": "tandem-engine"}
    leaf = one(docs, "Certificate", "tandem-grpc-tls")["spec"]
    assert leaf["secretName"] == spec["grpcTls"]["secretName"]
    assert leaf["dnsNames"] == [spec["grpcTls"]["serverName"]]
    assert {"server auth", "client auth"} <= set(leaf["usages"])
    assert leaf["issuerRef"] == {
        "name": "tandem-grpc-ca",
        "kind": "Issuer",
        "group": "cert-manager.io",
    }
    ca = one(docs, "Certificate", "tandem-grpc-ca")["spec"]
    assert ca["isCA"] and ca["issuerRef"]["name"] == "tandem-selfsigned"
    assert one(docs, "Issuer", "tandem-grpc-ca")["spec"] == {"ca": {"secretName": ca["secretName"]}}
    assert one(docs, "Issuer", "tandem-selfsigned")["spec"] == {"selfSigned": {}}

    # The user's issuer: only the certificate, signed by it, for their name.
    docs = render(CASES["feature-grpc-tls-cluster-issuer"])
    assert [d["metadata"]["name"] for d in by_kind(docs, "Issuer")] == []
    leaf = one(docs, "Certificate")["spec"]
    assert leaf["issuerRef"] == {
        "name": "corp-ca",
        "kind": "ClusterIssuer",
        "group": "cert-manager.io",
    }
    assert (leaf["duration"], leaf["renewBefore"]) == ("720h", "240h")
    assert one(docs, "TandemDeployment")["spec"]["grpcTls"]["serverName"] == "engines.llm.internal"

    # The user's Secret: no cert-manager objects at all.
    docs = render(CASES["feature-grpc-tls-existing-secret"])
    assert not by_kind(docs, "Certificate") and not by_kind(docs, "Issuer")
    assert one(docs, "TandemDeployment")["spec"]["grpcTls"]["secretName"] == "llm-grpc-tls"
    # Off by default: plaintext, nothing issued.
    assert "grpcTls" not in one(render({}), "TandemDeployment")["spec"]
    assert not by_kind(render({}), "Certificate")


def test_an_hf_source_gets_the_cache_claim_and_the_token_the_operators_job_uses():
    docs = render(CASES["feature-model-hf-cache"])
    model = one(docs, "TandemDeployment")["spec"]["model"]
    assert "path" not in model  # path or source, as the CRD requires
    assert model == {
        "source": "hf://Qwen/Qwen3-8B@9c1d2a7",
        "cache": {"persistentVolumeClaim": "tandem-model-cache"},
        "hfTokenSecretRef": {"name": "hf-token", "key": "HF_TOKEN"},
        "downloadBackoffLimit": 5,
        "hubEndpoint": "http://hub-mirror.models.svc:8080",
        "dtype": "auto",
    }
    claim = one(docs, "PersistentVolumeClaim", "tandem-model-cache")
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert claim["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "storageClassName": "fast-rwx",
        "resources": {"requests": {"storage": "50Gi"}},
    }
    # The user's claim: named in the spec, none created.
    docs = render(CASES["feature-model-hf-existing-claim"])
    assert one(docs, "TandemDeployment")["spec"]["model"]["cache"] == {
        "persistentVolumeClaim": "weights"
    }
    assert not by_kind(docs, "PersistentVolumeClaim")
    # A claim's folder: no cache, nothing downloaded.
    model = one(render(CASES["feature-model-pvc"]), "TandemDeployment")["spec"]["model"]
    assert model["source"] == "pvc://weights/llama-3.1-8b" and "cache" not in model
    # No hub named: huggingface_hub's own default.
    assert "hubEndpoint" not in one(render({}), "TandemDeployment")["spec"]["model"]
    assert not by_kind(render({}), "PersistentVolumeClaim")


def test_pool_spread_and_scheduler_pass_to_the_tandem_deployment():
    decode = one(render(CASES["feature-decode-spread-and-scheduler"]), "TandemDeployment")["spec"][
        "decode"
    ]
    assert (decode["spreadAcrossNodes"], decode["schedulerName"]) == (True, "volcano")
    # Empty: the default scheduler, not named.
    assert "schedulerName" not in one(render({}), "TandemDeployment")["spec"]["decode"]


def _hpa_keda_makes(scaled_object: dict) -> dict:
    """The HPA KEDA creates for a ScaledObject: `keda-hpa-<name>`, owned by the
    ScaledObject, scaling the ScaledObject's scaleTargetRef."""
    meta = scaled_object["metadata"]
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {
            "name": f"keda-hpa-{meta['name']}",
            "namespace": meta["namespace"],
            "ownerReferences": [
                {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "name": meta["name"]}
            ],
        },
        "spec": {
            "scaleTargetRef": scaled_object["spec"]["scaleTargetRef"],
            "minReplicas": scaled_object["spec"]["minReplicaCount"],
            "maxReplicas": scaled_object["spec"]["maxReplicaCount"],
        },
    }


@pytest.mark.parametrize(
    "case,role", [("autoscaling-hpa", "prefill"), ("autoscaling-keda", "decode")]
)
def test_a_chart_autoscaler_scales_the_enginepool_and_the_operator_accepts_it(case, role):
    docs = render(CASES[f"feature-{case}"])
    spec = one(docs, "TandemDeployment")["spec"]
    values = CASES[f"feature-{case}"]["autoscaling"][role]
    if values["type"] == "hpa":
        hpa = one(docs, "HorizontalPodAutoscaler")
        assert not by_kind(docs, "ScaledObject")
    else:
        hpa = _hpa_keda_makes(one(docs, "ScaledObject"))
        assert not by_kind(docs, "HorizontalPodAutoscaler")
    pool = manifests.pool_name(RELEASE, role)
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": API_VERSION,
        "kind": "EnginePool",
        "name": pool,
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (
        values["minReplicas"],
        values["maxReplicas"],
    )
    # Within the pool's bounds, so every size it sets the EnginePool admits.
    assert spec[role]["minReplicas"] <= values["minReplicas"]
    assert values["maxReplicas"] <= spec[role]["maxReplicas"]
    # The operator leaves the pool's size to it: no ScalingConflict in the
    # modes the schema lets it render with ...
    kind = manifests.workload_kind(parse(spec).pool(role)).kind
    assert foreign_autoscaler([hpa], RELEASE, role, kind, spec["scaling"]["mode"]) == ""
    # ... where the same autoscaler on the pool's Deployment would be fought over.
    on_workload = {**hpa, "spec": {**hpa["spec"], "scaleTargetRef": {"kind": kind, "name": pool}}}
    assert foreign_autoscaler([on_workload], RELEASE, role, kind, "Off")


def test_an_autoscaler_beyond_the_pools_bounds_is_refused_naming_them():
    values = {
        "autoscaling": {
            "decode": {"type": "keda", "maxReplicas": 20, "triggers": [{"type": "cpu"}]}
        }
    }
    with pytest.raises(helm.HelmRenderError) as refused:
        render(values)
    assert "decode.maxReplicas 8" in str(refused.value), str(refused.value)
    # None by default, and none for a pool that is not there.
    assert not by_kind(render({}), "HorizontalPodAutoscaler")
    lone = {"autoscaling": {"aggregated": {"type": "keda", "triggers": [{"type": "cpu"}]}}}
    assert not by_kind(render(lone), "ScaledObject")


def test_pod_groups_gang_each_pools_floor_and_the_pools_name_them():
    docs = render(CASES["feature-pod-groups-volcano"])
    spec = one(docs, "TandemDeployment")["spec"]
    groups = {g["metadata"]["name"]: g for g in by_kind(docs, "PodGroup")}
    assert sorted(groups) == ["tandem-decode", "tandem-prefill"]
    for role in ("prefill", "decode"):
        assert spec[role]["podGroup"] == f"tandem-{role}"
        assert groups[f"tandem-{role}"]["apiVersion"] == "scheduling.volcano.sh/v1beta1"
    # The floor's pods: 2 one-node prefill replicas; one decode replica of 2 nodes.
    assert groups["tandem-prefill"]["spec"] == {"minMember": 2, "queue": "inference"}
    assert groups["tandem-decode"]["spec"] == {"minMember": 2, "queue": "inference"}
    docs = render(CASES["feature-pod-groups-coscheduling"])
    group = one(docs, "PodGroup", "tandem-decode")
    assert group["apiVersion"] == "scheduling.x-k8s.io/v1alpha1"
    assert group["spec"] == {"minMember": 1, "scheduleTimeoutSeconds": 120}
    # Off by default: no groups, no podGroup in the spec.
    assert not by_kind(render({}), "PodGroup")
    assert "podGroup" not in one(render({}), "TandemDeployment")["spec"]["decode"]


def test_pod_groups_without_a_scheduler_that_reads_them_are_refused():
    with pytest.raises(helm.HelmRenderError) as refused:
        render({"podGroups": {"type": "volcano"}, "decode": {"schedulerName": "volcano"}})
    assert "prefill.schedulerName" in str(refused.value), str(refused.value)
