"""`Table` responses (what `kubectl get` asks for): the columns kube-apiserver
prints for the built-in kinds, the CRD's printer columns for custom resources.

Columns of priority 1 are the ones `kubectl get -o wide` adds. Each built-in
kind's columns and cells follow Kubernetes' own printers
(pkg/printers/internalversion/printers.go) for the fields Tandem's objects use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from devcluster import semantics
from devcluster.kinds import Kind

Json = Any
Column = tuple[str, str, int]  # name, type, priority
Row = Callable[[dict], list[Any]]

NAME: Column = ("Name", "string", 0)
AGE: Column = ("Age", "string", 0)


def _age(obj: dict) -> str:
    created = obj["metadata"].get("creationTimestamp")
    return semantics.human_age(created) if created else "<unknown>"


def _containers(template_spec: dict) -> tuple[str, str]:
    containers = template_spec.get("containers") or []
    return (
        ",".join(c.get("name", "") for c in containers),
        ",".join(c.get("image", "") for c in containers),
    )


def _selector(selector: dict | None) -> str:
    if not selector:
        return "<none>"
    parts = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expr in selector.get("matchExpressions") or []:
        values = ",".join(expr.get("values") or [])
        op = {"In": "in", "NotIn": "notin"}.get(expr["operator"])
        if op:
            parts.append(f"{expr['key']} {op} ({values})")
        elif expr["operator"] == "Exists":
            parts.append(expr["key"])
        else:
            parts.append(f"!{expr['key']}")
    return ",".join(parts) or "<none>"


def _deployment(obj: dict) -> list[Any]:
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    names, images = _containers((spec.get("template") or {}).get("spec") or {})
    return [
        obj["metadata"]["name"],
        f"{status.get('readyReplicas', 0)}/{spec.get('replicas', 1)}",
        status.get("updatedReplicas", 0),
        status.get("availableReplicas", 0),
        _age(obj),
        names,
        images,
        _selector(spec.get("selector")),
    ]


def _replicaset(obj: dict) -> list[Any]:
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    names, images = _containers((spec.get("template") or {}).get("spec") or {})
    return [
        obj["metadata"]["name"],
        spec.get("replicas", 1),
        status.get("replicas", 0),
        status.get("readyReplicas", 0),
        _age(obj),
        names,
        images,
        _selector(spec.get("selector")),
    ]


def _statefulset(obj: dict) -> list[Any]:
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    names, images = _containers((spec.get("template") or {}).get("spec") or {})
    return [
        obj["metadata"]["name"],
        f"{status.get('readyReplicas', 0)}/{spec.get('replicas', 1)}",
        _age(obj),
        names,
        images,
    ]


def _daemonset(obj: dict) -> list[Any]:
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    template = (spec.get("template") or {}).get("spec") or {}
    names, images = _containers(template)
    node_selector = ",".join(f"{k}={v}" for k, v in (template.get("nodeSelector") or {}).items())
    return [
        obj["metadata"]["name"],
        status.get("desiredNumberScheduled", 0),
        status.get("currentNumberScheduled", 0),
        status.get("numberReady", 0),
        status.get("updatedNumberScheduled", 0),
        status.get("numberAvailable", 0),
        node_selector or "<none>",
        _age(obj),
        names,
        images,
        _selector(spec.get("selector")),
    ]


def _pod_status(obj: dict) -> str:
    status = obj.get("status") or {}
    reason = status.get("reason") or status.get("phase") or "Pending"
    for cs in status.get("containerStatuses") or []:
        state = cs.get("state") or {}
        if (state.get("waiting") or {}).get("reason"):
            reason = state["waiting"]["reason"]
        elif (state.get("terminated") or {}).get("reason"):
            reason = state["terminated"]["reason"]
    if obj["metadata"].get("deletionTimestamp"):
        reason = "Terminating"
    return reason


def _pod(obj: dict) -> list[Any]:
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    statuses = status.get("containerStatuses") or []
    ready = sum(1 for cs in statuses if cs.get("ready"))
    restarts = sum(cs.get("restartCount", 0) for cs in statuses)
    gates = spec.get("readinessGates") or []
    return [
        obj["metadata"]["name"],
        f"{ready}/{len(spec.get('containers') or [])}",
        _pod_status(obj),
        restarts,
        _age(obj),
        status.get("podIP") or "<none>",
        spec.get("nodeName") or "<none>",
        status.get("nominatedNodeName") or "<none>",
        f"{len(gates)}" if gates else "<none>",
    ]


def _service(obj: dict) -> list[Any]:
    spec = obj.get("spec") or {}
    ports = []
    for port in spec.get("ports") or []:
        text = f"{port['port']}"
        if port.get("nodePort"):
            text += f":{port['nodePort']}"
        ports.append(f"{text}/{port.get('protocol', 'TCP')}")
    external = spec.get("externalIPs") or []
    if spec.get("type") == "LoadBalancer":
        ingress = ((obj.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
        external = external + [i.get("ip") or i.get("hostname", "") for i in ingress]
    selector = spec.get("selector") or {}
    return [
        obj["metadata"]["name"],
        spec.get("type", "ClusterIP"),
        spec.get("clusterIP") or "<none>",
        ",".join(external) or ("<pending>" if spec.get("type") == "LoadBalancer" else "<none>"),
        ",".join(ports) or "<none>",
        _age(obj),
        ",".join(f"{k}={v}" for k, v in sorted(selector.items())) or "<none>",
    ]


def _endpointslice(obj: dict) -> list[Any]:
    ports = ",".join(str(p.get("port", "")) for p in obj.get("ports") or []) or "<unset>"
    addresses = [a for e in obj.get("endpoints") or [] for a in e.get("addresses") or []]
    shown = ",".join(addresses[:3]) + (
        f" + {len(addresses) - 3} more..." if len(addresses) > 3 else ""
    )
    return [
        obj["metadata"]["name"],
        obj.get("addressType", ""),
        ports,
        shown or "<unset>",
        _age(obj),
    ]


def _configmap(obj: dict) -> list[Any]:
    count = len(obj.get("data") or {}) + len(obj.get("binaryData") or {})
    return [obj["metadata"]["name"], count, _age(obj)]


def _secret(obj: dict) -> list[Any]:
    count = len(obj.get("data") or {}) + len(obj.get("stringData") or {})
    return [obj["metadata"]["name"], obj.get("type", "Opaque"), count, _age(obj)]


def _namespace(obj: dict) -> list[Any]:
    return [obj["metadata"]["name"], (obj.get("status") or {}).get("phase", "Active"), _age(obj)]


def _event(obj: dict) -> list[Any]:
    involved = obj.get("involvedObject") or {}
    last = (
        obj.get("lastTimestamp") or obj.get("eventTime") or obj["metadata"].get("creationTimestamp")
    )
    first = obj.get("firstTimestamp") or last
    source = (obj.get("source") or {}).get("component") or obj.get("reportingComponent", "")
    return [
        semantics.human_age(last) if last else "<unknown>",
        obj.get("type", ""),
        obj.get("reason", ""),
        f"{involved.get('kind', '').lower()}/{involved.get('name', '')}",
        obj.get("message", ""),
        involved.get("fieldPath", ""),
        source,
        semantics.human_age(first) if first else "<unknown>",
        obj.get("count", 1),
        obj["metadata"]["name"],
    ]


# (columns, row) per built-in kind, keyed by (group, plural).
BUILTIN: dict[tuple[str, str], tuple[list[Column], Row]] = {
    ("apps", "deployments"): (
        [
            NAME,
            ("Ready", "string", 0),
            ("Up-to-date", "integer", 0),
            ("Available", "integer", 0),
            AGE,
            ("Containers", "string", 1),
            ("Images", "string", 1),
            ("Selector", "string", 1),
        ],
        _deployment,
    ),
    ("apps", "replicasets"): (
        [
            NAME,
            ("Desired", "integer", 0),
            ("Current", "integer", 0),
            ("Ready", "integer", 0),
            AGE,
            ("Containers", "string", 1),
            ("Images", "string", 1),
            ("Selector", "string", 1),
        ],
        _replicaset,
    ),
    ("apps", "statefulsets"): (
        [NAME, ("Ready", "string", 0), AGE, ("Containers", "string", 1), ("Images", "string", 1)],
        _statefulset,
    ),
    ("apps", "daemonsets"): (
        [
            NAME,
            ("Desired", "integer", 0),
            ("Current", "integer", 0),
            ("Ready", "integer", 0),
            ("Up-to-date", "integer", 0),
            ("Available", "integer", 0),
            ("Node Selector", "string", 0),
            AGE,
            ("Containers", "string", 1),
            ("Images", "string", 1),
            ("Selector", "string", 1),
        ],
        _daemonset,
    ),
    ("", "pods"): (
        [
            NAME,
            ("Ready", "string", 0),
            ("Status", "string", 0),
            ("Restarts", "string", 0),
            AGE,
            ("IP", "string", 1),
            ("Node", "string", 1),
            ("Nominated Node", "string", 1),
            ("Readiness Gates", "string", 1),
        ],
        _pod,
    ),
    ("", "services"): (
        [
            NAME,
            ("Type", "string", 0),
            ("Cluster-IP", "string", 0),
            ("External-IP", "string", 0),
            ("Port(s)", "string", 0),
            AGE,
            ("Selector", "string", 1),
        ],
        _service,
    ),
    ("discovery.k8s.io", "endpointslices"): (
        [
            NAME,
            ("AddressType", "string", 0),
            ("Ports", "string", 0),
            ("Endpoints", "string", 0),
            AGE,
        ],
        _endpointslice,
    ),
    ("", "configmaps"): ([NAME, ("Data", "integer", 0), AGE], _configmap),
    ("", "secrets"): ([NAME, ("Type", "string", 0), ("Data", "integer", 0), AGE], _secret),
    ("", "namespaces"): ([NAME, ("Status", "string", 0), AGE], _namespace),
    ("", "events"): (
        [
            ("Last Seen", "string", 0),
            ("Type", "string", 0),
            ("Reason", "string", 0),
            ("Object", "string", 0),
            ("Message", "string", 0),
            ("Subobject", "string", 1),
            ("Source", "string", 1),
            ("First Seen", "string", 1),
            ("Count", "string", 1),
            ("Name", "string", 1),
        ],
        _event,
    ),
}


def _custom(kind: Kind) -> tuple[list[Column], Row]:
    extra = kind.printer_columns or [
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}
    ]
    columns: list[Column] = [NAME] + [
        (c["name"], c.get("type", "string"), c.get("priority", 0)) for c in extra
    ]

    def row(obj: dict) -> list[Any]:
        cells: list[Any] = [obj["metadata"]["name"]]
        for col in extra:
            found = semantics.jsonpath(obj, col["jsonPath"])
            if not found:
                cells.append(None)
            elif col.get("type") == "date":
                cells.append(semantics.human_age(found[0]))
            else:
                cells.append(found[0])
        return cells

    return columns, row


def _default(kind: Kind) -> tuple[list[Column], Row]:
    return [NAME, AGE], lambda obj: [obj["metadata"]["name"], _age(obj)]


def table(kind: Kind, items: list[dict], rv: str) -> dict:
    """A meta.k8s.io/v1 Table of `items`."""
    if kind.custom:
        columns, row = _custom(kind)
    else:
        columns, row = BUILTIN.get((kind.group, kind.plural)) or _default(kind)
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": rv},
        "columnDefinitions": [
            {
                "name": name,
                "type": type_,
                "format": "name" if (name, type_, priority) == NAME else "",
                "priority": priority,
                "description": "",
            }
            for name, type_, priority in columns
        ],
        "rows": [
            {
                "cells": row(obj),
                "object": {
                    "kind": "PartialObjectMetadata",
                    "apiVersion": "meta.k8s.io/v1",
                    "metadata": obj["metadata"],
                },
            }
            for obj in items
        ],
    }
