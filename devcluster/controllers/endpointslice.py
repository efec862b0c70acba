"""The EndpointSlice controller: a Service's selected pods as `discovery.k8s.io/v1` slices.

As kubernetes/pkg/controller/endpointslice writes them (podToEndpoint,
getEndpointPorts), for every Service with a selector:

* slices named `<service>-<5 chars>`, owned by the Service, labelled with the
  Service's own labels plus `kubernetes.io/service-name`,
  `endpointslice.kubernetes.io/managed-by: endpointslice-controller.k8s.io`
  and, for a headless Service, `service.kubernetes.io/headless`;
* one endpoint per selected pod that has an IP and has not finished:
  `addresses` = the pod IP, `targetRef` to the pod, `nodeName`, `hostname`
  when the pod's subdomain is the Service; conditions `serving` = the pod's
  Ready condition, `terminating` = it has a deletionTimestamp, `ready` =
  serving and not terminating — or always true with
  `publishNotReadyAddresses`;
* ports from the Service's ports, each `targetPort` resolved per pod (a
  number as is, a name through the pod's container ports, none: the port
  itself); a port a pod cannot resolve is left out for that pod, and pods
  that resolve to different port sets go in different slices;
* a Service selecting nothing keeps one empty slice (the controller's
  placeholder). Services without a selector are left to whoever writes
  their slices; core/v1 Endpoints are not written.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from devcluster import semantics
from devcluster.controllers.base import (
    ENDPOINTSLICES,
    PODS,
    SERVICES,
    Controller,
    ObjRef,
    owner_reference,
    pod_ready,
)
from devcluster.store import Event

SERVICE_NAME = "kubernetes.io/service-name"
MANAGED_BY = "endpointslice.kubernetes.io/managed-by"
CONTROLLER_NAME = "endpointslice-controller.k8s.io"
HEADLESS = "service.kubernetes.io/headless"


def resolve_port(pod: dict, service_port: dict) -> int | None:
    """The pod's port number for one Service port (podutil.FindPort)."""
    target = service_port.get("targetPort")
    if target is None:
        return service_port["port"]
    if isinstance(target, int):
        return target
    if str(target).isdigit():
        return int(target)
    protocol = service_port.get("protocol", "TCP")
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == target and port.get("protocol", "TCP") == protocol:
                return port["containerPort"]
    return None


def endpoint_ports(service: dict, pod: dict) -> list[dict]:
    out = []
    for sp in (service.get("spec") or {}).get("ports") or []:
        number = resolve_port(pod, sp)
        if number is None:
            continue
        port = {"name": sp.get("name", ""), "port": number, "protocol": sp.get("protocol", "TCP")}
        if sp.get("appProtocol"):
            port["appProtocol"] = sp["appProtocol"]
        out.append(port)
    return out


def pod_endpoint(service: dict, pod: dict) -> dict:
    spec = service.get("spec") or {}
    serving = pod_ready(pod)
    terminating = bool(pod["metadata"].get("deletionTimestamp"))
    ready = bool(spec.get("publishNotReadyAddresses")) or (serving and not terminating)
    meta = pod["metadata"]
    endpoint: dict = {
        "addresses": [pod["status"]["podIP"]],
        "conditions": {"ready": ready, "serving": serving, "terminating": terminating},
        "targetRef": {
            "kind": "Pod",
            "namespace": meta["namespace"],
            "name": meta["name"],
            "uid": meta["uid"],
        },
    }
    pod_spec = pod.get("spec") or {}
    if pod_spec.get("nodeName"):
        endpoint["nodeName"] = pod_spec["nodeName"]
    if pod_spec.get("hostname") and pod_spec.get("subdomain") == service["metadata"]["name"]:
        endpoint["hostname"] = pod_spec["hostname"]
    return endpoint


def _ports_key(ports: list[dict] | None) -> str:
    return json.dumps(sorted(ports or [], key=lambda p: p.get("name", "")), sort_keys=True)


class EndpointSliceController(Controller):
    name = "endpointslice"
    primary = SERVICES
    watches = (SERVICES, PODS, ENDPOINTSLICES)

    def keys_for(self, kind, event: Event) -> Iterable[ObjRef]:
        if kind == PODS:
            ns = event.obj["metadata"]["namespace"]
            labels = [
                (o["metadata"].get("labels") or {}) for o in (event.obj, event.old) if o is not None
            ]
            out = []
            for svc in self.list(SERVICES, ns):
                selector = (svc.get("spec") or {}).get("selector")
                if selector and any(selector.items() <= lb.items() for lb in labels):
                    out.append((ns, svc["metadata"]["name"]))
            return out
        if kind == ENDPOINTSLICES:
            labels = event.obj["metadata"].get("labels") or {}
            if labels.get(MANAGED_BY) == CONTROLLER_NAME and SERVICE_NAME in labels:
                return [(event.obj["metadata"]["namespace"], labels[SERVICE_NAME])]
            return []
        return super().keys_for(kind, event)

    def reconcile(self, namespace: str, name: str) -> float | None:
        service = self.get(SERVICES, namespace, name)
        existing = self.list(
            ENDPOINTSLICES, namespace, f"{SERVICE_NAME}={name},{MANAGED_BY}={CONTROLLER_NAME}"
        )
        selector = ((service or {}).get("spec") or {}).get("selector")
        if service is None or not selector or service["metadata"].get("deletionTimestamp"):
            for old in existing:
                self.store.delete(self.kind(ENDPOINTSLICES), namespace, old["metadata"]["name"])
            return None
        wanted: dict[str, tuple[list[dict] | None, list[dict]]] = {}
        for pod in self.list(PODS, namespace, semantics.selector_string(selector)):
            phase = (pod.get("status") or {}).get("phase")
            if not (pod.get("status") or {}).get("podIP") or phase in ("Succeeded", "Failed"):
                continue
            ports = endpoint_ports(service, pod)
            entry = wanted.setdefault(_ports_key(ports), (ports, []))
            entry[1].append(pod_endpoint(service, pod))
        if not wanted:
            wanted[_ports_key(None)] = (None, [])
        labels = {
            k: v
            for k, v in (service["metadata"].get("labels") or {}).items()
            if k not in (SERVICE_NAME, MANAGED_BY)
        }
        labels |= {SERVICE_NAME: name, MANAGED_BY: CONTROLLER_NAME}
        if (service.get("spec") or {}).get("clusterIP") == "None":
            labels[HEADLESS] = ""
        unused = {_ports_key(s.get("ports")): s for s in existing}
        for key, (ports, endpoints) in sorted(wanted.items()):
            body: dict = {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "namespace": namespace,
                    "labels": labels,
                    "ownerReferences": [owner_reference(service)],
                },
                "addressType": "IPv4",
                "endpoints": sorted(endpoints, key=lambda e: e["targetRef"]["name"]),
            }
            if ports is not None:
                body["ports"] = ports
            old = unused.pop(key, None)
            if old is None:
                body["metadata"]["generateName"] = f"{name}-"
                self.store.create(self.kind(ENDPOINTSLICES), namespace, body)
                continue
            merged = {**old, **{k: v for k, v in body.items() if k != "metadata"}}
            merged["metadata"] = {**old["metadata"], "labels": labels}
            if "ports" not in body:
                merged.pop("ports", None)
            if merged != old:
                self.store.replace(
                    self.kind(ENDPOINTSLICES), namespace, old["metadata"]["name"], merged
                )
        for old in unused.values():
            self.store.delete(self.kind(ENDPOINTSLICES), namespace, old["metadata"]["name"])
        return None
