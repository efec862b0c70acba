"""The Deployment controller: one ReplicaSet per pod template, rollouts, status.

As kubernetes/pkg/controller/deployment does it, reduced to one node:

* the ReplicaSet of a template is `<deployment>-<hash>`, its pods and
  selector carrying the `pod-template-hash` label, owned by the Deployment,
  annotated with `deployment.kubernetes.io/revision` (one more than any
  older ReplicaSet; an older template coming back takes a new revision) and
  `desired-replicas` / `max-replicas`;
* RollingUpdate: the new ReplicaSet grows while all ReplicaSets together stay
  within replicas + maxSurge; old ones shrink (their unavailable pods first)
  while available pods stay at least replicas - maxUnavailable (both default
  25%, surge rounded up, unavailable down; both 0 means maxUnavailable 1);
* Recreate: old ReplicaSets go to 0 and the new one starts only when none of
  their pods is left (terminating ones included);
* scaling with no rollout under way scales the one ReplicaSet;
* `spec.paused` stops everything but status; old ReplicaSets with no
  replicas beyond `revisionHistoryLimit` (default 10) are deleted;
* status: replicas, updatedReplicas, readyReplicas, availableReplicas,
  unavailableReplicas, observedGeneration, conditions Available
  (MinimumReplicasAvailable / MinimumReplicasUnavailable) and Progressing
  (NewReplicaSetCreated, ReplicaSetUpdated, NewReplicaSetAvailable,
  ProgressDeadlineExceeded after `progressDeadlineSeconds`, default 600) —
  what `kubectl rollout status` reads.

Not done: adopting ReplicaSets that have no owner, proportional scaling of
several ReplicaSets in the middle of a rollout (the rollout's arithmetic
converges instead), rollback through `kubectl rollout undo` (the client
rewrites the template, which works).
"""

from __future__ import annotations

import copy
import datetime as dt
from collections.abc import Iterable

from devcluster import semantics
from devcluster.controllers.base import (
    DEPLOYMENTS,
    PODS,
    REPLICASETS,
    Controller,
    ObjRef,
    condition,
    int_or_percent,
    owner_keys,
    owner_reference,
    parse_time,
    set_condition,
    template_hash,
)
from devcluster.store import Event

HASH_LABEL = "pod-template-hash"
REVISION = "deployment.kubernetes.io/revision"
DESIRED = "deployment.kubernetes.io/desired-replicas"
MAX_REPLICAS = "deployment.kubernetes.io/max-replicas"


def _replicas(rs: dict) -> int:
    return (rs.get("spec") or {}).get("replicas", 1)


def _status(rs: dict | None, field: str) -> int:
    return ((rs or {}).get("status") or {}).get(field, 0)


def _revision(rs: dict) -> int:
    try:
        return int((rs["metadata"].get("annotations") or {}).get(REVISION, "0"))
    except ValueError:
        return 0


def _without_hash(template: dict) -> dict:
    out = copy.deepcopy(template)
    (out.get("metadata") or {}).get("labels", {}).pop(HASH_LABEL, None)
    return out


def _oldest_first(rses: list[dict]) -> list[dict]:
    return sorted(
        rses, key=lambda r: (r["metadata"].get("creationTimestamp", ""), r["metadata"]["name"])
    )


class DeploymentController(Controller):
    name = "deployment"
    primary = DEPLOYMENTS
    watches = (DEPLOYMENTS, REPLICASETS, PODS)

    def keys_for(self, kind, event: Event) -> Iterable[ObjRef]:
        if kind == REPLICASETS:
            return owner_keys(event, "Deployment")
        if kind == PODS:
            # A pod's going matters to Recreate (it waits for old pods to be gone).
            if event.type != "DELETED":
                return []
            return [
                key
                for ns, rs_name in owner_keys(event, "ReplicaSet")
                if (rs := self.get(REPLICASETS, ns, rs_name)) is not None
                for key in owner_keys(Event(0, "", rs), "Deployment")
            ]
        return super().keys_for(kind, event)

    def reconcile(self, namespace: str, name: str) -> float | None:
        d = self.get(DEPLOYMENTS, namespace, name)
        if d is None or d["metadata"].get("deletionTimestamp"):
            return None
        spec = d.get("spec") or {}
        replicas = spec.get("replicas", 1)
        template = spec.get("template") or {}
        rses = self.owned(REPLICASETS, d)
        new = next((r for r in rses if _without_hash(r["spec"]["template"]) == template), None)
        olds = [r for r in rses if r is not new]
        recreate = (spec.get("strategy") or {}).get("type") == "Recreate"
        surge, unavailable = self._limits(d)
        created = False
        if not spec.get("paused"):
            top = max((_revision(r) for r in olds), default=0)
            if new is None:
                if recreate and self._scale_down_all(d, olds):
                    return self._write_status(d, None, False)
                new = self._create_rs(d, template, top + 1, self._initial(d, olds, surge, recreate))
                created = True
            elif _revision(new) <= top:
                new = self.patch(
                    REPLICASETS, new, {"metadata": {"annotations": {REVISION: str(top + 1)}}}
                )
            if recreate:
                if not self._scale_down_all(d, olds):
                    new = self._scale(d, new, replicas)
            else:
                new = self._scale(d, new, self._rolling_new(d, new, olds, surge))
                self._rolling_old(d, new, olds, unavailable)
            self._clean_history(d, olds)
        return self._write_status(d, new, created)

    # ---- rollout arithmetic ----------------------------------------------------

    def _limits(self, d: dict) -> tuple[int, int]:
        spec = d.get("spec") or {}
        replicas = spec.get("replicas", 1)
        strategy = spec.get("strategy") or {}
        if strategy.get("type") == "Recreate":
            return 0, 0
        rolling = strategy.get("rollingUpdate") or {}
        surge = int_or_percent(rolling.get("maxSurge"), replicas, "25%", round_up=True)
        unavailable = int_or_percent(rolling.get("maxUnavailable"), replicas, "25%", round_up=False)
        if surge == 0 and unavailable == 0:
            unavailable = 1
        return surge, min(unavailable, replicas)

    def _initial(self, d: dict, olds: list[dict], surge: int, recreate: bool) -> int:
        replicas = (d.get("spec") or {}).get("replicas", 1)
        if recreate or not any(_replicas(r) for r in olds):
            return replicas
        total = sum(_replicas(r) for r in olds)
        return max(0, min(replicas + surge - total, replicas))

    def _rolling_new(self, d: dict, new: dict, olds: list[dict], surge: int) -> int:
        replicas = (d.get("spec") or {}).get("replicas", 1)
        current = _replicas(new)
        if not any(_replicas(r) for r in olds):
            return replicas
        total = current + sum(_replicas(r) for r in olds)
        if total >= replicas + surge:
            return min(current, replicas)
        return min(current + replicas + surge - total, replicas)

    def _rolling_old(self, d: dict, new: dict, olds: list[dict], unavailable: int) -> None:
        replicas = (d.get("spec") or {}).get("replicas", 1)
        if not any(_replicas(r) for r in olds):
            return
        min_available = replicas - unavailable
        everyone = _replicas(new) + sum(_replicas(r) for r in olds)
        new_unavailable = max(0, _replicas(new) - _status(new, "availableReplicas"))
        room = everyone - min_available - new_unavailable
        if room <= 0:
            return
        sizes = {r["metadata"]["uid"]: _replicas(r) for r in olds}
        # Unhealthy old pods first: they serve nothing.
        cleaned = 0
        for rs in _oldest_first(olds):
            uid = rs["metadata"]["uid"]
            sick = sizes[uid] - _status(rs, "availableReplicas")
            if cleaned >= room or sizes[uid] == 0 or sick <= 0:
                continue
            down = min(room - cleaned, sick)
            sizes[uid] -= down
            cleaned += down
        available = _status(new, "availableReplicas") + sum(
            _status(r, "availableReplicas") for r in olds
        )
        budget = available - min_available
        for rs in _oldest_first(olds):
            uid = rs["metadata"]["uid"]
            if budget <= 0 or sizes[uid] == 0:
                continue
            down = min(sizes[uid], budget)
            sizes[uid] -= down
            budget -= down
        for rs in olds:
            self._scale(d, rs, sizes[rs["metadata"]["uid"]])

    def _scale_down_all(self, d: dict, olds: list[dict]) -> bool:
        """Recreate's first step; True while any old pod is left."""
        for rs in olds:
            self._scale(d, rs, 0)
        return any(self.owned(PODS, rs) for rs in olds)

    # ---- writes ------------------------------------------------------------------

    def _create_rs(self, d: dict, template: dict, revision: int, replicas: int) -> dict:
        meta = d["metadata"]
        spec = d.get("spec") or {}
        pod_hash = template_hash(template)
        tmpl = copy.deepcopy(template)
        tmpl.setdefault("metadata", {}).setdefault("labels", {})[HASH_LABEL] = pod_hash
        selector = copy.deepcopy(spec.get("selector") or {})
        selector.setdefault("matchLabels", {})[HASH_LABEL] = pod_hash
        rs_spec: dict = {"replicas": replicas, "selector": selector, "template": tmpl}
        if spec.get("minReadySeconds"):
            rs_spec["minReadySeconds"] = spec["minReadySeconds"]
        surge, _ = self._limits(d)
        rs = {
            "apiVersion": "apps/v1",
            "kind": "ReplicaSet",
            "metadata": {
                "name": f"{meta['name']}-{pod_hash}",
                "namespace": meta["namespace"],
                "labels": dict(tmpl["metadata"]["labels"]),
                "annotations": {
                    REVISION: str(revision),
                    DESIRED: str(spec.get("replicas", 1)),
                    MAX_REPLICAS: str(spec.get("replicas", 1) + surge),
                },
                "ownerReferences": [owner_reference(d)],
            },
            "spec": rs_spec,
        }
        out = self.store.create(self.kind(REPLICASETS), meta["namespace"], rs)
        self.record_event(
            d, "ScalingReplicaSet", f"Scaled up replica set {rs['metadata']['name']} to {replicas}"
        )
        return out

    def _scale(self, d: dict, rs: dict, replicas: int) -> dict:
        spec = d.get("spec") or {}
        surge, _ = self._limits(d)
        annotations = {
            DESIRED: str(spec.get("replicas", 1)),
            MAX_REPLICAS: str(spec.get("replicas", 1) + surge),
        }
        before = _replicas(rs)
        current = rs["metadata"].get("annotations") or {}
        if before == replicas and all(current.get(k) == v for k, v in annotations.items()):
            return rs
        out = self.patch(
            REPLICASETS,
            rs,
            {"metadata": {"annotations": annotations}, "spec": {"replicas": replicas}},
        )
        if before != replicas:
            way = "up" if replicas > before else "down"
            self.record_event(
                d,
                "ScalingReplicaSet",
                f"Scaled {way} replica set {rs['metadata']['name']} from {before} to {replicas}",
            )
        return out

    def _clean_history(self, d: dict, olds: list[dict]) -> None:
        limit = (d.get("spec") or {}).get("revisionHistoryLimit", 10)
        idle = [r for r in olds if _replicas(r) == 0 and _status(r, "replicas") == 0]
        idle.sort(key=_revision)
        for rs in idle[: max(0, len(idle) - limit)]:
            self.store.delete(
                self.kind(REPLICASETS), rs["metadata"]["namespace"], rs["metadata"]["name"]
            )

    # ---- status ------------------------------------------------------------------

    def _write_status(self, d: dict, new: dict | None, created: bool) -> float | None:
        spec = d.get("spec") or {}
        replicas = spec.get("replicas", 1)
        rses = self.owned(REPLICASETS, d)
        if new is not None:
            new = next((r for r in rses if r["metadata"]["uid"] == new["metadata"]["uid"]), new)
        old_status = d.get("status") or {}
        status = {
            "observedGeneration": d["metadata"].get("generation", 1),
            "replicas": sum(_status(r, "replicas") for r in rses),
            "updatedReplicas": _status(new, "replicas"),
            "readyReplicas": sum(_status(r, "readyReplicas") for r in rses),
            "availableReplicas": sum(_status(r, "availableReplicas") for r in rses),
        }
        status["unavailableReplicas"] = max(0, replicas - status["availableReplicas"])
        _, unavailable = self._limits(d)
        conditions = list(old_status.get("conditions") or [])
        if status["availableReplicas"] >= replicas - unavailable:
            conditions = set_condition(
                conditions,
                "Available",
                "True",
                "MinimumReplicasAvailable",
                "Deployment has minimum availability.",
                update_time=True,
            )
        else:
            conditions = set_condition(
                conditions,
                "Available",
                "False",
                "MinimumReplicasUnavailable",
                "Deployment does not have minimum availability.",
                update_time=True,
            )
        again, conditions = self._progressing(d, new, status, old_status, conditions, created)
        status["conditions"] = conditions
        self.write_status(DEPLOYMENTS, d, status)
        return again

    def _progressing(
        self,
        d: dict,
        new: dict | None,
        status: dict,
        old: dict,
        conditions: list[dict],
        created: bool,
    ) -> tuple[float | None, list[dict]]:
        spec = d.get("spec") or {}
        replicas = spec.get("replicas", 1)
        rs_name = new["metadata"]["name"] if new is not None else ""
        if spec.get("paused"):
            return None, set_condition(
                conditions,
                "Progressing",
                "Unknown",
                "DeploymentPaused",
                "Deployment is paused",
                update_time=True,
            )
        if (
            status["updatedReplicas"] == replicas
            and status["replicas"] == replicas
            and status["availableReplicas"] == replicas
        ):
            return None, set_condition(
                conditions,
                "Progressing",
                "True",
                "NewReplicaSetAvailable",
                f'ReplicaSet "{rs_name}" has successfully progressed.',
                update_time=True,
            )
        if created:
            return 0.0, set_condition(
                conditions,
                "Progressing",
                "True",
                "NewReplicaSetCreated",
                f'Created new replica set "{rs_name}"',
                update_time=True,
            )
        moved = (
            status["updatedReplicas"] > old.get("updatedReplicas", 0)
            or status["replicas"] - status["updatedReplicas"]
            < old.get("replicas", 0) - old.get("updatedReplicas", 0)
            or status["readyReplicas"] > old.get("readyReplicas", 0)
            or status["availableReplicas"] > old.get("availableReplicas", 0)
        )
        deadline = spec.get("progressDeadlineSeconds", 600)
        current = condition({"status": {"conditions": conditions}}, "Progressing")
        if moved or current is None or current.get("reason") == "NewReplicaSetAvailable":
            out = [c for c in conditions if c.get("type") != "Progressing"]
            now = semantics.now_rfc3339()
            keep = current if current is not None and current.get("status") == "True" else None
            out.append(
                {
                    "type": "Progressing",
                    "status": "True",
                    "reason": "ReplicaSetUpdated",
                    "message": f'ReplicaSet "{rs_name}" is progressing.',
                    "lastUpdateTime": now,
                    "lastTransitionTime": (keep or {}).get("lastTransitionTime", now),
                }
            )
            return float(deadline), out
        if current.get("reason") == "ProgressDeadlineExceeded":
            return None, conditions
        since = parse_time(current.get("lastUpdateTime") or current.get("lastTransitionTime"))
        elapsed = (dt.datetime.now(dt.UTC) - since).total_seconds() if since else 0.0
        if elapsed < deadline:
            return deadline - elapsed, conditions
        return None, set_condition(
            conditions,
            "Progressing",
            "False",
            "ProgressDeadlineExceeded",
            f'ReplicaSet "{rs_name}" has timed out progressing.',
            update_time=True,
        )
