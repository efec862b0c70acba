"""The ReplicaSet controller: keep `spec.replicas` active pods, report status.

Pods are created from the template with the generated name `<rs>-<5 chars>`
and a controller reference; too many are deleted (gracefully) in the order
the real controller ranks them (`ActivePodsWithRanks` in
kubernetes/pkg/controller/controller_utils.go), lowest first:

1. unscheduled before scheduled;
2. phase Pending before Unknown before Running;
3. not Ready before Ready;
4. lower `controller.kubernetes.io/pod-deletion-cost` before higher (an
   unparsable annotation counts as 0) — what the operator's drain sets;
5. more pods of the same owner on its node before fewer;
6. both Ready: Ready more recently before longer;
7. more container restarts before fewer;
8. created more recently before earlier.

Status (from the pods' Ready condition as the kubelet writes it): replicas
(active pods), fullyLabeledReplicas, readyReplicas, availableReplicas (Ready
for `minReadySeconds`), observedGeneration.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections import Counter
from collections.abc import Iterable

from devcluster.controllers.base import (
    PODS,
    REPLICASETS,
    Controller,
    ObjRef,
    available_in,
    condition,
    controller_ref,
    owner_keys,
    parse_time,
    pod_active,
    pod_from_template,
    pod_ready,
)
from devcluster.store import Event

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
_PHASE_ORDER = {"Pending": 0, "Unknown": 1, "Running": 2}


def deletion_cost(pod: dict) -> int:
    text = (pod["metadata"].get("annotations") or {}).get(DELETION_COST)
    try:
        return int(text) if text is not None else 0
    except ValueError:
        return 0


def _restarts(pod: dict) -> int:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return max((s.get("restartCount", 0) for s in statuses), default=0)


def _ready_time(pod: dict) -> dt.datetime | None:
    return parse_time((condition(pod, "Ready") or {}).get("lastTransitionTime"))


def _after_or_zero(a: dt.datetime | None, b: dt.datetime | None) -> bool:
    """Kubernetes' afterOrZero: a zero time counts as the latest."""
    if a is None or b is None:
        return a is None
    return a > b


def deletion_order(pods: list[dict], related: list[dict]) -> list[dict]:
    """`pods` in the order the ReplicaSet controller deletes them; `related`
    are the active pods of every ReplicaSet of the same owner (for rule 5)."""
    on_node = Counter((p.get("spec") or {}).get("nodeName", "") for p in related)

    def rank(p: dict) -> int:
        return on_node[(p.get("spec") or {}).get("nodeName", "")]

    def less(a: dict, b: dict) -> bool:
        na, nb = (
            (a.get("spec") or {}).get("nodeName", ""),
            (b.get("spec") or {}).get("nodeName", ""),
        )
        if na != nb and (not na or not nb):
            return not na
        pa = _PHASE_ORDER.get((a.get("status") or {}).get("phase", ""), 0)
        pb = _PHASE_ORDER.get((b.get("status") or {}).get("phase", ""), 0)
        if pa != pb:
            return pa < pb
        if pod_ready(a) != pod_ready(b):
            return not pod_ready(a)
        if deletion_cost(a) != deletion_cost(b):
            return deletion_cost(a) < deletion_cost(b)
        if rank(a) != rank(b):
            return rank(a) > rank(b)
        if pod_ready(a) and pod_ready(b):
            ta, tb = _ready_time(a), _ready_time(b)
            if ta != tb:
                return _after_or_zero(ta, tb)
        if _restarts(a) != _restarts(b):
            return _restarts(a) > _restarts(b)
        ca = parse_time(a["metadata"].get("creationTimestamp"))
        cb = parse_time(b["metadata"].get("creationTimestamp"))
        if ca != cb:
            return _after_or_zero(ca, cb)
        return False

    def compare(a: dict, b: dict) -> int:
        return -1 if less(a, b) else 1 if less(b, a) else 0

    return sorted(pods, key=functools.cmp_to_key(compare))


class ReplicaSetController(Controller):
    name = "replicaset"
    primary = REPLICASETS
    watches = (REPLICASETS, PODS)

    def keys_for(self, kind, event: Event) -> Iterable[ObjRef]:
        if kind == PODS:
            return owner_keys(event, "ReplicaSet")
        return super().keys_for(kind, event)

    def reconcile(self, namespace: str, name: str) -> float | None:
        rs = self.get(REPLICASETS, namespace, name)
        if rs is None:
            return None
        spec = rs.get("spec") or {}
        pods = [p for p in self.owned(PODS, rs) if pod_active(p)]
        if not rs["metadata"].get("deletionTimestamp"):
            want = spec.get("replicas", 1)
            if len(pods) < want:
                for _ in range(want - len(pods)):
                    pod = pod_from_template(
                        spec.get("template") or {}, rs, namespace, generate_name=f"{name}-"
                    )
                    created = self.store.create(self.kind(PODS), namespace, pod)
                    self.record_event(
                        rs, "SuccessfulCreate", f"Created pod: {created['metadata']['name']}"
                    )
                    pods.append(created)
            elif len(pods) > want:
                victims = deletion_order(pods, self._related(rs))[: len(pods) - want]
                for pod in victims:
                    self.delete_pod(pod)
                    self.record_event(
                        rs, "SuccessfulDelete", f"Deleted pod: {pod['metadata']['name']}"
                    )
                gone = {p["metadata"]["uid"] for p in victims}
                pods = [p for p in pods if p["metadata"]["uid"] not in gone]
        return self._status(rs, pods)

    def _related(self, rs: dict) -> list[dict]:
        """The active pods of every ReplicaSet that shares this one's owner."""
        owner = controller_ref(rs)
        if owner is None:
            return [p for p in self.owned(PODS, rs) if pod_active(p)]
        siblings = [
            r
            for r in self.list(REPLICASETS, rs["metadata"]["namespace"])
            if (ref := controller_ref(r)) is not None and ref["uid"] == owner["uid"]
        ]
        return [p for r in siblings for p in self.owned(PODS, r) if pod_active(p)]

    def _status(self, rs: dict, pods: list[dict]) -> float | None:
        spec = rs.get("spec") or {}
        template_labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
        now = dt.datetime.now(dt.UTC)
        waits = [available_in(p, spec.get("minReadySeconds", 0), now) for p in pods]
        status = {
            "replicas": len(pods),
            "fullyLabeledReplicas": sum(
                1
                for p in pods
                if template_labels.items() <= (p["metadata"].get("labels") or {}).items()
            ),
            "readyReplicas": sum(1 for p in pods if pod_ready(p)),
            "availableReplicas": sum(1 for w in waits if w == 0),
            "observedGeneration": rs["metadata"].get("generation", 1),
        }
        self.write_status(REPLICASETS, rs, status)
        pending = [w for w in waits if w]
        return min(pending) if pending else None
