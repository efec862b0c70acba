"""The Helm chart as the tests see it: rendered by Helm itself, validated by real schemas.

`render` runs Helm's own Go SDK (helm-python-sdk bundles it as a shared
library) on helm/tandem, exactly as `helm template`/`helm install` would.
`problems` validates one object: built-in kinds against the Kubernetes
OpenAPI schemas (kubernetes-validate, strict: unknown fields are errors) for
the oldest and newest Kubernetes the chart supports (kubernetes-validate's
own schema files, each compiled once: its `validate` re-reads the multi-MB
definitions file on every call); custom resources against
their CRD's openAPIV3Schema the way kube-apiserver admits them (pruning,
defaults, OpenAPI constraints, CEL rules; devcluster/schema.py), unknown
fields counting as errors. The CRDs are the chart's own (operators/crds) and
other projects' written here from their API docs (tests/helm/foreign_schemas.py:
LeaderWorkerSet, InferencePool, ServiceMonitor, PodMonitor).
"""

from __future__ import annotations

import copy
import re
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import referencing
import yaml
from kubernetes_validate.utils import schema_contents

from devcluster import schema as crd_schema
from tests.helm import foreign_schemas

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "helm" / "tandem"
EXAMPLES = REPO / "helm" / "examples"
RELEASE = "tandem"
NAMESPACE = "serving"
# The chart's kubeVersion floor and the newest Kubernetes kubernetes-validate knows.
KUBE_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())

Manifest = dict[str, Any]


@lru_cache(maxsize=1)
def chart() -> helm.Chart:
    return helm.Chart.load(CHART_DIR)


class KubectlLoader(yaml.SafeLoader):
    """YAML read as kubectl and Helm read it (go-yaml v2 through sigs.k8s.io/yaml),
    which takes more plain scalars for bools and numbers than PyYAML does:
    `y`/`n` are bools, `1e3` is a number. Checked against kubectl 1.32: a label
    value of `y` or `1e3` is refused as "cannot unmarshal bool/number into ...
    string"."""

    bool_values = {**yaml.SafeLoader.bool_values, "y": True, "n": False}


KubectlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:y|Y|n|N)$"), list("yYnN")
)
KubectlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?$"),
    list("-+.0123456789"),
)


def render_files(
    values: dict | None = None, release: str = RELEASE, namespace: str = NAMESPACE
) -> dict[str, str]:
    """Template path → rendered text, as `helm install` renders them."""
    return chart().render(
        copy.deepcopy(values or {}), name=release, namespace=namespace, is_install=True
    )


def render(
    values: dict | None = None,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
    exclude: tuple[str, ...] = (),
) -> list[Manifest]:
    """Every object the chart renders (templates and test hooks; not NOTES.txt),
    but those of the templates named in `exclude`."""
    docs: list[Manifest] = []
    for path, text in sorted(render_files(values, release, namespace).items()):
        if path.endswith(("NOTES.txt", *exclude)):
            continue
        docs.extend(d for d in yaml.load_all(text, Loader=KubectlLoader) if d)
    return docs


def notes(values: dict | None = None) -> str:
    return next(t for p, t in render_files(values).items() if p.endswith("NOTES.txt"))


def example(name: str) -> dict:
    return yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())


@lru_cache(maxsize=1)
def chart_crds() -> list[Manifest]:
    """The CRDs `helm install` applies from the chart's crds/ folder."""
    return [yaml.safe_load(c["data"]) for c in chart().crds]


@lru_cache(maxsize=1)
def foreign_crds() -> list[Manifest]:
    """The CRDs of other projects whose resources the chart renders."""
    return foreign_schemas.crds()


@cache
def crd_schema_for(api_version: str, kind: str) -> dict | None:
    group, _, version = api_version.rpartition("/")
    for crd in chart_crds() + foreign_crds():
        spec = crd["spec"]
        if spec["group"] != group or spec["names"]["kind"] != kind:
            continue
        for v in spec["versions"]:
            if v["name"] == version and v.get("served", True):
                return v["schema"]["openAPIV3Schema"]
    return None


def is_custom(obj: Manifest) -> bool:
    return crd_schema_for(obj["apiVersion"], obj["kind"]) is not None


def problems(obj: Manifest) -> list[str]:
    """Why the API server would refuse `obj` (or drop some of it); empty when it is valid."""
    ref = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    schema = crd_schema_for(obj["apiVersion"], obj["kind"])
    if schema is not None:
        _admitted, dropped, errors = crd_schema.admit(schema, copy.deepcopy(obj))
        return [f"{ref}: {e}" for e in errors] + [f"{ref}: unknown field {d}" for d in dropped]
    out = []
    for version in KUBE_VERSIONS:
        validator = builtin_validator(version, obj["apiVersion"], obj["kind"])
        if validator is None:
            out.append(
                f"{ref}: no schema for {obj['apiVersion']} {obj['kind']} in Kubernetes "
                f"{version} and no CRD for it"
            )
            continue
        for error in validator.iter_errors(obj):
            where = ".".join(str(p) for p in error.absolute_path) or "<root>"
            out.append(f"{ref} (Kubernetes {version}): {where}: {error.message}")
    return out


@cache
def builtin_validator(
    version: str, api_version: str, kind: str
) -> jsonschema.Draft202012Validator | None:
    """kubernetes-validate's strict schema for one kind, as its `validate` builds it."""
    folder = f"kubernetes-json-schema/v{version}-local-strict"
    # rbac.authorization.k8s.io/v1 -> rbac-v1, as kubernetes-validate names its files.
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    try:
        schema = schema_contents(f"{folder}/{kind.lower()}-{group_version}.json", version)
    except FileNotFoundError:
        return None
    definitions = schema_contents(f"{folder}/_definitions.json", version)
    registry = referencing.Resource.from_contents(definitions) @ (
        referencing.Resource.from_contents(schema) @ referencing.Registry()
    )
    return jsonschema.Draft202012Validator(schema, registry=registry)


def by_kind(docs: list[Manifest], kind: str) -> list[Manifest]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[Manifest], kind: str, name: str | None = None) -> Manifest:
    found = [d for d in by_kind(docs, kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_templates(obj: Manifest) -> list[dict]:
    """The pod specs' metadata+spec an object runs (Pod, Deployment, DaemonSet, LWS ...)."""
    kind = obj["kind"]
    if kind == "Pod":
        return [{"metadata": obj["metadata"], "spec": obj["spec"]}]
    if kind in ("Deployment", "DaemonSet", "StatefulSet", "ReplicaSet", "Job"):
        return [obj["spec"]["template"]]
    if kind == "LeaderWorkerSet":
        lwt = obj["spec"]["leaderWorkerTemplate"]
        return [t for t in (lwt.get("leaderTemplate"), lwt.get("workerTemplate")) if t]
    return []


def containers(obj: Manifest) -> list[dict]:
    out = []
    for template in pod_templates(obj):
        spec = template["spec"]
        out += spec.get("initContainers", []) + spec.get("containers", [])
    return out


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels + matchExpressions) against a label set."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True
