"""The resource types the fake API server serves: built-ins and installed CRDs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from devcluster.semantics import COMMON_FIELDS

Json = Any


@dataclass(frozen=True)
class ScalePaths:
    spec_replicas: str = ".spec.replicas"
    status_replicas: str = ".status.replicas"
    label_selector: str | None = None  # a path to a selector string (CRDs)
    match_labels: str | None = None  # a path to spec.selector (built-ins)


@dataclass
class Kind:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True
    singular: str = ""
    short_names: tuple[str, ...] = ()
    status: bool = False  # has a /status subresource
    scale: ScalePaths | None = None
    schema: dict | None = None  # openAPIV3Schema (custom resources)
    printer_columns: list[dict] = field(default_factory=list)
    custom: bool = False
    categories: tuple[str, ...] = ()  # `kubectl get all` lists the kinds in "all"
    field_selectors: frozenset[str] = COMMON_FIELDS
    # PUT without metadata.resourceVersion: built-ins allow it, custom resources refuse.
    unconditional_update: bool = True

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.group, self.version, self.plural)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def list_kind(self) -> str:
        return f"{self.kind}List"

    @property
    def subresources(self) -> set[str]:
        return ({"status"} if self.status else set()) | ({"scale"} if self.scale else set())

    def verbs(self) -> set[str]:
        return {"create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"}


_DEPLOYMENT_SCALE = ScalePaths(match_labels=".spec.selector")
ALL = ("all",)
# The field labels kube-apiserver selects on beyond metadata.name/namespace
# (pkg/registry/*/strategy.go: ToSelectableFields), for the kinds that have them.
_POD_FIELDS = COMMON_FIELDS | {
    "spec.nodeName",
    "spec.restartPolicy",
    "spec.schedulerName",
    "spec.serviceAccountName",
    "spec.hostNetwork",
    "status.phase",
    "status.podIP",
    "status.nominatedNodeName",
}
_EVENT_FIELDS = COMMON_FIELDS | {
    "involvedObject.kind",
    "involvedObject.namespace",
    "involvedObject.name",
    "involvedObject.uid",
    "involvedObject.apiVersion",
    "involvedObject.resourceVersion",
    "involvedObject.fieldPath",
    "reason",
    "reportingComponent",
    "source",
    "type",
}

BUILTINS: list[Kind] = [
    Kind(
        "",
        "v1",
        "namespaces",
        "Namespace",
        namespaced=False,
        short_names=("ns",),
        status=True,
        field_selectors=COMMON_FIELDS | {"status.phase"},
    ),
    Kind("", "v1", "nodes", "Node", namespaced=False, short_names=("no",), status=True),
    Kind(
        "",
        "v1",
        "pods",
        "Pod",
        short_names=("po",),
        status=True,
        categories=ALL,
        field_selectors=_POD_FIELDS,
    ),
    Kind("", "v1", "services", "Service", short_names=("svc",), status=True, categories=ALL),
    Kind("", "v1", "endpoints", "Endpoints", short_names=("ep",)),
    Kind("", "v1", "configmaps", "ConfigMap", short_names=("cm",)),
    Kind("", "v1", "secrets", "Secret", field_selectors=COMMON_FIELDS | {"type"}),
    Kind("", "v1", "serviceaccounts", "ServiceAccount", short_names=("sa",)),
    Kind("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", short_names=("pvc",)),
    Kind("", "v1", "events", "Event", short_names=("ev",), field_selectors=_EVENT_FIELDS),
    Kind(
        "apps",
        "v1",
        "deployments",
        "Deployment",
        short_names=("deploy",),
        status=True,
        categories=ALL,
        scale=_DEPLOYMENT_SCALE,
    ),
    Kind(
        "apps",
        "v1",
        "statefulsets",
        "StatefulSet",
        short_names=("sts",),
        status=True,
        categories=ALL,
        scale=_DEPLOYMENT_SCALE,
    ),
    Kind(
        "apps",
        "v1",
        "replicasets",
        "ReplicaSet",
        short_names=("rs",),
        status=True,
        categories=ALL,
        scale=_DEPLOYMENT_SCALE,
    ),
    Kind("apps", "v1", "daemonsets", "DaemonSet", short_names=("ds",), status=True, categories=ALL),
    Kind("batch", "v1", "jobs", "Job", status=True, categories=ALL),
    Kind(
        "policy",
        "v1",
        "poddisruptionbudgets",
        "PodDisruptionBudget",
        short_names=("pdb",),
        status=True,
    ),
    Kind("networking.k8s.io", "v1", "ingresses", "Ingress", short_names=("ing",), status=True),
    Kind("discovery.k8s.io", "v1", "endpointslices", "EndpointSlice"),
    Kind(
        "autoscaling",
        "v2",
        "horizontalpodautoscalers",
        "HorizontalPodAutoscaler",
        short_names=("hpa",),
        status=True,
        categories=ALL,
    ),
    Kind("coordination.k8s.io", "v1", "leases", "Lease"),
    Kind("events.k8s.io", "v1", "events", "Event", short_names=("ev",)),
    Kind("rbac.authorization.k8s.io", "v1", "roles", "Role"),
    Kind("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding"),
    Kind("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", namespaced=False),
    Kind(
        "rbac.authorization.k8s.io",
        "v1",
        "clusterrolebindings",
        "ClusterRoleBinding",
        namespaced=False,
    ),
    Kind(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        namespaced=False,
        short_names=("crd", "crds"),
        status=True,
    ),
]


def kinds_from_crd(crd: dict) -> list[Kind]:
    """Every served version of a CustomResourceDefinition as a Kind."""
    spec = crd["spec"]
    names = spec["names"]
    out = []
    for version in spec["versions"]:
        if not version.get("served", True):
            continue
        sub = version.get("subresources") or {}
        scale = None
        if "scale" in sub:
            scale = ScalePaths(
                spec_replicas=sub["scale"]["specReplicasPath"],
                status_replicas=sub["scale"]["statusReplicasPath"],
                label_selector=sub["scale"].get("labelSelectorPath"),
            )
        out.append(
            Kind(
                group=spec["group"],
                version=version["name"],
                plural=names["plural"],
                kind=names["kind"],
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                singular=names.get("singular", names["kind"].lower()),
                short_names=tuple(names.get("shortNames", ())),
                status="status" in sub,
                scale=scale,
                schema=(version.get("schema") or {}).get("openAPIV3Schema"),
                printer_columns=list(version.get("additionalPrinterColumns", [])),
                custom=True,
                categories=tuple(names.get("categories", ())),
                unconditional_update=False,
            )
        )
    return out
