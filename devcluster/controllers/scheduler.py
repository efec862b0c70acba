"""The scheduler, for one node: binds every pod that names no node to it.

Controllers here create their pods bound already; this binds the rest (a
bare pod from `kubectl run` or `kubectl create -f`), as the default
scheduler would on a one-node cluster with room for everything (resource
requests, GPUs included, are not counted; affinities and taints are not
read). Pods that ask for another `schedulerName` are left alone, as a real
default scheduler leaves them. Binding writes `spec.nodeName` and the
`PodScheduled` condition.
"""

from __future__ import annotations

from collections.abc import Iterable

from devcluster.controllers.base import (
    NODE_NAME,
    PODS,
    Controller,
    ObjRef,
    scheduled_condition,
)
from devcluster.store import Event

DEFAULT_SCHEDULER = "default-scheduler"


class Scheduler(Controller):
    name = "scheduler"
    primary = PODS
    watches = (PODS,)

    def keys_for(self, kind, event: Event) -> Iterable[ObjRef]:
        spec = event.obj.get("spec") or {}
        if event.type == "DELETED" or spec.get("nodeName"):
            return []
        return super().keys_for(kind, event)

    def reconcile(self, namespace: str, name: str) -> float | None:
        pod = self.get(PODS, namespace, name)
        if pod is None or pod["metadata"].get("deletionTimestamp"):
            return None
        spec = pod.get("spec") or {}
        if spec.get("nodeName") or spec.get("schedulerName", DEFAULT_SCHEDULER) != (
            DEFAULT_SCHEDULER
        ):
            return None
        bound = self.patch(PODS, pod, {"spec": {"nodeName": NODE_NAME}})
        status = dict(bound.get("status") or {})
        status["conditions"] = [
            c for c in status.get("conditions") or [] if c.get("type") != "PodScheduled"
        ] + [scheduled_condition()]
        self.write_status(PODS, bound, status)
        return None
