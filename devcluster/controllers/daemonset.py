"""The DaemonSet controller, for a cluster of one node.

The node runs one pod of each DaemonSet whose `nodeSelector` it matches,
named `<daemonset>-<5 chars>`, owned by it and labelled
`controller-revision-hash` with its template's hash. A template change
replaces the pod (updateStrategy RollingUpdate, the default: the old pod is
deleted gracefully and a new one created at once, as the real controller
does with maxSurge 0 once the old pod is terminating); `OnDelete` replaces
it only when someone deletes it. A pod that failed is deleted and replaced.

Status: desiredNumberScheduled, currentNumberScheduled, numberMisscheduled,
numberReady, numberAvailable, numberUnavailable, updatedNumberScheduled,
observedGeneration.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable

from devcluster.controllers.base import (
    DAEMONSETS,
    NODE_NAME,
    NODES,
    PODS,
    Controller,
    ObjRef,
    available_in,
    owner_keys,
    pod_from_template,
    pod_ready,
    template_hash,
)
from devcluster.store import Event

REVISION_LABEL = "controller-revision-hash"


class DaemonSetController(Controller):
    name = "daemonset"
    primary = DAEMONSETS
    watches = (DAEMONSETS, PODS)

    def keys_for(self, kind, event: Event) -> Iterable[ObjRef]:
        if kind == PODS:
            return owner_keys(event, "DaemonSet")
        return super().keys_for(kind, event)

    def reconcile(self, namespace: str, name: str) -> float | None:
        ds = self.get(DAEMONSETS, namespace, name)
        if ds is None:
            return None
        spec = ds.get("spec") or {}
        template = spec.get("template") or {}
        revision = template_hash(template)
        node = self.get(NODES, "", NODE_NAME) or {}
        node_labels = node.get("metadata", {}).get("labels") or {}
        selector = (template.get("spec") or {}).get("nodeSelector") or {}
        should_run = selector.items() <= node_labels.items()
        pods = self.owned(PODS, ds)
        for pod in pods:
            if (pod.get("status") or {}).get("phase") == "Failed" and not pod["metadata"].get(
                "deletionTimestamp"
            ):
                self.delete_pod(pod)
                self.record_event(
                    ds,
                    "FailedDaemonPod",
                    f"Found failed daemon pod {pod['metadata']['name']}, will try to kill it",
                    "Warning",
                )
        pods = [p for p in self.owned(PODS, ds) if not p["metadata"].get("deletionTimestamp")]

        def current(p: dict) -> bool:
            return (p["metadata"].get("labels") or {}).get(REVISION_LABEL) == revision

        on_delete = (spec.get("updateStrategy") or {}).get("type") == "OnDelete"
        if not ds["metadata"].get("deletionTimestamp"):
            if not should_run:
                for pod in pods:
                    self.delete_pod(pod)
                pods = []
            else:
                # Keep one pod: the current revision's if there is one, else the oldest.
                keep = sorted(
                    pods,
                    key=lambda p: (not current(p), p["metadata"].get("creationTimestamp", "")),
                )
                for extra in keep[1:]:
                    self.delete_pod(extra)
                pods = keep[:1]
                if pods and not current(pods[0]) and not on_delete:
                    self.delete_pod(pods[0])
                    pods = []
                if not pods:
                    pod = pod_from_template(
                        template,
                        ds,
                        namespace,
                        generate_name=f"{name}-",
                        extra_labels={REVISION_LABEL: revision},
                    )
                    created = self.store.create(self.kind(PODS), namespace, pod)
                    self.record_event(
                        ds, "SuccessfulCreate", f"Created pod: {created['metadata']['name']}"
                    )
                    pods = [created]
        now = dt.datetime.now(dt.UTC)
        waits = [available_in(p, spec.get("minReadySeconds", 0), now) for p in pods]
        desired = 1 if should_run else 0
        available = sum(1 for w in waits if w == 0)
        status = {
            "desiredNumberScheduled": desired,
            "currentNumberScheduled": len(pods) if should_run else 0,
            "numberMisscheduled": 0 if should_run else len(pods),
            "numberReady": sum(1 for p in pods if pod_ready(p)),
            "numberAvailable": available,
            "numberUnavailable": max(0, desired - available),
            "updatedNumberScheduled": sum(1 for p in pods if current(p)),
            "observedGeneration": ds["metadata"].get("generation", 1),
        }
        self.write_status(DAEMONSETS, ds, status)
        pending = [w for w in waits if w]
        return min(pending) if pending else None
